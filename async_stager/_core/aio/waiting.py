"""The event-loop adapter: wait for worker results and device events without blocking.

Two waits, both usable on asyncio, uvloop and trio (through anyio; the running library
is told by ``current_async_library`` below, without sniffio):

- ``wait_future``: a ``concurrent.futures.Future`` completed by the worker thread wakes
  the loop through a thread-safe call (asyncio ``call_soon_threadsafe``, trio's token).
  If the loop has already closed when the worker finishes, the wake-up is dropped
  quietly: nobody is waiting any more (anyio #1265 raced exactly there).
- ``poll_completion``: a device completion event is polled with ``query()`` and an
  adaptive back-off, predicted from the bytes in flight and the measured bandwidth, so
  the loop never blocks and its other timers keep firing on time.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import anyio.lowlevel

from async_stager._core.copy.device import Completion
from async_stager.errors import UnsupportedError

__all__ = [
    "Backoff",
    "current_async_library",
    "poll_completion",
    "prepare_backend",
    "threadsafe",
    "wait_future",
    "wait_future_uninterrupted",
]

T = TypeVar("T")


def current_async_library() -> str | None:
    """``"trio"`` or ``"asyncio"`` for the event loop running in this thread, else None.

    Why not sniffio: recent anyio no longer depends on it, and a machine with the
    package copied in (not pip-installed) lacks it. Cheap and non-blocking: trio is
    asked only if something already imported it (a trio run has), then asyncio's
    running-loop slot is read (uvloop fills the same slot).
    """
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            trio.lowlevel.current_trio_token()
        except RuntimeError:
            pass  # not inside trio.run in this thread
        else:
            return "trio"
    if asyncio._get_running_loop() is not None:
        return "asyncio"
    return None


def prepare_backend() -> None:
    """Load anyio's backend for the event loop running in this thread, if one is: anyio
    imports it at its first use, which would otherwise be the first stage's wait (once
    per process, on the first checkpoint's critical path). A no-op outside
    an event loop."""
    if current_async_library() is not None:
        anyio.current_time()  # any call of the backend imports it


def threadsafe(fn: Callable[[], Any]) -> Callable[[], None]:
    """A function any thread may call to run ``fn`` soon on the current event loop."""
    lib = current_async_library()
    if lib == "asyncio":
        loop = asyncio.get_running_loop()

        def call() -> None:
            try:
                loop.call_soon_threadsafe(fn)
            except RuntimeError:
                pass  # the loop is closed: nobody is waiting any more

        return call
    if lib == "trio":
        import trio

        token = trio.lowlevel.current_trio_token()

        def call_trio() -> None:
            try:
                token.run_sync_soon(fn)
            except trio.RunFinishedError:
                pass

        return call_trio
    raise UnsupportedError(
        "async_stager runs on asyncio (or uvloop) and trio: no such event loop is running here"
    )


class _OneShot:
    """A done-callback that lets go of what it wakes once used or no longer wanted.

    Hazard: a ``concurrent.futures.Future`` keeps its callbacks after calling them. A
    plain closure would keep the event, and through it the waiting task and its
    coroutine, alive as long as the future, and a job holds its future: a task whose
    loop closed under it lived until the process ended.
    """

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn: Callable[[], None] | None = fn

    def __call__(self, _fut: Any) -> None:
        fn, self.fn = self.fn, None
        if fn is not None:
            fn()


async def wait_future(fut: Future[T]) -> T:
    """The result of ``fut`` (completed by another thread), without blocking the loop.

    Cancellation: cancelling this wait stops waiting only; the job goes on in its
    thread. Callers that care (the stager) tell the job separately.
    """
    if not fut.done():
        event = anyio.Event()
        wake = _OneShot(threadsafe(event.set))
        fut.add_done_callback(wake)
        try:
            await event.wait()
        finally:
            wake.fn = None
    try:
        return fut.result()
    finally:
        # Hazard: a raised error's traceback holds this frame, this frame holds fut,
        # and fut holds the error: a reference cycle that would keep the callers'
        # frames (and their stager) alive until the cyclic GC runs.
        del fut


async def wait_future_uninterrupted(fut: Future[T]) -> T:
    """The result of ``fut``, waiting for it whatever cancellation comes.

    For work that must not be abandoned half way (a save in flight, closing).

    Cancellation: deferred until ``fut`` is done, then raised; ``fut``'s result is lost
    in that case. Both anyio/trio cancel scopes and a native asyncio ``Task.cancel()``
    are deferred (a shielded scope alone does not hold back the latter). If ``fut``
    failed as well, the cancellation is raised with its error as the cause.
    """
    deferred: BaseException | None = None
    while not fut.done():
        try:
            with anyio.CancelScope(shield=True):
                await wait_future(fut)
        except BaseException as e:  # noqa: BLE001 - a cancellation, or fut's error
            if fut.done() and fut.exception() is e:
                break
            # A native asyncio cancellation reached through the shield: remember it and
            # keep waiting.
            if deferred is None:
                deferred = e
    if deferred is not None:
        exc = fut.exception()
        if exc is not None:
            raise deferred from exc
        raise deferred
    # A cancel scope cancelled meanwhile is delivered here, after the work.
    await anyio.lowlevel.checkpoint_if_cancelled()
    return fut.result()


@dataclass(frozen=True)
class Backoff:
    """Polling delays in seconds: first a bare yield to the loop, then the predicted
    remaining time (halved, so as not to overshoot), within [min_delay, max_delay];
    without a prediction, ``min_delay`` doubling up to ``max_delay``."""

    min_delay: float = 0.0002
    max_delay: float = 0.004

    def next_delay(self, previous: float, remaining: float | None) -> float:
        if remaining is not None and remaining > 0:
            return min(max(remaining / 2, self.min_delay), self.max_delay)
        if previous <= 0:
            return self.min_delay
        return min(previous * 2, self.max_delay)


async def poll_completion(
    event: Completion,
    *,
    expected_seconds: float | None = None,
    backoff: Backoff = Backoff(),
    clock: Callable[[], float] = time.perf_counter,
) -> int:
    """Poll ``event.query()`` until True; returns how many queries it took.

    ``expected_seconds`` is the predicted time from now to completion (bytes in flight
    over measured bandwidth); the back-off follows it. Cancellation: the wait stops
    and the copies go on; the caller keeps their buffers reserved.
    """
    polls = 1
    if event.query():
        return polls
    start = clock()
    # A bare yield first: tiny copies are often done by the time the loop comes back.
    await anyio.lowlevel.checkpoint()
    delay = 0.0
    while True:
        polls += 1
        if event.query():
            return polls
        remaining = None if expected_seconds is None else expected_seconds - (clock() - start)
        delay = backoff.next_delay(delay, remaining)
        await anyio.sleep(delay)
