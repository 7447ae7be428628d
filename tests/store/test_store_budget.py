"""The host memory an upload holds is bounded by its byte budget: a part is read from
its source only once its bytes fit, so parts in flight, and the Python memory the
upload allocates (measured with tracemalloc), stay within the budget."""

from __future__ import annotations

import asyncio
import os
import tracemalloc

import anyio
import numpy as np
import pytest

from async_stager._store.budget import ByteBudget
from async_stager._store.objects import TransferOptions, part_size_for
from async_stager._store.store import open_store
from async_stager.errors import InvalidOptionError
from tests.store.s3proxy import FaultProxy

pytestmark = [pytest.mark.timeout(120)]

MiB = 1 << 20
#: What the HTTP stack may copy of a part beyond the part itself (the socket's send
#: buffer copy of the unsent rest, on Python before 3.12) and the client's bookkeeping.
SLACK = 1.0


def _data(n: int) -> np.ndarray:
    return np.random.default_rng(11).integers(0, 256, n, dtype=np.uint8)


# The budget is the store's I/O loop's business, the same whatever loop the caller
# runs (test_store.py runs every operation on all three): one loop here.
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_parts_in_flight_and_memory_stay_within_the_budget(
    bucket: str, proxy: FaultProxy, moto_port: int
) -> None:
    data = _data(21 * MiB)  # 5 parts of 5 MiB; 8 could run at once, the budget lets 2
    options = TransferOptions(part_size=5 * MiB, concurrency=8, budget_bytes=10 * MiB)
    # Memory: straight to the server (the proxy runs in this process: its copies of the
    # bodies would count too).
    direct = {"endpoint_url": f"http://127.0.0.1:{moto_port}"}
    async with open_store(f"s3://{bucket}/r", options, client_options=direct) as store:
        await store.put("warm", b"x")  # the client made, outside the measure
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            before, _ = tracemalloc.get_traced_memory()
            info = await store.put("big", data)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        held = peak - before
        print(f"\nbudget 10 MiB, 8 parts allowed in flight: peak Python memory {held / MiB:.1f} MiB")
        assert info.size == data.nbytes
        assert store.budget.peak <= 10 * MiB and store.budget.held == 0
        assert held <= (1 + SLACK) * 10 * MiB + 2 * MiB
    # Parts in flight, seen at the server's door (through the proxy).
    async with open_store(f"s3://{bucket}/r", options) as store:
        await store.put("big2", data)
        assert 1 < proxy.max_in_flight["PUT-part"] <= 2
        out = np.empty_like(data)
        await store.get_into("big2", out)
        assert np.array_equal(out, data)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_one_budget_shared_by_two_stores_uploads(
    bucket: str, proxy: FaultProxy, tmp_path: os.PathLike[str]
) -> None:
    budget = ByteBudget(10 * MiB)
    options = TransferOptions(part_size=5 * MiB, concurrency=4)
    a = open_store(f"s3://{bucket}/a", options)
    b = open_store(f"s3://{bucket}/b", options)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: a.put("x", _data(15 * MiB), budget=budget))
            tg.start_soon(lambda: b.put("y", _data(15 * MiB), budget=budget))
    finally:
        await a.aclose()
        await b.aclose()
    assert budget.peak <= 10 * MiB and budget.held == 0
    assert proxy.max_in_flight["PUT-part"] <= 2


def test_budget_is_first_come_first_served_and_cancellable() -> None:
    async def main() -> None:
        budget = ByteBudget(10)
        await budget.acquire(6)
        order: list[str] = []

        async def take(name: str, n: int) -> None:
            await budget.acquire(n)
            order.append(name)

        big = asyncio.ensure_future(take("big", 8))
        await asyncio.sleep(0)
        small = asyncio.ensure_future(take("small", 2))  # would fit now, but waits its turn
        await asyncio.sleep(0.01)
        assert order == [] and budget.held == 6
        cancelled = asyncio.ensure_future(take("cancelled", 1))
        await asyncio.sleep(0)
        cancelled.cancel()
        budget.release(6)
        await asyncio.gather(big, small)
        assert order == ["big", "small"] and budget.held == 10 and budget.peak == 10
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        budget.release(10)
        assert budget.held == 0
        with pytest.raises(InvalidOptionError, match="cannot fit budget_bytes=10"):
            await budget.acquire(11)

    asyncio.run(main())


def test_transfer_options_are_checked() -> None:
    for bad in [
        {"part_size": 1 << 20},
        {"part_size": 6 << 30},
        {"concurrency": 0},
        {"budget_bytes": 5 * MiB},
        {"multipart_threshold": 0},
        {"concurrency": True},
        {"multipart_threshold": 200 * MiB, "budget_bytes": 100 * MiB},
    ]:
        with pytest.raises(InvalidOptionError):
            TransferOptions(**bad)  # type: ignore[arg-type]
    assert TransferOptions().budget == 16 * MiB * 8
    # An object too big for 10,000 parts of the preferred size gets bigger parts.
    assert part_size_for(100 * MiB, 16 * MiB) == 16 * MiB
    assert part_size_for(200_000 * MiB, 16 * MiB) == 20 * MiB
