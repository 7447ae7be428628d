"""Every Store operation, on both backends (the real S3 server through the fault proxy,
and a folder), on asyncio, uvloop and trio."""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from async_stager._store import s3 as s3_module
from async_stager._store.objects import TransferOptions
from async_stager._store.store import open_store
from async_stager.errors import CheckpointError, InvalidOptionError, StoreError
from tests.store.s3proxy import FaultProxy, Rule

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

MiB = 1 << 20
SMALL = TransferOptions(part_size=5 * MiB, concurrency=4)


def _data(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


async def test_small_object_round_trip(store_url: str) -> None:
    async with open_store(store_url, SMALL) as store:
        assert await store.head("a/x") is None
        assert not await store.exists("a/x")
        info = await store.put("a/x", b"hello world")
        assert info.key == "a/x" and info.size == 11
        head = await store.head("a/x")
        assert head is not None and head.size == 11 and head.etag
        assert await store.exists("a/x")
        assert await store.get("a/x") == b"hello world"
        assert await store.get("a/x", offset=6) == b"world"
        assert await store.get("a/x", offset=2, length=3) == b"llo"
        await store.put("a/empty", b"")
        assert await store.get("a/empty") == b""
        await store.put("b", bytearray(b"second"))
        assert [o.key for o in await store.list_objects()] == ["a/empty", "a/x", "b"]
        assert [o.key for o in await store.list_objects("a/")] == ["a/empty", "a/x"]
        assert [o.key for o in await store.list_objects("a/x")] == ["a/x"]
        assert [o.size for o in await store.list_objects("a/")] == [0, 11]
        await store.delete(["a/x", "a/missing-is-fine"])
        await store.delete("b")
        assert [o.key for o in await store.list_objects()] == ["a/empty"]


async def test_large_object_in_parallel_parts_into_caller_buffers(
    store_url: str, fault_proxy: FaultProxy
) -> None:
    data = _data(11 * MiB + 123)
    async with open_store(store_url, SMALL) as store:
        done: list[int] = []
        info = await store.put("big", data, progress=done.append)
        assert info.size == len(data) and sum(done) == len(data)
        if store_url.startswith("s3://"):
            assert info.etag.endswith('-3"')  # three parts, one multipart upload
            assert fault_proxy.max_in_flight.get("PUT-part", 0) >= 2  # parts in parallel
        # Into a caller's buffer: a NumPy array (as a CPU tensor's numpy() is), whole...
        out = np.zeros(len(data), dtype=np.uint8)
        assert await store.get_into("big", out) == len(data)
        assert out.tobytes() == data
        if store_url.startswith("s3://"):
            assert fault_proxy.max_in_flight.get("GET", 0) >= 2  # ranged reads in parallel
        # ... and a window of it, from an offset, into a memoryview slice.
        window = bytearray(7 * MiB)
        await store.get_into("big", memoryview(window), offset=3 * MiB + 7)
        assert window == data[3 * MiB + 7 : 10 * MiB + 7]
        assert await store.get("big") == data


async def test_a_list_of_buffers_is_one_object(store_url: str) -> None:
    pieces: list[Any] = [
        _data(3 * MiB, 1),
        np.arange(1000, dtype=np.float32),
        memoryview(_data(4 * MiB, 2)),
        b"tail",
    ]
    whole = b"".join(bytes(memoryview(p).cast("B")) for p in pieces)
    async with open_store(store_url, SMALL) as store:
        info = await store.put("joined", pieces)
        assert info.size == len(whole)
        assert await store.get("joined") == whole


async def test_commit_record_is_written_once_with_if_absent(store_url: str) -> None:
    async with open_store(store_url, SMALL) as store:
        await store.put_record("step-1/commit", b'{"step": 1}', if_absent=True)
        with pytest.raises(StoreError) as e:
            await store.put_record("step-1/commit", b'{"step": 1, "other": true}', if_absent=True)
        assert e.value.reason == "exists"
        assert e.value.key == store.url("step-1/commit") and e.value.key in str(e.value)
        assert isinstance(e.value, CheckpointError)
        assert await store.get("step-1/commit") == b'{"step": 1}'  # the first stays
        await store.put_record("step-1/commit", b"replaced")  # without if_absent: replaced
        assert await store.get("step-1/commit") == b"replaced"


async def test_missing_objects_and_bad_arguments(store_url: str) -> None:
    async with open_store(store_url, SMALL) as store:
        with pytest.raises(StoreError) as e:
            await store.get("nope")
        assert e.value.reason == "missing" and store.url("nope") in str(e.value)
        with pytest.raises(StoreError) as e:
            await store.get_into("nope", bytearray(10))
        assert e.value.reason == "missing"
        await store.put("short", b"0123456789")
        with pytest.raises(StoreError) as e:
            await store.get_into("short", bytearray(8), offset=5)
        assert e.value.reason == "request" and "10 bytes" in str(e.value)
        for key in ["", "/a", "a/", "a//b", "a/../b", "./a"]:
            with pytest.raises(StoreError) as e:
                await store.put(key, b"x")
            assert e.value.reason == "request"
        with pytest.raises(InvalidOptionError):
            await store.get_into("short", b"read-only bytes")
        with pytest.raises(InvalidOptionError):
            await store.get("short", offset=-1)
        with pytest.raises(InvalidOptionError):
            await store.list_objects("/abs")
        # Still usable after every refusal.
        assert await store.get("short") == b"0123456789"


async def test_deletes_are_batched(
    store_url: str, fault_proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(s3_module, "DELETE_BATCH", 3)
    async with open_store(store_url, SMALL) as store:
        keys = [f"k/{i}" for i in range(7)]
        for key in keys:
            await store.put(key, key.encode())
        fault_proxy.clear()
        await store.delete(keys)
        assert await store.list_objects("k/") == []
        if store_url.startswith("s3://"):
            assert fault_proxy.count("POST", r"\?delete") == 3  # 3 + 3 + 1


def test_the_blocking_face_from_a_thread(store_url: str) -> None:
    store = open_store(store_url, SMALL)
    results: list[object] = []

    def writer() -> None:
        b = store.blocking
        b.put("t/a", b"from a thread")
        b.put_record("t/commit", b"c", if_absent=True)
        results.append(b.get("t/a"))
        buf = bytearray(4)
        b.get_into("t/a", buf, offset=5)
        results.append(bytes(buf))
        results.append([o.key for o in b.list_objects("t/")])
        results.append(b.exists("t/a"))
        b.delete(["t/a", "t/commit"])
        results.append(b.list_objects("t/"))

    t = threading.Thread(target=writer)
    t.start()
    t.join(60)
    store.blocking.close()
    assert results == [b"from a thread", b"a th", ["t/a", "t/commit"], True, []]
    assert store._io.thread is not None and not store._io.thread.is_alive()
    with pytest.raises(StoreError) as e:
        store.blocking.head("t/a")
    assert e.value.reason == "closed"


async def test_cancelled_upload_leaves_nothing(store_url: str, fault_proxy: FaultProxy) -> None:
    """Cancelling a put mid-upload aborts it before the cancellation returns: no object
    and no unfinished upload (the parts are freed)."""
    data = _data(16 * MiB)
    # S3: the second part hangs at the server; a folder: the cancel comes mid-write.
    fault_proxy.add(Rule("delay", method="PUT", path=r"partNumber=2\b", delay=30.0))
    async with open_store(store_url, TransferOptions(part_size=5 * MiB, concurrency=1)) as store:
        started = anyio.Event()

        def progress(_n: int) -> None:
            started_threadsafe()

        token = anyio.lowlevel.current_token()

        def started_threadsafe() -> None:
            anyio.from_thread.run_sync(started.set, token=token)

        with anyio.move_on_after(60):
            async with anyio.create_task_group() as tg:

                async def put() -> None:
                    await store.put("cancelled", data, progress=progress)

                tg.start_soon(put)
                await started.wait()
                tg.cancel_scope.cancel()
        assert await store.head("cancelled") is None
        assert await store.list_objects() == []
        assert await store.list_uploads() == []


async def test_store_runs_its_io_off_the_callers_loop(store_url: str) -> None:
    store = open_store(store_url, SMALL)
    await store.put("x", b"1")
    thread = store._io.thread
    assert thread is not None and thread is not threading.current_thread()
    assert thread.name == "async-stager-store" and thread.daemon
    await store.aclose()
    assert not thread.is_alive()
    await store.aclose()  # twice is fine


async def test_open_store_refuses_unknown_urls(tmp_path: os.PathLike[str]) -> None:
    for url in ["gs://b/p", "s3:///nobucket", "file://host/x", "ftp://x"]:
        with pytest.raises(InvalidOptionError):
            open_store(url)
    store = open_store(tmp_path)  # a PathLike is a folder
    assert store.root.startswith("file://")
    await store.aclose()


def test_a_store_from_before_a_fork_is_refused_in_the_child(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    store.blocking.put("x", b"1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork beside threads
        pid = os.fork()
    if pid == 0:  # the child: a clear error, not a wait for a thread that is not there
        try:
            store.blocking.get("x")
        except StoreError as e:
            os._exit(0 if "fork" in str(e) and e.reason == "closed" else 1)
        os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert store.blocking.get("x") == b"1"
    store.blocking.close()


async def test_tensors_of_any_dtype_are_buffers(store_url: str) -> None:
    import torch

    src = torch.randn(1000, 3).to(torch.bfloat16)  # NumPy has no bf16: bytes are read as such
    async with open_store(store_url, SMALL) as store:
        await store.put("t", [src, torch.arange(5)])
        out = torch.empty_like(src)
        await store.get_into("t", out)  # straight into the tensor's memory
        assert torch.equal(out, src)
        tail = torch.empty(5, dtype=torch.int64)
        await store.get_into("t", tail, offset=src.numel() * 2)
        assert torch.equal(tail, torch.arange(5))
        with pytest.raises(InvalidOptionError, match="not contiguous"):
            await store.put("t2", src.t())
        with pytest.raises(InvalidOptionError, match="meta"):
            await store.put("t3", torch.empty(3, device="meta"))
