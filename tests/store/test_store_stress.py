"""Longer store runs (``stress``: ASYNC_STAGER_STRESS=1 python -m pytest -m stress -s
tests/store): a 512 MiB object within a 64 MiB budget, and many operations under
random injected faults."""

from __future__ import annotations

import random
import tracemalloc

import numpy as np
import pytest

from async_stager._store.objects import TransferOptions
from async_stager._store.retry import RetryPolicy
from async_stager._store.store import open_store
from tests.store import s3proxy
from tests.store.s3proxy import FaultProxy, Rule

pytestmark = [pytest.mark.stress, pytest.mark.anyio, pytest.mark.timeout(1200)]

MiB = 1 << 20


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_large_object_within_its_budget(bucket: str, moto_port: int) -> None:
    data = np.random.default_rng(5).integers(0, 256, 512 * MiB, dtype=np.uint8)
    options = TransferOptions(part_size=16 * MiB, concurrency=8, budget_bytes=64 * MiB)
    direct = {"endpoint_url": f"http://127.0.0.1:{moto_port}"}
    async with open_store(f"s3://{bucket}/r", options, client_options=direct) as store:
        await store.put("warm", b"x")
        tracemalloc.start()
        try:
            before, _ = tracemalloc.get_traced_memory()
            await store.put("big", data)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        print(f"\n512 MiB in 16 MiB parts, budget 64 MiB: peak Python memory {(peak - before) / MiB:.1f} MiB")
        assert store.budget.peak <= 64 * MiB
        assert peak - before <= 2 * 64 * MiB + 8 * MiB  # see test_store_budget.py
        out = np.empty_like(data)
        await store.get_into("big", out)
        assert np.array_equal(out, data)
        await store.delete("big")


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_many_operations_under_random_faults(bucket: str, proxy: FaultProxy) -> None:
    rng = random.Random(44)
    makers = [
        lambda: s3proxy.slow_down(times=1),
        lambda: s3proxy.internal_error(times=1),
        lambda: Rule("reset", times=1),
        lambda: Rule("cut", method="GET", times=1),
        lambda: Rule("delay", delay=0.05, times=1),
    ]
    retry = RetryPolicy(tries=8, base_delay=0.005, max_delay=0.05)
    async with open_store(
        f"s3://{bucket}/r", TransferOptions(part_size=5 * MiB, retry=retry), seed=9
    ) as store:
        for i in range(200):
            proxy.add(*(rng.choice(makers)() for _ in range(rng.randint(0, 2))))
            size = rng.choice([10, 1000, 6 * MiB])
            payload = rng.randbytes(size)
            await store.put(f"o/{i % 5}", payload)
            assert await store.get(f"o/{i % 5}") == payload
            if i % 20 == 0:
                await store.put_record(f"c/{i}", b"commit", if_absent=True)
        proxy.clear()
        assert len(await store.list_objects("c/")) == 10
        assert await store.list_uploads() == []
