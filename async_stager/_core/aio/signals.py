"""Signals caught for a block, by every block that asks at once (asyncio, uvloop, trio).

``async with SignalCatcher((SIGTERM, SIGINT), on_signal):`` calls ``on_signal(signum)``
for each of those signals while the block is open (main thread only). It is the one
way the package catches signals: ``Shutdown`` (a training loop's stop at a step
boundary) and the memory tier's agent service both use it, and may be open in one
process at once (an agent served beside a trainer's ``Shutdown``).

Hazard: a signal has one handler. On asyncio a receiver's exit removes the loop's
handler for its signals (the loop keeps one per signal, and puts SIG_DFL back), and a
newer receiver replaces an older one (on trio too: only the newest is told). So two
blocks that each opened their own receiver left one deaf: the one opened first never
heard the signal, and when the one opened last left, a SIGTERM killed the process
(asyncio's SIG_DFL) instead of reaching the other. So the catchers open on this thread
are known here: a caught signal reaches every open one that catches it (on the loop
that caught it), a catcher that leaves hands each of its signals to the newest
remaining one that catches it (which installs its receiver again), and the handler from
before the first one is put back when the last one catching that signal leaves.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel

__all__ = ["SignalCatcher"]


class SignalCatcher:
    """Catches ``signals`` while open (``async with``): ``on_signal(signum)`` runs on the
    event loop for each one caught, by this catcher's receiver or by another open
    catcher's. Outside every block the previous handlers are back. An exception raised
    in the block comes out of it as raised (not in an ExceptionGroup)."""

    def __init__(self, signals: Iterable[signal.Signals], on_signal: Callable[[int], None]) -> None:
        self.signals = tuple(signals)
        self._on_signal = on_signal
        self._tg: anyio.abc.TaskGroup | None = None
        #: Per signal, the receiver this one catches it with and its listener's scope.
        self._receivers: dict[signal.Signals, tuple[Any, anyio.CancelScope]] = {}
        self._loop: Any = None

    async def __aenter__(self) -> SignalCatcher:
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

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        assert self._tg is not None
        tg, self._tg = self._tg, None
        tg.cancel_scope.cancel()
        try:
            # The block's own exception is not handed to the task group: it would come out
            # wrapped in an ExceptionGroup. The listeners are cancelled and end at once; the
            # block's exception (a cancellation included) then propagates as it was raised.
            await tg.__aexit__(None, None, None)
        finally:
            _leave(self)
        return None

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


_open: list[SignalCatcher] = []
#: Per signal caught by an open catcher: its handler from before the first of them.
_before: dict[signal.Signals, Any] = {}


def _join(catcher: SignalCatcher) -> None:
    for sig in catcher.signals:
        if not any(sig in c.signals for c in _open):
            _before[sig] = signal.getsignal(sig)
    try:
        for sig in dict.fromkeys(catcher.signals):
            catcher._listen(sig)
    except BaseException:
        _close(catcher)
        _restore(catcher.signals)
        raise
    _open.append(catcher)


def _deliver(caught_by: SignalCatcher, signum: int) -> None:
    # (Only the catchers of the loop that caught it: one left open by a dead loop is not.)
    others = (c for c in _open if c is not caught_by and signum in c.signals and c._loop == caught_by._loop)
    for catcher in [caught_by, *others]:
        catcher._on_signal(signum)


def _close(catcher: SignalCatcher) -> None:
    for receiver, scope in reversed(list(catcher._receivers.values())):
        scope.cancel()
        receiver.__exit__(None, None, None)
    catcher._receivers.clear()


def _restore(signals: tuple[signal.Signals, ...]) -> None:
    for sig in signals:
        if any(sig in c.signals for c in _open) or sig not in _before:
            continue
        handler = _before.pop(sig)
        if handler is not None and signal.getsignal(sig) != handler:
            signal.signal(sig, handler)


def _leave(catcher: SignalCatcher) -> None:
    _close(catcher)
    if catcher in _open:
        _open.remove(catcher)
    for sig in dict.fromkeys(catcher.signals):
        heirs = [c for c in _open if sig in c.signals and c._tg is not None and c._loop == catcher._loop]
        if heirs:
            heirs[-1]._listen(sig)
    _restore(catcher.signals)
