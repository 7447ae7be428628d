"""The event-loop adapter: polling with back-off, waiting on worker futures."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any

import anyio
import pytest

from async_stager import Backoff
from async_stager._core.aio.waiting import current_async_library, poll_completion, wait_future

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


class CountingEvent:
    """Completes after ``n`` queries; records when each query happened."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.times: list[float] = []

    def query(self) -> bool:
        self.times.append(time.perf_counter())
        return len(self.times) >= self.n

    def synchronize(self) -> None:  # a Completion; polling never blocks on it
        raise AssertionError("poll_completion must not block on the event")


def test_backoff_is_checked() -> None:
    from async_stager import InvalidOptionError

    assert Backoff().timeout == 600.0 and Backoff(timeout=None).timeout is None
    for bad in ({"min_delay": 0}, {"max_delay": -1.0}, {"timeout": 0}, {"timeout": "5"}, {"min_delay": True}):
        with pytest.raises(InvalidOptionError, match=f"Backoff\\({next(iter(bad))}="):
            Backoff(**bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidOptionError, match="below min_delay"):
        Backoff(min_delay=0.01, max_delay=0.001)


def test_backoff_follows_prediction_and_bounds() -> None:
    b = Backoff(min_delay=0.001, max_delay=0.01)
    assert b.next_delay(0.0, None) == 0.001
    assert b.next_delay(0.001, None) == 0.002
    assert b.next_delay(0.008, None) == 0.01  # capped
    assert b.next_delay(0.0, 0.004) == 0.002  # half the predicted remaining time
    assert b.next_delay(0.0, 1.0) == 0.01  # capped
    assert b.next_delay(0.0, 0.0001) == 0.001  # floored
    assert b.next_delay(0.004, -1.0) == 0.008  # prediction passed: back off


async def test_poll_returns_at_once_when_done(anyio_backend: Any) -> None:
    ev = CountingEvent(1)
    assert await poll_completion(ev) == 1


async def test_poll_backs_off_without_blocking(anyio_backend: Any) -> None:
    ev = CountingEvent(6)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await anyio.sleep(0)
            ticks += 1

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        polls = await poll_completion(ev, backoff=Backoff(min_delay=0.002, max_delay=0.008))
        tg.cancel_scope.cancel()
    # Every query counted (the loop's and the thread's: both may query once it is done;
    # a last one of the thread, abandoned once the loop saw it, perhaps not).
    assert 6 <= polls <= len(ev.times) <= polls + 1
    # Other tasks ran meanwhile (the delays' growth: test_backoff_follows_prediction...).
    assert ticks > 6


async def test_poll_with_prediction_wakes_near_it(anyio_backend: Any) -> None:
    # The control: one plain 30 ms sleep on this loop, now (a loaded machine makes
    # every sleep late; the bound below scales with it).
    t0 = time.perf_counter()
    await anyio.sleep(0.03)
    control = time.perf_counter() - t0
    done_at = time.perf_counter() + 0.03

    class Timed(CountingEvent):
        def __init__(self) -> None:
            self.polls = 0

        def query(self) -> bool:
            self.polls += 1
            return time.perf_counter() >= done_at

    ev = Timed()
    t0 = time.perf_counter()
    await poll_completion(ev, expected_seconds=0.03, backoff=Backoff(min_delay=0.001, max_delay=0.05))
    elapsed = time.perf_counter() - t0
    # At most one max_delay (50 ms) past the completion, on a loop as late as the
    # control's: within 3x the control's time (90 ms on a quiet machine, 0.2 s before).
    assert elapsed < 3 * control, (elapsed, control)
    assert ev.polls < 15  # not a busy loop


async def test_poll_is_cancellable(anyio_backend: Any) -> None:
    ev = CountingEvent(10**9)
    with anyio.move_on_after(0.05) as scope:
        await poll_completion(ev)
    assert scope.cancelled_caught


async def test_wait_future_from_another_thread(anyio_backend: Any) -> None:
    fut: Future[int] = Future()
    threading.Timer(0.02, fut.set_result, args=(42,)).start()
    assert await wait_future(fut) == 42
    failed: Future[int] = Future()
    failed.set_exception(ValueError("x"))
    with pytest.raises(ValueError):
        await wait_future(failed)


async def test_wait_future_cancel_leaves_the_job(anyio_backend: Any) -> None:
    fut: Future[int] = Future()
    with anyio.move_on_after(0.02):
        await wait_future(fut)
    fut.set_result(1)  # completing later wakes nobody and raises nothing
    await anyio.sleep(0.01)


def test_wake_after_the_loop_closed_is_quiet() -> None:
    # anyio #1265: the worker finishing after the loop has closed must not raise.
    import asyncio

    fut: Future[int] = Future()
    errors: list[BaseException] = []

    async def main() -> None:
        with anyio.move_on_after(0.01):
            await wait_future(fut)

    asyncio.run(main())

    def finish() -> None:
        try:
            fut.set_result(1)
        except BaseException as e:  # noqa: BLE001 - the failure being tested
            errors.append(e)

    t = threading.Thread(target=finish)
    t.start()
    t.join()
    assert not errors


async def test_wait_future_lets_go_of_its_waiter(anyio_backend: Any) -> None:
    """A concurrent future keeps its callbacks after calling them: what wait_future
    registered must not keep the waiting task (its event) alive through the future,
    whether the wait ended by the result or by cancellation."""
    done: Future[int] = Future()
    threading.Timer(0.01, done.set_result, (1,)).start()
    assert await wait_future(done) == 1
    abandoned: Future[int] = Future()
    with anyio.move_on_after(0.01):
        await wait_future(abandoned)
    for fut in (done, abandoned):
        callbacks = fut._done_callbacks  # type: ignore[attr-defined]
        assert callbacks and all(getattr(cb, "fn", "not a one-shot") is None for cb in callbacks)
    abandoned.set_result(2)  # firing a spent callback is harmless


async def test_current_async_library_names_the_running_loop(anyio_backend: Any) -> None:
    # uvloop fills asyncio's running-loop slot, so it reads as asyncio.
    expected = "trio" if "trio" in str(anyio_backend) else "asyncio"
    assert current_async_library() == expected


def test_current_async_library_outside_a_loop_and_without_sniffio() -> None:
    assert current_async_library() is None
    import async_stager._core.aio.waiting as waiting

    # The package must import where sniffio is not installed (recent anyio dropped it).
    assert "sniffio" not in vars(waiting)
