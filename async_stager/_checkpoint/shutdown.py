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
from async_stager._core.aio.signals import SignalCatcher
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
    inside another, or in sibling tasks, or the memory tier's agent served in the same
    process): a signal reaches every open block that catches it, and one leaving never
    leaves the others deaf (``_core.aio.signals``). An exception raised in the block
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
        # Every catcher of the process is known to the others (``SignalCatcher``): a
        # signal reaches every open Shutdown, and the memory tier's agent service too.
        self._catcher: SignalCatcher | None = None

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
        catcher = SignalCatcher(self.signals, self._caught)
        await catcher.__aenter__()
        self._catcher = catcher
        return self

    def _caught(self, signum: int) -> None:
        """A caught signal (this one's receiver, or another open catcher's)."""
        self.signal = signal.Signals(signum)
        assert self._event is not None
        self._event.set()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        # The block's own exception propagates as it was raised (the catcher's task
        # group is never handed it: ``except ValueError`` around the block still works).
        catcher, self._catcher = self._catcher, None
        assert catcher is not None
        await catcher.__aexit__(None, None, None)
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
