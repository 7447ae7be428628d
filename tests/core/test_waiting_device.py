"""Waiting for a device's copies from the loop, on the simulated device: the loop sees
a completed copy within a fraction of a millisecond of the device (not the loop
timers' whole milliseconds), and a wedged device is an error after a bound, with the
stager still usable.

Lateness is measured against the simulated stream's end of the copy
(``SimulatedStream.finished_at``) and compared with a control measured alongside: a
thread that blocks on the same kind of copy (no polling) and wakes the loop, which is
as early as the loop can learn anything from another thread on this machine now.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from typing import Any

import anyio
import anyio.to_thread
import pytest
import torch

from async_stager import Backoff, DeviceTimeoutError, Stager
from async_stager._core.aio.waiting import poll_completion
from async_stager._core.copy.primitives import DeviceEvent
from async_stager.testing import SimulatedBackend, SimulatedDevice

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60), pytest.mark.usefixtures("no_thread_leak")]


async def _lateness(sim: SimulatedDevice, control: bool) -> float:
    """Seconds from the end of one copy on the device to the loop seeing it."""
    src = sim.tensor(torch.ones(256))
    dst = torch.empty(256)
    stream = sim.stream("copies")
    with sim.using(stream):
        sim.copy([dst], [src])
        event = DeviceEvent(sim, stream, timeout=30.0)
    if control:

        def block() -> None:
            with sim.cond:
                sim.cond.wait_for(lambda: sim.query(event.event), 30.0)

        await anyio.to_thread.run_sync(block)
    else:
        await poll_completion(event)
    return time.perf_counter() - stream.finished_at


class _Recorded:
    """A completion that records which thread queried it, and when."""

    def __init__(self, event: DeviceEvent) -> None:
        self.event = event
        self.queries: list[tuple[int, float]] = []

    def query(self) -> bool:
        self.queries.append((threading.get_ident(), time.perf_counter()))
        return self.event.query()

    def synchronize(self) -> None:  # pragma: no cover - polling never blocks
        raise AssertionError("poll_completion must not block")


async def test_the_backoff_sleeps_to_the_fraction_of_a_millisecond(anyio_backend: Any) -> None:
    # The loop's timers round a sleep to whole milliseconds (asyncio and trio up,
    # uvloop to the nearest: a 0.2 ms sleep there is none, the loop spins), so the
    # old back-off, slept on the loop, saw a copy 1-4 ms late. Its sub-millisecond
    # delays are slept in a thread now, and the loop polls only every LOOP_POLL_DELAY.
    from async_stager._core.aio.waiting import LOOP_POLL_DELAY

    loop_thread = threading.get_ident()
    # (100 ms: time for many polls of the thread, even when a loaded machine starts it
    # late or makes some of its sleeps long.)
    with SimulatedDevice(seed=5, delay=(0.1, 0.1)) as sim:
        src, dst = sim.tensor(torch.ones(256)), torch.empty(256)
        stream = sim.stream("copies")
        with sim.using(stream):
            sim.copy([dst], [src])  # lands 100 ms from now
            done = _Recorded(DeviceEvent(sim, stream, timeout=30.0))
        t0 = time.perf_counter()
        polls = await poll_completion(done, backoff=Backoff(min_delay=0.0002, max_delay=0.0005))
        took = time.perf_counter() - t0
    # Every query counted, but perhaps a last one of the thread, abandoned once the loop
    # saw the copy done itself.
    assert polls <= len(done.queries) <= polls + 1
    on_loop = [t for who, t in done.queries if who == loop_thread]
    off_loop = [t for who, t in done.queries if who != loop_thread]
    assert off_loop, "every poll ran on the loop: its sleeps were the loop's timers"
    gaps = [b - a for a, b in itertools.pairwise(off_loop)]
    assert gaps and min(gaps) < 0.9e-3, gaps  # sleeps that a loop timer would round up
    # The loop itself: a bare yield, then one poll per LOOP_POLL_DELAY at most.
    assert len(on_loop) <= 2 + took / LOOP_POLL_DELAY + 1, (len(on_loop), took)


@pytest.mark.stress
@pytest.mark.skipif(
    __import__("os").environ.get("ASYNC_STAGER_STRESS") != "1", reason="stress run: set ASYNC_STAGER_STRESS=1"
)
async def test_lateness_against_a_blocking_waiter(anyio_backend: Any) -> None:
    # The figures (``-s``): how late the loop sees copies of 2-7 ms, against a thread
    # blocked on the device's condition (no polling) that wakes the loop.
    late: list[float] = []
    ctrl: list[float] = []
    with SimulatedDevice(seed=5, delay=(0.002, 0.007)) as sim:
        for i in range(200):
            (ctrl if i % 2 else late).append(await _lateness(sim, control=bool(i % 2)))
    late.sort()
    ctrl.sort()
    ours, floor = statistics.median(late), statistics.median(ctrl)
    print(
        f"\n{anyio_backend}: late median {ours * 1e3:.2f} ms, p90 {late[89] * 1e3:.2f} ms; "
        f"blocking waiter median {floor * 1e3:.2f} ms, p90 {ctrl[89] * 1e3:.2f} ms"
    )
    assert ours < floor + Backoff().max_delay, (ours, floor)


async def test_a_wedged_device_is_an_error_after_the_bound_and_the_stager_stays_usable(
    anyio_backend: Any,
) -> None:
    with SimulatedDevice(seed=6) as sim:
        x = sim.tensor(torch.arange(4096, dtype=torch.float32))
        async with Stager(backend=SimulatedBackend(sim), backoff=Backoff(timeout=0.3)) as stager:
            copier_stream = None
            staged = await stager.stage({"x": x})  # the copier exists: wedge its stream
            del staged
            copier_stream = stager._engine._copiers[sim.device].stream  # type: ignore[attr-defined]
            gate = threading.Event()
            with sim.using(copier_stream):
                sim.launch(lambda: gate.wait(60))  # a kernel that never ends (until released)
            t0 = time.monotonic()
            with pytest.raises(DeviceTimeoutError, match=r"0\.3 s: the device looks wedged") as err:
                await stager.stage({"x": x})
            assert err.value.seconds == 0.3 and isinstance(err.value, TimeoutError)
            assert time.monotonic() - t0 >= 0.3
            gate.set()  # the device recovers: the stager stages again, bit-exact
            again = await stager.stage({"x": x})
            assert torch.equal(again["x"], torch.arange(4096, dtype=torch.float32))
        assert sim.errors == []


async def test_polling_stops_when_cancelled(anyio_backend: Any) -> None:
    with SimulatedDevice(seed=7) as sim:
        stream = sim.stream("wedged")
        gate = threading.Event()
        with sim.using(stream):
            sim.launch(lambda: gate.wait(60))
            event = DeviceEvent(sim, stream, timeout=30.0)
        with anyio.move_on_after(0.05) as scope:
            await poll_completion(event)
        assert scope.cancelled_caught
        polls = []

        class Counting:
            def query(self) -> bool:
                polls.append(time.perf_counter())
                return False

            def synchronize(self) -> None:  # pragma: no cover - never called
                raise AssertionError

        with anyio.move_on_after(0.05):
            await poll_completion(Counting())
        n = len(polls)
        await anyio.sleep(0.05)
        assert len(polls) <= n + 1  # the thread stopped at its next poll at most
        gate.set()
