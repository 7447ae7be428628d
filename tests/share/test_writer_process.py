"""Writer processes: staged shared-memory tensors reach another process without a copy.

One spawned writer process serves the whole module (spawning one costs seconds); each
test sends it a SharedHandle and asks it questions over spawn-context queues.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import torch
from conftest import open_fds
from helpers import assert_same

from async_stager import (
    CheckpointStagerConfig,
    DefaultStager,
    HostAllocationError,
    SharedHandle,
    Stager,
    StagingError,
    UnsupportedError,
    attach_shared,
    export_shared,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


def _memfd_mappings() -> dict[int, int]:
    """inode -> number of mappings of async_stager memfds in this process."""
    out: dict[int, int] = {}
    with open("/proc/self/maps") as f:
        for line in f:
            if "memfd:async_stager" in line:
                ino = int(line.split()[4])
                out[ino] = out.get(ino, 0) + 1
    return out


def _writer_main(inbox: Any, outbox: Any) -> None:
    """The writer process: attach handles and answer questions about what it sees."""
    attached = None
    while True:
        op, arg = inbox.get()
        try:
            if op == "stop":
                return
            if op == "attach":
                fds0 = len(os.listdir("/proc/self/fd"))
                attached = attach_shared(arg)
                fds1 = len(os.listdir("/proc/self/fd"))
                outbox.put(("ok", {"fds_added": fds1 - fds0, "maps": _memfd_mappings()}))
            elif op == "sums":
                assert attached is not None
                sd = attached.state_dict
                outbox.put(("ok", {k: float(v.double().sum()) for k, v in sd.items() if torch.is_tensor(v)}))
                del sd  # a kept tensor keeps its mapping alive (and the test checks it is gone)
            elif op == "read":
                assert attached is not None
                key, index = arg
                outbox.put(("ok", float(attached.state_dict[key].reshape(-1)[index])))
            elif op == "write":
                assert attached is not None
                key, index, value = arg
                attached.state_dict[key].reshape(-1)[index] = value
                outbox.put(("ok", None))
            elif op == "close":
                assert attached is not None
                attached.close()
                attached = None
                outbox.put(("ok", _memfd_mappings()))
            elif op == "attach_error":
                try:
                    attach_shared(arg)
                except StagingError as e:
                    outbox.put(("ok", type(e).__name__))
                else:
                    outbox.put(("ok", None))
        except Exception as e:  # noqa: BLE001 - reported to the test
            outbox.put(("error", repr(e)))


class Writer:
    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.inbox: Any = ctx.Queue()
        self.outbox: Any = ctx.Queue()
        self.proc = ctx.Process(target=_writer_main, args=(self.inbox, self.outbox), daemon=True)
        self.proc.start()

    async def ask(self, op: str, arg: Any = None) -> Any:
        self.inbox.put((op, arg))
        status, value = await anyio.to_thread.run_sync(self.outbox.get, True, 30)
        assert status == "ok", value
        return value

    def stop(self) -> None:
        self.inbox.put(("stop", None))
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
        self.inbox.close()
        self.outbox.close()
        self.inbox.join_thread()
        self.outbox.join_thread()


@pytest.fixture(scope="module")
def writer() -> Iterator[Writer]:
    w = Writer()
    yield w
    w.stop()


def make_sd(n: int, value: float) -> dict[str, Any]:
    sd: dict[str, Any] = {f"w{i}": torch.full((256,), value + i) for i in range(n)}
    sd["big"] = torch.arange(1 << 16, dtype=torch.float32) * value
    sd["step"] = 7
    return sd


async def test_writer_sees_leased_buffers_without_a_copy(anyio_backend: Any, writer: Writer) -> None:
    sd = make_sd(32, 1.0)
    expected = {k: float(v.double().sum()) for k, v in sd.items() if torch.is_tensor(v)}
    async with Stager(share_memory=True) as stager, stager.snapshot(sd) as staged:
        leased_set = stager.stats.buffer_set if stager.stats else None
        handle = export_shared(staged, stager)
        assert handle.tensors == 33 and len(handle.arenas) == 1
        assert handle.nbytes == 32 * 256 * 4 + (1 << 16) * 4
        # Plain data: it pickles without torch's reductions and is small.
        assert len(pickle.dumps(handle)) < 8192
        info = await writer.ask("attach", handle)
        # The writer maps exactly the parent's memfd (same inode), once per arena.
        parent_inode = os.fstat(handle.arenas[0].fd).st_ino
        assert info["maps"] == {parent_inode: 1}
        # fds: at most one per arena in the writer (Python's mmap keeps a dup).
        assert info["fds_added"] <= len(handle.arenas)
        assert await writer.ask("sums") == expected

        # Training goes on: new values, a new stage. It must not touch the lease.
        for v in sd.values():
            if torch.is_tensor(v):
                v.add_(100.0)
        again = await stager.stage(sd)
        assert stager.stats is not None and stager.stats.buffer_set != leased_set
        assert float(again["w0"][0]) == 101.0
        assert await writer.ask("sums") == expected

        # No copy: a write into the parent's leased buffer is visible in the writer.
        staged["big"][5] = -42.0
        assert await writer.ask("read", ("big", 5)) == -42.0
        # ...and the writer's own writes stay private (copy-on-write mapping).
        await writer.ask("write", ("w1", 0, 555.0))
        assert float(staged["w1"][0]) == 2.0
        maps = await writer.ask("close")
        assert parent_inode not in maps


async def test_parent_fds_stay_constant_in_the_number_of_tensors(anyio_backend: Any) -> None:
    sd = {f"t{i}": torch.full((4,), float(i)) for i in range(3000)}
    async with Stager(share_memory=True) as stager:
        before = open_fds()
        async with stager.snapshot(sd) as staged:
            handle = export_shared(staged, stager)
            after = open_fds()
            # One memfd per arena plus Python mmap's dup of it: never per tensor.
            assert after - before <= 2 * len(handle.arenas) <= 4
            assert handle.tensors == 3000
            with attach_shared(handle) as att:  # attach in-process works too
                assert_same(att.state_dict, staged)
                assert open_fds() - after <= len(handle.arenas)


async def test_export_needs_shared_memory(anyio_backend: Any) -> None:
    async with Stager() as stager:
        staged = await stager.stage({"a": torch.ones(3)})
        with pytest.raises(UnsupportedError, match="share_memory=True"):
            export_shared(staged, stager)


async def test_export_rejects_tensors_not_staged_by_the_stager(anyio_backend: Any) -> None:
    async with Stager(share_memory=True) as stager:
        await stager.stage({"a": torch.ones(3)})
        with pytest.raises(UnsupportedError, match="not in this stager's shared buffers"):
            export_shared({"a": torch.ones(3)}, stager)


async def test_structure_aliases_and_types_survive(anyio_backend: Any) -> None:
    base = torch.randn(12)
    sd: dict[str, Any] = {
        "p": torch.nn.Parameter(torch.randn(5)),
        "view": base[2:8],
        "strided": base[::3],
        "t": torch.randn(3, 4).t(),
        "bf16": torch.ones(3, dtype=torch.bfloat16),
        "empty": torch.empty(0, 2),
        "nested": {"list": [torch.arange(4), 3, "x"], "tuple": (torch.zeros(2), None)},
    }
    async with Stager(share_memory=True) as stager, stager.snapshot(sd) as staged:
        with attach_shared(pickle.loads(pickle.dumps(export_shared(staged, stager)))) as att:
            out = att.state_dict
            assert_same(out, sd)
            assert out["view"].untyped_storage().data_ptr() == out["strided"].untyped_storage().data_ptr()
        assert att.closed


async def test_attach_after_the_arena_is_gone_fails_clearly(anyio_backend: Any, writer: Writer) -> None:
    stager = Stager(share_memory=True)
    staged = await stager.stage({"a": torch.ones(1000)})
    handle: SharedHandle = export_shared(staged, stager)
    await stager.aclose()
    del staged
    name = await writer.ask("attach_error", handle)
    assert name in (HostAllocationError.__name__, StagingError.__name__)


async def test_writable_attach_writes_through(anyio_backend: Any) -> None:
    async with Stager(share_memory=True) as stager, stager.snapshot({"w": torch.zeros(8)}) as staged:
        with attach_shared(export_shared(staged, stager), writable=True) as att:
            att.state_dict["w"][3] = 7.0
        assert float(staged["w"][3]) == 7.0


def test_default_stager_results_export_too() -> None:
    sd = {"w": torch.randn(100), "step": 2}
    with DefaultStager(CheckpointStagerConfig(use_async_staging=False)) as stager:
        staged = stager.stage(sd)
        with attach_shared(export_shared(staged, stager)) as att:
            assert_same(att.state_dict, sd)


async def test_the_same_tensor_twice_stays_one_object(anyio_backend: Any) -> None:
    w = torch.randn(6)
    sd = {"a": w, "b": w, "c": [w]}
    async with Stager(share_memory=True) as stager, stager.snapshot(sd) as staged:
        handle = export_shared(staged, stager)
        with attach_shared(handle) as att:
            out = att.state_dict
            assert out["a"] is out["b"] is out["c"][0]
            assert torch.equal(out["a"], w)
