"""The event-loop adapter: wait for worker results and device events without blocking.

Two waits, both usable on asyncio, uvloop and trio (through anyio; the running library
is told by ``current_async_library`` below, without sniffio):

- ``wait_future``: a ``concurrent.futures.Future`` completed by the worker thread wakes
  the loop through a thread-safe call (asyncio ``call_soon_threadsafe``, trio's token).
  If the loop has already closed when the worker finishes, the wake-up is dropped
  quietly: nobody is waiting any more (anyio #1265 raced exactly there).
- ``poll_completion``: a device completion event is polled with ``query()`` and an
  adaptive back-off, predicted from the bytes in flight and the measured bandwidth, so
  the loop never blocks and its other timers keep firing on time; bounded
  (``Backoff.timeout``: DeviceTimeoutError after).

Hazard: an event loop's timers have a resolution of a millisecond (asyncio's and trio's
epoll waits round a timeout up to whole milliseconds; uvloop rounds a delay to the
nearest one, so a sub-millisecond sleep is no sleep at all and the loop spins), so a
back-off of 0.2-4 ms slept on the loop saw a completed copy 1-4 ms late. After a bare
yield, the back-off is slept in a thread of the wait's own, whose sleeps keep
their fractions of a millisecond and whose result wakes the loop at once.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread

from async_stager._core.copy.device import Completion
from async_stager.errors import DeviceTimeoutError, InvalidOptionError, UnsupportedError

__all__ = [
    "DEVICE_WAIT_SECONDS",
    "LOOP_POLL_DELAY",
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


#: The loop's own polls of a completion are at least this far apart (seconds): the
#: thread's polls see it sooner unless the loop is busy (see ``poll_completion``).
LOOP_POLL_DELAY = 0.004

#: Seconds a wait for a device's copies may last by default (``Backoff.timeout``): a
#: healthy device copies far more than the largest state dict in this time. The same
#: bound as the host waits' (``HOST_WAIT_SECONDS``).
DEVICE_WAIT_SECONDS = 600.0


@dataclass(frozen=True)
class Backoff:
    """Polling delays in seconds: first a bare yield to the loop, then the predicted
    remaining time (halved, so as not to overshoot), within [min_delay, max_delay];
    without a prediction, ``min_delay`` doubling up to ``max_delay``. The delays are
    slept in a thread, to the fraction of a millisecond (the loop's timers would round
    them up to whole ones). ``timeout``: seconds a wait for a completion may last,
    then DeviceTimeoutError (None: no bound)."""

    min_delay: float = 0.0002
    max_delay: float = 0.001
    timeout: float | None = DEVICE_WAIT_SECONDS

    def __post_init__(self) -> None:
        for name in ("min_delay", "max_delay", "timeout"):
            v = getattr(self, name)
            if v is None and name == "timeout":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise InvalidOptionError(f"Backoff({name}=...) must be a number of seconds > 0, got {v!r}")
        if self.max_delay < self.min_delay:
            raise InvalidOptionError(
                f"Backoff(max_delay={self.max_delay!r}) is below min_delay={self.min_delay!r}"
            )

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
    over measured bandwidth); the back-off follows it. After a bare yield to the loop,
    two pollers race: a thread of the wait's own polls with ``backoff``'s delays to
    the fraction of a millisecond and wakes the loop as soon as it sees the event
    complete (what an idle loop needs: its own timers would round those delays up to
    whole milliseconds); the loop polls too, every ``LOOP_POLL_DELAY`` or more (what a
    busy loop needs: the thread then waits for the GIL). A query that raises (a device
    error) is raised here.

    Raises DeviceTimeoutError once ``backoff.timeout`` seconds have passed since the
    call without the event completing (a wedged device): the copies may still land, so
    the caller keeps their buffers reserved.

    Cancellation: the wait stops (the thread at its next poll) and the copies go on;
    the caller keeps their buffers reserved.
    """
    polls = 1
    if event.query():
        return polls
    start = clock()
    deadline = None if backoff.timeout is None else time.monotonic() + backoff.timeout
    # A bare yield first: tiny copies are often done by the time the loop comes back.
    await anyio.lowlevel.checkpoint()
    polls += 1
    if event.query():
        return polls

    def remaining() -> float | None:
        return None if expected_seconds is None else expected_seconds - (clock() - start)

    stop = threading.Event()
    # The thread's findings (written there, read on the loop once it has returned).
    seen: dict[str, Any] = {"polls": 0, "done": False, "error": None}
    ended: Future[None] = Future()

    def poll_in_thread() -> None:
        delay = 0.0
        try:
            while True:
                delay = backoff.next_delay(delay, remaining())
                if deadline is not None:
                    delay = max(0.0, min(delay, deadline - time.monotonic()))
                if stop.wait(delay):
                    return  # the loop saw it first, or the wait was cancelled
                seen["polls"] += 1
                if event.query():
                    seen["done"] = True
                    return
                if deadline is not None and time.monotonic() >= deadline:
                    return
        except Exception as e:  # noqa: BLE001 - the device's error: raised on the loop
            seen["error"] = e
        finally:
            ended.set_result(None)  # wakes the loop

    async def thread_poller(scope: anyio.CancelScope) -> None:
        await wait_future(ended)
        scope.cancel()  # the loop's own polling stops: the thread's findings decide

    # A thread of its own for this wait, not anyio's pool: it ends with the wait (joined
    # below, at once: ``stop`` is set first), so no idle worker thread outlives a stage.
    thread = threading.Thread(target=poll_in_thread, name="async-stager-poll", daemon=True)
    thread.start()
    done = False
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(thread_poller, tg.cancel_scope)
            delay = 0.0
            while True:
                delay = backoff.next_delay(delay, remaining())
                await anyio.sleep(max(delay, LOOP_POLL_DELAY))
                polls += 1
                if event.query():
                    done = True
                    tg.cancel_scope.cancel()
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    tg.cancel_scope.cancel()
                    break
    finally:
        stop.set()
        # Hazard: a join on the loop; the thread is at most one ``query()`` away from
        # seeing ``stop`` (it waits on it between polls).
        thread.join()
    polls += int(seen["polls"])
    error = seen["error"]
    if error is not None:
        seen.clear()  # the error's traceback must not keep this frame through ``seen``
        raise error
    if done or seen["done"]:
        return polls
    raise DeviceTimeoutError(
        f"the device's copies still not finished after {backoff.timeout:g} s: the device looks "
        "wedged (a kernel that never ends, an Xid error; see nvidia-smi); their buffers stay "
        "reserved until they land (Backoff(timeout=...) sets the bound)",
        seconds=backoff.timeout or 0.0,
    )
