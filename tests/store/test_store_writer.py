"""An object written as a stream (``open_writer``): parts fill from ``write`` calls of
any size and upload in parallel within the byte budget; the object appears at
``close``, whole, or not at all (an error, a cancellation, ``abort``)."""

from __future__ import annotations

import itertools
import threading

import anyio
import numpy as np
import pytest

from async_stager._store.objects import TransferOptions
from async_stager._store.store import open_store
from async_stager.errors import StoreError
from tests.store import s3proxy
from tests.store.s3proxy import FaultProxy, Rule

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """asyncio and trio: what is under test here runs on the store's own loop, and a
    caller on uvloop reaches it as one on asyncio does (test_store.py runs every
    operation on all three)."""
    return str(request.param)


MiB = 1 << 20
OPTS = TransferOptions(part_size=5 * MiB, concurrency=4, budget_bytes=10 * MiB)


def _data(n: int) -> bytes:
    return np.random.default_rng(3).integers(0, 256, n, dtype=np.uint8).tobytes()


async def test_writes_of_any_size_make_one_object(store_url: str, fault_proxy: FaultProxy) -> None:
    data = _data(13 * MiB + 17)
    cuts = [0, 1, 700_000, 5 * MiB, 5 * MiB + 1, 9 * MiB, len(data)]
    async with open_store(store_url, OPTS) as store:
        reused = bytearray(3 * MiB)  # the caller reuses one buffer: write copied it
        async with store.open_writer("stream") as w:
            for a, b in itertools.pairwise(cuts):
                for start in range(a, b, len(reused)):
                    n = min(len(reused), b - start)
                    reused[:n] = data[start : start + n]
                    await w.write(memoryview(reused)[:n])
            assert await store.head("stream") is None  # nothing visible before close
        assert await store.get("stream") == data
        assert store.budget.peak <= 10 * MiB and store.budget.held == 0
        if store_url.startswith("s3://"):
            assert fault_proxy.max_in_flight["PUT-part"] <= 2  # the budget's two parts


async def test_small_and_empty_streams(store_url: str) -> None:
    async with open_store(store_url, OPTS) as store:
        async with store.open_writer("small") as w:
            await w.write(b"abc")
            await w.write(np.arange(3, dtype=np.uint8))
        assert await store.get("small") == b"abc\x00\x01\x02"
        w = store.open_writer("empty")
        info = await w.close()
        assert info.size == 0 and await store.get("empty") == b""
        with pytest.raises(StoreError) as e:
            await w.write(b"late")
        assert e.value.reason == "closed"


async def test_an_error_in_the_block_aborts_and_leaves_nothing(store_url: str) -> None:
    async with open_store(store_url, OPTS) as store:
        with pytest.raises(ZeroDivisionError):
            async with store.open_writer("aborted") as w:
                await w.write(_data(12 * MiB))
                1 / 0  # noqa: B018
        assert await store.head("aborted") is None
        assert await store.list_uploads() == [] and await store.list_objects() == []
        assert store.budget.held == 0


async def test_a_failed_part_fails_the_stream_and_aborts(bucket: str, proxy: FaultProxy) -> None:
    proxy.add(s3proxy.denied(method="PUT", path=r"partNumber=2\b", times=100))
    async with open_store(f"s3://{bucket}/r", OPTS) as store:
        w = store.open_writer("denied")
        with pytest.raises(StoreError) as e:
            for _ in range(6):
                await w.write(_data(2 * MiB))
            await w.close()
        proxy.clear()
        assert e.value.reason == "denied" and store.url("denied") in str(e.value)
        assert await store.list_uploads() == [] and await store.head("denied") is None
        assert store.budget.held == 0


async def test_a_cancelled_write_aborts(store_url: str, fault_proxy: FaultProxy) -> None:
    fault_proxy.add(Rule("delay", method="PUT", path=r"partNumber=", delay=30.0, times=10))
    options = TransferOptions(part_size=5 * MiB, concurrency=1, budget_bytes=5 * MiB)
    async with open_store(store_url, options) as store:
        with anyio.move_on_after(1.0):
            # S3: a write waits for the budget behind a stuck part, cancelled there; a
            # folder writes on, cancelled in the sleep: the block's exit aborts.
            async with store.open_writer("cancelled") as w:
                for _ in range(4):
                    await w.write(_data(5 * MiB))
                await anyio.sleep(60)
        assert await store.head("cancelled") is None
        assert await store.list_uploads() == [] and store.budget.held == 0


def test_the_blocking_writer(store_url: str) -> None:
    store = open_store(store_url, OPTS)
    out: list[object] = []

    def writer() -> None:
        w = store.blocking.open_writer("t/b")
        for _ in range(3):
            w.write(_data(4 * MiB))
        out.append(w.close().size)
        out.append(len(store.blocking.get("t/b")))

    t = threading.Thread(target=writer)
    t.start()
    t.join(60)
    store.blocking.close()
    assert out == [12 * MiB, 12 * MiB]
