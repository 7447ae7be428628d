"""The awaitable Stager on asyncio, asyncio+uvloop and trio."""

from __future__ import annotations

import random
import time
from typing import Any

import anyio
import pytest
import torch
from helpers import assert_same

from async_stager import ClosedError, Stager, StageStats, UnsupportedTensorError
from async_stager.testing import FakeBackend, FakePinner

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


def small_sd(n: int = 8, value: float = 0.0) -> dict[str, Any]:
    return {f"w{i}": torch.full((16,), value + i) for i in range(n)} | {"step": 3}


async def test_stage_returns_a_staged_copy(anyio_backend: Any, no_thread_leak: None) -> None:
    sd = small_sd()
    async with Stager() as stager:
        staged = await stager.stage(sd)
        assert_same(staged, sd)
        assert staged["w0"].data_ptr() != sd["w0"].data_ptr()
        stats = stager.stats
        assert isinstance(stats, StageStats)
        assert stats.tensors == 8 and stats.bytes == 8 * 64 and stats.cache_misses == 8
        del staged  # a reachable result is never overwritten: drop it to reuse its buffers
        await stager.stage(sd)
        assert stager.stats is not None and stager.stats.fast_path and stager.stats.cache_hits == 8


async def test_fake_device_results_only_after_completion(anyio_backend: Any) -> None:
    backend = FakeBackend(delay=0.02)
    async with Stager(backend=backend) as stager:
        sd = small_sd(50, 1.0)
        staged = await stager.stage(sd)
        assert_same(staged, sd)
        assert stager.stats is not None and stager.stats.polls >= 2
        # Small tensors were batched: a few launches, not one per tensor.
        assert backend.launches <= 3


async def test_constructed_outside_a_loop_used_inside(anyio_backend: Any) -> None:
    stager = Stager()
    try:
        staged = await stager.stage({"a": torch.ones(3)})
        assert torch.equal(staged["a"], torch.ones(3))
    finally:
        await stager.aclose()


async def test_errors_name_the_path_and_stager_stays_usable(anyio_backend: Any) -> None:
    async with Stager() as stager:
        with pytest.raises(UnsupportedTensorError) as ei:
            await stager.stage({"optim": {"state": {3: {"exp_avg": torch.empty(2, device="meta")}}}})
        assert str(ei.value).startswith("sd['optim']['state'][3]['exp_avg']")
        staged = await stager.stage({"ok": torch.ones(2)})
        assert torch.equal(staged["ok"], torch.ones(2))


async def test_stage_after_close_raises(anyio_backend: Any, no_thread_leak: None) -> None:
    stager = Stager()
    await stager.stage({"a": torch.ones(1)})
    await stager.aclose()
    await stager.aclose()  # idempotent
    assert stager.closed
    with pytest.raises(ClosedError):
        await stager.stage({"a": torch.ones(1)})
    with pytest.raises(ClosedError):
        _ = stager.stage({"a": torch.ones(1)})  # raises at the call: no coroutine


async def test_concurrent_stages_are_serialized(anyio_backend: Any) -> None:
    results: dict[int, Any] = {}
    sds: list[dict[str, Any]] = [{"w": torch.full((1000,), float(i)), "i": i} for i in range(6)]
    async with Stager(max_buffer_sets=6) as stager:

        async def one(i: int) -> None:
            async with stager.snapshot(sds[i]) as staged:
                results[i] = {"w": staged["w"].clone(), "i": staged["i"]}

        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(one, i)
    for i in range(6):
        assert_same(results[i], sds[i])


async def test_snapshot_is_never_overwritten(anyio_backend: Any) -> None:
    w = torch.zeros(256)
    async with Stager(max_buffer_sets=2) as stager:
        async with stager.snapshot({"w": w}) as held:
            for step in range(1, 5):
                w.fill_(float(step))
                later = await stager.stage({"w": w})
                assert torch.equal(later["w"], torch.full((256,), float(step)))
                assert torch.equal(held["w"], torch.zeros(256))
                del later
        assert stager.buffer_sets == 2


async def test_stage_waits_for_a_lease_release(anyio_backend: Any) -> None:
    w = torch.zeros(64)
    async with Stager(max_buffer_sets=1) as stager:
        order: list[str] = []
        async with anyio.create_task_group() as tg, stager.snapshot({"w": w}) as held:

            async def later() -> None:
                w.fill_(1.0)
                staged = await stager.stage({"w": w})
                order.append("staged")
                assert torch.equal(staged["w"], torch.ones(64))

            tg.start_soon(later)
            await anyio.sleep(0.1)
            order.append("released")
            assert torch.equal(held["w"], torch.zeros(64))
            del held  # reachable results are protected too: drop it with the lease
        assert order == ["released", "staged"]


async def test_waiting_for_a_lease_is_cancellable(anyio_backend: Any) -> None:
    async with Stager(max_buffer_sets=1) as stager:
        async with stager.snapshot({"w": torch.zeros(8)}):
            with anyio.move_on_after(0.1) as scope:
                await stager.stage({"w": torch.ones(8)})
            assert scope.cancelled_caught
        # The lease is gone and the stager works.
        staged = await stager.stage({"w": torch.ones(8)})
        assert torch.equal(staged["w"], torch.ones(8))


async def test_cancellation_storm_then_correct(anyio_backend: Any) -> None:
    rng = random.Random(1234)
    backend = FakeBackend(delay=0.003)
    sd = {f"w{i}": torch.randn(64) for i in range(200)} | {"big": torch.randn(1 << 16)}
    async with Stager(backend=backend, max_buffer_sets=2) as stager:
        for _ in range(40):
            with anyio.move_on_after(rng.uniform(0, 0.006)):
                if rng.random() < 0.5:
                    await stager.stage(sd)
                else:
                    async with stager.snapshot(sd) as s:
                        assert_same(s, sd)
        for v in sd.values():
            v.add_(1)
        staged = await stager.stage(sd)
        assert_same(staged, sd)
        assert stager.buffer_sets <= 2


async def test_close_during_a_stage(anyio_backend: Any, no_thread_leak: None) -> None:
    stager = Stager(backend=FakeBackend(delay=0.05))
    sd = {f"w{i}": torch.randn(8) for i in range(2000)}
    outcome: list[str] = []

    async def stage() -> None:
        try:
            staged = await stager.stage(sd)
        except ClosedError:
            outcome.append("closed")
        else:
            assert_same(staged, sd)
            outcome.append("staged")

    async with anyio.create_task_group() as tg:
        tg.start_soon(stage)
        await anyio.sleep(0.001)
        await stager.aclose()
    assert outcome in (["closed"], ["staged"])
    with pytest.raises(ClosedError):
        _ = stager.stage(sd)  # raises at the call: no coroutine


async def test_fence_orders_after_the_copies(anyio_backend: Any) -> None:
    backend = FakeBackend(manual=True)
    async with Stager(backend=backend) as stager:
        sd = {"w": torch.randn(32)}
        async with anyio.create_task_group() as tg:
            tg.start_soon(stager.stage, sd)
            await stager.fence()
            # The fence was placed on the enqueued copies' completion, before they ran.
            assert backend.fences and backend.fences[-1] is backend.events[-1]
            assert not backend.events[-1].fired
            backend.complete_all()
    async with Stager() as cpu:
        await cpu.fence()  # nothing staged: no-op
        t = cpu.stage({"w": torch.ones(4)})
        await cpu.fence()  # on the CPU: the copies are done once it returns
        assert torch.equal((await t)["w"], torch.ones(4))


async def test_reserve_pays_allocation_ahead(anyio_backend: Any) -> None:
    pinner = FakePinner()
    sd = {f"w{i}": torch.randn(128) for i in range(20)}
    async with Stager(backend=FakeBackend(), pinner=pinner) as stager:
        stats = await stager.reserve(sd)
        assert stats.cache_misses == 20 and stats.bytes == 20 * 512
        held = stager.host_bytes
        assert pinner.total_registrations == 1
        staged = await stager.stage(sd)
        assert stager.stats is not None and stager.stats.fast_path and stager.stats.cache_misses == 0
        assert stager.host_bytes == held and pinner.total_registrations == 1
        assert_same(staged, sd)
    assert pinner.registered == {}


async def test_on_stage_callback_runs_on_the_loop(anyio_backend: Any) -> None:
    seen: list[StageStats] = []
    sd = small_sd()
    async with Stager(on_stage=seen.append) as stager:
        await stager.stage(sd)
        await stager.stage(sd)
    assert len(seen) == 2 and seen[1].fast_path
    assert seen[0].seconds >= seen[0].worker_seconds >= 0
    assert seen[0].bytes_per_second > 0


async def _ticker_lags(work: Any) -> list[float]:
    """Lateness (seconds) of a 1 ms ticker while ``await work()`` runs."""
    lags: list[float] = []
    done = anyio.Event()

    async def ticker() -> None:
        while not done.is_set():
            t0 = time.perf_counter()
            await anyio.sleep(0.001)
            lags.append(time.perf_counter() - t0 - 0.001)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await anyio.sleep(0.005)
        lags.clear()
        await work()
        done.set()
    return sorted(lags)


def _p99(lags: list[float]) -> float:
    return lags[min(len(lags) - 1, int(len(lags) * 0.99))]


async def test_loop_runs_during_a_stage(anyio_backend: Any) -> None:
    """What holds on a busy machine: while 20k small tensors stage (the walk in the
    worker), the event loop keeps running its other tasks: a 1 ms ticker fires again
    and again during each stage, never waiting for a whole stage. The lag figures
    (p99, max) belong to the benchmark and to ``test_loop_stays_responsive`` (stress)."""
    sd = {f"s{i}": torch.randn(16) for i in range(20_000)}
    async with Stager() as stager:
        await stager.reserve(sd)
        await stager.stage(sd)  # plans built: the cached stage, as a checkpoint loop runs
        seconds: list[float] = []

        async def staging() -> None:
            for _ in range(4):
                t0 = time.perf_counter()
                await stager.stage(sd)
                seconds.append(time.perf_counter() - t0)

        lags = await _ticker_lags(staging)
    assert len(lags) >= 4, f"the loop ran {len(lags)} ticks during 4 stages"
    # No tick waited for as long as the whole work took: the loop was never blocked
    # for a stage (generous: the machine may be loaded).
    assert lags[-1] < max(sum(seconds), 0.05) + 0.5, (lags[-1], seconds)


@pytest.mark.stress
async def test_loop_stays_responsive(anyio_backend: Any) -> None:
    """A 1 ms ticker while staging 20k small tensors plus 128 MiB, against a control
    in the same run: a thread doing the same host copies with no Python work at all.

    The goal (p99 lag under 1 ms, max under 5 ms) is measured and reported by the
    benchmark (docs/benchmarks.md); on this shared 2-core VM the control alone
    misses it at times, and a loaded machine delays every tick (p99 11.5 ms with the
    control at 14.2 ms was seen), so the test asserts the part that is the library's
    doing, relative to the control measured in the same round: the loop is never
    blocked for long (no multi-millisecond GIL hold, no 49 ms stall as with DCP's
    thread): p99 at most 1.5x the control's plus 3 ms, max at most 2x the control's
    plus 10 ms, in at least one of three rounds."""
    sd = {f"s{i}": torch.randn(16) for i in range(20_000)} | {"big": torch.randn(32 << 20)}
    srcs = list(sd.values())
    dsts = [torch.empty_like(t) for t in srcs]

    def plain_copies() -> None:
        # One copy thread, as the default Stager() on 2 cores; put back after, since
        # torch's thread count set here is also the default later threads start from.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for lo in range(0, len(srcs), 1024):
                torch._foreach_copy_(dsts[lo : lo + 1024], srcs[lo : lo + 1024])
        finally:
            torch.set_num_threads(threads)

    rounds: list[str] = []
    async with Stager() as stager:
        await stager.reserve(sd)

        async def staging() -> None:
            for _ in range(8):
                await stager.stage(sd)

        async def control() -> None:
            for _ in range(8):
                await anyio.to_thread.run_sync(plain_copies)

        for _ in range(3):
            ours = await _ticker_lags(staging)
            base = await _ticker_lags(control)
            rounds.append(
                f"p99 {_p99(ours) * 1e3:.2f} ms (control {_p99(base) * 1e3:.2f}), "
                f"max {ours[-1] * 1e3:.2f} ms (control {base[-1] * 1e3:.2f})"
            )
            if _p99(ours) <= 1.5 * _p99(base) + 0.003 and ours[-1] <= 2 * base[-1] + 0.010:
                break
        else:
            pytest.fail("the loop lagged beyond the control in every round: " + "; ".join(rounds))
