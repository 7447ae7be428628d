"""A byte budget: how many bytes of parts an upload may hold at once.

A part is read (copied) from its source only after ``acquire`` gave its bytes, and
given back once the store has acknowledged it, so the host memory an upload holds for
its parts is at most the budget, however many parts could run in parallel. Waiters are
served in order (first come, first served: a large part is not starved by small ones).
Thread-safe: one budget may be shared by the uploads of several stores (each on its own
I/O loop); a waiter is woken on its own loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from dataclasses import dataclass, field

from async_stager.errors import InvalidOptionError

__all__ = ["ByteBudget"]


@dataclass
class _Waiter:
    need: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]
    granted: bool = field(default=False)


class ByteBudget:
    """At most ``limit`` bytes held at once; ``peak`` is the most ever held."""

    def __init__(self, limit: int) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise InvalidOptionError(f"budget_bytes={limit!r}: give a number of bytes >= 1")
        self.limit = limit
        self._held = 0
        self.peak = 0
        self._lock = threading.Lock()
        self._waiters: deque[_Waiter] = deque()

    @property
    def held(self) -> int:
        return self._held

    def _take(self, n: int) -> None:
        self._held += n
        self.peak = max(self.peak, self._held)

    async def acquire(self, n: int) -> None:
        """Wait until ``n`` more bytes fit. Cancellation: the wait ends and nothing is
        held (bytes granted meanwhile are given back)."""
        if n > self.limit:
            raise InvalidOptionError(
                f"a part of {n} bytes cannot fit budget_bytes={self.limit}: give a budget of at least "
                "one part (part_size)"
            )
        loop = asyncio.get_running_loop()
        with self._lock:
            if not self._waiters and self._held + n <= self.limit:
                self._take(n)
                return
            waiter = _Waiter(n, loop, loop.create_future())
            self._waiters.append(waiter)
        try:
            await waiter.future
        except BaseException:
            with self._lock:
                granted = waiter.granted
                if not granted:
                    self._waiters.remove(waiter)
            if granted:
                self.release(n)
            else:
                self._grant()  # a large waiter gone may let smaller ones behind it in
            raise

    def release(self, n: int) -> None:
        with self._lock:
            self._held -= n
        self._grant()

    def _grant(self) -> None:
        wake = []
        with self._lock:
            while self._waiters and self._held + self._waiters[0].need <= self.limit:
                waiter = self._waiters.popleft()
                waiter.granted = True
                self._take(waiter.need)
                wake.append(waiter)
        for waiter in wake:
            try:
                waiter.loop.call_soon_threadsafe(_wake, waiter.future)
            except RuntimeError:  # its loop closed: nobody waits, give the bytes back
                self.release(waiter.need)


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
