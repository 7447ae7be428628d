"""Shutdown: SIGTERM/SIGINT as an event a training loop checks at step boundaries, and a
final checkpoint within a deadline, for services that get a preemption notice."""

from __future__ import annotations

import math
import numbers
import signal
import time
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import anyio.lowlevel

from async_stager._checkpoint.checkpointer import leave_by
from async_stager.errors import InvalidOptionError, InvalidOptionTypeError

if TYPE_CHECKING:
    from async_stager._checkpoint.checkpointer import Checkpointer

__all__ = ["Shutdown"]

#: Exit statuses of ``Shutdown.final_checkpoint``.
EXIT_SAVED, EXIT_MISSED = 0, 1


class Shutdown:
    """``async with Shutdown() as stop:`` catches ``signals`` (default SIGTERM and
    SIGINT; main thread only, asyncio or trio) for the block; a caught signal sets
    ``stop.requested`` (and ``stop.signal``), so the loop stops at its next step
    boundary instead of being killed mid-step::

        async with Checkpointer(path) as ckpt, Shutdown() as stop:
            while not stop.requested and step < steps:
                train_one_step(); step += 1
                if step % every == 0:
                    await ckpt.save(state, step=step)
            code = await stop.final_checkpoint(ckpt, state, step=step, deadline=25.0)
        sys.exit(code)

    Outside the block the previous handlers are back. Blocks may be open at once (one
    inside another, or in sibling tasks): a signal reaches every open block that
    catches it, and one leaving never leaves the others deaf. An exception raised in the block
    comes out of it as raised (not in an ExceptionGroup), as from a Checkpointer's.
    """

    def __init__(self, signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
        self.signals = signals
        self.signal: signal.Signals | int | None = None
        """The signal caught, as a ``signal.Signals`` (``stop.signal.name`` is
        ``'SIGTERM'``; an int too), 0 after ``request()``; None: none yet."""
        self.seconds: float | None = None
        """How long ``final_checkpoint`` took (None before it ran)."""
        self._event: anyio.Event | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        #: Per signal, the receiver this one catches it with and its listener's scope.
        self._receivers: dict[signal.Signals, tuple[Any, anyio.CancelScope]] = {}
        self._loop: Any = None

    @property
    def requested(self) -> bool:
        """True once a signal was caught (or ``request()`` called)."""
        return self.signal is not None

    def request(self) -> None:
        """Ask for a shutdown as a signal would (e.g. from a health check)."""
        if self.signal is None:
            self.signal = 0
        if self._event is not None:
            self._event.set()

    async def wait(self) -> None:
        """Wait until a shutdown is requested. Cancellation: only the wait."""
        assert self._event is not None, "use Shutdown as `async with Shutdown() as stop:`"
        await self._event.wait()

    async def __aenter__(self) -> Shutdown:
        self._event = anyio.Event()
        self._loop = anyio.lowlevel.current_token()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        try:
            _join(self)
        except BaseException:
            tg, self._tg = self._tg, None
            tg.cancel_scope.cancel()
            await tg.__aexit__(None, None, None)
            raise
        return self

    def _caught(self, signum: int) -> None:
        """A caught signal (this one's receiver, or another open Shutdown's)."""
        self.signal = signal.Signals(signum)
        assert self._event is not None
        self._event.set()

    def _listen(self, sig: signal.Signals) -> None:
        """Catch ``sig`` from now on (a receiver of its own, replacing any this one
        had for it: the newest handler installed is the one the signal reaches)."""
        assert self._tg is not None
        old = self._receivers.pop(sig, None)
        if old is not None:
            old[1].cancel()
            old[0].__exit__(None, None, None)
        receiver = anyio.open_signal_receiver(sig)
        signals = receiver.__enter__()
        scope = anyio.CancelScope()

        async def listen() -> None:
            with scope:
                async for signum in signals:
                    _deliver(self, signum)

        self._receivers[sig] = (receiver, scope)
        self._tg.start_soon(listen)

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        assert self._tg is not None
        tg, self._tg = self._tg, None
        tg.cancel_scope.cancel()
        try:
            # The block's own exception is not handed to the task group: it would come out
            # wrapped in an ExceptionGroup (``except ValueError`` around the block would
            # miss it). The listeners are cancelled and end at once; the block's exception
            # (a cancellation included) then propagates as it was raised.
            await tg.__aexit__(None, None, None)
        finally:
            _leave(self)
        return None

    async def final_checkpoint(
        self, ckpt: Checkpointer, state: dict[str, Any], *, step: int, deadline: float
    ) -> int:
        """Wait for the writes in flight, save ``state`` as ``step`` (unless that step is
        already the newest commit) and wait for it to be committed, all within
        ``deadline`` seconds. Returns 0 (``EXIT_SAVED``) if it was committed in time, 1
        (``EXIT_MISSED``) if the deadline passed first: leaving the Checkpointer's block
        then abandons the saves still in flight instead of waiting for them (so the
        exit status is seen before a SIGKILL): nothing more is committed, their threads
        end with the process, their temporary folders are removed by the next open, and
        the newest earlier commit stays the one a restart restores.

        ``deadline``: seconds, a real number (0 or less: it has passed; ``math.inf``:
        none); NaN or a value that is not a number is refused before anything is saved
        (InvalidOptionError, InvalidOptionTypeError).

        A save in flight's failure propagates. Cancellation: only the wait."""
        if isinstance(deadline, bool) or not isinstance(deadline, numbers.Real):
            raise InvalidOptionTypeError(
                f"final_checkpoint(deadline=...) must be a number of seconds, got {deadline!r} "
                f"({type(deadline).__name__})"
            )
        deadline = float(deadline)
        if math.isnan(deadline):
            raise InvalidOptionError(
                "final_checkpoint(deadline=...) must be a number of seconds, got NaN (a deadline "
                "computed from a missing value?); math.inf waits without one"
            )
        t0 = time.monotonic()
        with anyio.move_on_after(deadline):
            await ckpt.wait()
            if ckpt.last is None or ckpt.last.step != step:
                await ckpt.save(state, step=step)
                await ckpt.wait()
            self.seconds = time.monotonic() - t0
            return EXIT_SAVED
        self.seconds = time.monotonic() - t0
        leave_by(ckpt, anyio.current_time(), EXIT_MISSED)
        return EXIT_MISSED


# -- several Shutdowns at once ------------------------------------------------------------
#
# Hazard: a signal has one handler. On asyncio a receiver's exit removes the loop's
# handler for its signals (the loop keeps one per signal, and puts SIG_DFL back), so an
# inner block's exit left an outer one deaf: a SIGTERM was swallowed (asyncio's
# do-nothing handler stayed installed) and the process was never terminated. So the
# Shutdowns open on this thread are known here: a caught signal reaches every one that
# catches it (an outer loop sees a notice an inner block caught), a block that leaves
# hands each of its signals to the newest remaining one that catches it (which
# installs its handler again), and the handler from before the first one is put back
# when the last one catching that signal leaves (asyncio puts SIG_DFL back, not it).

_open: list[Shutdown] = []
#: Per signal caught by an open Shutdown: its handler from before the first of them.
_before: dict[signal.Signals, Any] = {}


def _join(stop: Shutdown) -> None:
    for sig in stop.signals:
        if not any(sig in s.signals for s in _open):
            _before[sig] = signal.getsignal(sig)
    try:
        for sig in dict.fromkeys(stop.signals):
            stop._listen(sig)
    except BaseException:
        _close(stop)
        _restore(stop.signals)
        raise
    _open.append(stop)


def _deliver(caught_by: Shutdown, signum: int) -> None:
    # (Only the blocks of the loop that caught it: one left open by a dead loop is not.)
    others = (s for s in _open if s is not caught_by and signum in s.signals and s._loop == caught_by._loop)
    for stop in [caught_by, *others]:
        stop._caught(signum)


def _close(stop: Shutdown) -> None:
    for receiver, scope in reversed(list(stop._receivers.values())):
        scope.cancel()
        receiver.__exit__(None, None, None)
    stop._receivers.clear()


def _restore(signals: tuple[signal.Signals, ...]) -> None:
    for sig in signals:
        if any(sig in s.signals for s in _open) or sig not in _before:
            continue
        handler = _before.pop(sig)
        if handler is not None and signal.getsignal(sig) != handler:
            signal.signal(sig, handler)


def _leave(stop: Shutdown) -> None:
    _close(stop)
    if stop in _open:
        _open.remove(stop)
    for sig in dict.fromkeys(stop.signals):
        heirs = [s for s in _open if sig in s.signals and s._tg is not None and s._loop == stop._loop]
        if heirs:
            heirs[-1]._listen(sig)
    _restore(stop.signals)
