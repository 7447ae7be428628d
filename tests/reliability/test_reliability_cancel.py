"""Reliability: cancellation storms on asyncio, uvloop and trio.

Hundreds of stages and snapshot entries are cancelled at random points: during the
walk in the worker, during the copies' enqueueing, during the wait for their
completion, while waiting for a leased buffer set, and inside snapshot blocks. Every
stage that does complete is bit-exact, and afterwards nothing is leaked: no lease, no
copy left in flight, no thread, no file descriptor.
"""

from __future__ import annotations

import os
import random
from typing import Any

import anyio
import pytest
import torch
from helpers import assert_same

from async_stager import Stager
from async_stager.testing import FakeBackend, FakePinner

pytestmark = [pytest.mark.anyio]


#: Filled in by the storms, reported by docs/reliability.md (stress run figures).
FIGURES: dict[str, int] = {}


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def fd_links() -> list[str]:
    out = []
    for f in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{f}"))
        except OSError:
            pass
    return out


def make_sds(rng: random.Random) -> list[dict[str, Any]]:
    """A few state dicts: one reused (fast path), one of other structure, one with
    views and aliases, one big enough that its walk takes milliseconds."""
    base = torch.arange(4096.0)
    return [
        {f"w{i}": torch.full((64,), float(i)) for i in range(300)},
        {"layers": [{"w": torch.randn(32), "b": torch.randn(4)} for _ in range(200)], "step": 7},
        {"base": base, "view": base[10:100], "t": base.view(64, 64).t(), "alias": base},
        {f"p{i}": torch.randn(16) for i in range(3000)},
    ]


async def storm(n: int, seed: int, *, concurrency: int = 1) -> dict[str, int]:
    rng = random.Random(seed)
    sds = make_sds(rng)
    counts = {"cancelled": 0, "completed": 0, "snapshots_cancelled": 0, "snapshots_completed": 0}
    pinner = FakePinner()
    backend = FakeBackend(delay=0.0015)
    fd0 = fds()
    stager = Stager(backend=backend, pinner=pinner, share_memory=True, max_buffer_sets=2)

    async def one(i: int) -> None:
        sd = sds[rng.randrange(len(sds))]
        if rng.random() < 0.1:
            # Fresh tensors now and then: cache misses, new plans, new blocks.
            sd = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}
        timeout = rng.choice([0.0, rng.uniform(0, 0.002), rng.uniform(0, 0.02 * concurrency), float("inf")])
        if rng.random() < 0.3:
            body = rng.uniform(0, 0.004)
            with anyio.move_on_after(timeout) as scope:
                async with stager.snapshot(sd) as snap:
                    assert_same(snap, sd)
                    await anyio.sleep(body)  # cancelled in the block, sometimes
                    assert_same(snap, sd)  # a lease: never overwritten meanwhile
            key = "snapshots_cancelled" if scope.cancelled_caught else "snapshots_completed"
        else:
            with anyio.move_on_after(timeout) as scope:
                out = await stager.stage(sd)
                # Checked before the next await: the next stage may reuse the buffers.
                assert_same(out, sd)
            key = "cancelled" if scope.cancelled_caught else "completed"
        counts[key] += 1

    try:
        if concurrency == 1:
            for i in range(n):
                await one(i)
        else:

            async def lane(j: int) -> None:
                for i in range(j, n, concurrency):
                    await one(i)

            async with anyio.create_task_group() as tg:
                for j in range(concurrency):
                    tg.start_soon(lane, j)
        # Afterwards: every buffer set is stageable and right, and nothing is held.
        engine = stager._engine
        for sd in sds:
            async with stager.snapshot(sd) as snap:
                assert_same(snap, sd)
                assert_same(await stager.stage(sd), sd)  # the other buffer set
        for s in engine.sets.all():
            assert s.leases == 0, "a lease leaked"
            assert not s.busy
            assert s.inflight == [], "copies left in flight"
        assert not stager._abandoned, "abandoned jobs never finished"
        del snap  # the last result: it keeps its arena mapped, as it should
    finally:
        await stager.aclose()
    assert pinner.registered == {}
    assert fds() <= fd0, fd_links()
    return counts


def _check(counts: dict[str, int], n: int) -> None:
    assert sum(counts.values()) == n
    # The storm did storm: a good share of each kind was interrupted.
    assert counts["cancelled"] >= n // 10, counts
    assert counts["completed"] >= n // 10, counts
    assert counts["snapshots_cancelled"] >= 1, counts


@pytest.mark.timeout(90)
async def test_cancellation_storm(anyio_backend: Any, no_thread_leak: None) -> None:
    n = 40  # the stress run storms 1500
    _check(await storm(n, seed=1), n)


@pytest.mark.timeout(90)
async def test_cancellation_storm_concurrent_stages(anyio_backend: Any, no_thread_leak: None) -> None:
    n = 32
    _check(await storm(n, seed=2, concurrency=4), n)


@pytest.mark.timeout(60)
async def test_cancel_at_every_phase(anyio_backend: Any, no_thread_leak: None) -> None:
    """Deterministic points: before the worker starts, mid-walk, mid-wait (the fake
    device's copies land after 30 ms), and right after completion."""
    backend = FakeBackend(delay=0.03)
    sd = {f"w{i}": torch.full((32,), float(i)) for i in range(2000)}
    async with Stager(backend=backend) as stager:
        for timeout in [0.0, 0.0005, 0.002, 0.01, 0.03, 0.06, 1.0]:
            with anyio.move_on_after(timeout):
                out = await stager.stage(sd)
                assert_same(out, sd)
            assert_same(await stager.stage(sd), sd)
        for s in stager._engine.sets.all():
            assert s.leases == 0


@pytest.mark.stress  # skipped unless ASYNC_STAGER_STRESS=1 (conftest.py)
@pytest.mark.timeout(600)
async def test_cancellation_storm_stress(anyio_backend: Any, no_thread_leak: None) -> None:
    n = 1500
    total: dict[str, int] = {}
    for seed, conc in [(10, 1), (11, 4)]:
        counts = await storm(n, seed=seed, concurrency=conc)
        _check(counts, n)
        for k, v in counts.items():
            total[k] = total.get(k, 0) + v
    name = anyio_backend[0] + ("+uvloop" if anyio_backend[1] else "")
    FIGURES[name] = total["cancelled"] + total["snapshots_cancelled"]
    print(f"\n[stress] cancellation storm on {name}: {total}")
