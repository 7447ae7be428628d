"""torch.multiprocessing and DCP's process writer: staged tensors cross without copies.

A staged dict of a shared-memory stager pickled by ``ForkingPickler`` (Queue, Pipe,
DCP's PROCESS executor) is sent as arena references: no tensor byte is copied, one
descriptor goes per arena per message, and the stager keeps staging into its own
arenas afterwards. Proof, besides the pickler's own counters: the staged storages'
addresses and the stager's host bytes are unchanged after pickling, the storages still
lie in the stager's arenas, and a value the parent writes into the arena afterwards is
what the child reads.

One spawned child serves the module's Queue and Pipe tests (spawning costs seconds).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from typing import Any

import pytest
import torch
from helpers import bits

from async_stager import CheckpointStagerConfig, DefaultStager, Stager
from async_stager._cli import process as bench_process
from async_stager._core.aio.internals import internals_of
from async_stager._share import reducers as _mp_reduce

pytestmark = [pytest.mark.timeout(120)]


def _stager(shared: bool = True) -> DefaultStager:
    return DefaultStager(
        CheckpointStagerConfig(use_pinned_memory=False, use_shared_memory=shared, use_async_staging=False)
    )


def _stage(stager: DefaultStager, sd: dict[str, Any]) -> dict[str, Any]:
    out = stager.stage(sd)  # synchronous: use_async_staging=False
    assert isinstance(out, dict)
    return out


def _sd() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 64, generator=g)
    return {
        "w": base,
        "w_t": base.t(),  # a view of the same storage
        "b": torch.randn(100, generator=g).to(torch.bfloat16),
        "z": torch.randn(8, dtype=torch.complex64, generator=g).conj(),
        "n": torch._neg_view(torch.randn(5, generator=g)),
        "p": torch.nn.Parameter(torch.randn(3, generator=g)),
        "i": torch.arange(7, dtype=torch.int64),
        "step": 3,
    }


def _arenas(stager: Any) -> list[Any]:
    handle = internals_of(stager)
    assert handle is not None
    return list(handle.shared_arenas())


def _ranges(stager: Any) -> list[tuple[int, int]]:
    return [(a.base, a.base + a.nbytes) for a in _arenas(stager)]


def _inside(staged: dict[str, Any], ranges: list[tuple[int, int]]) -> bool:
    for v in staged.values():
        if torch.is_tensor(v):
            s = v.untyped_storage()
            if not any(lo <= s.data_ptr() and s.data_ptr() + s.nbytes() <= hi for lo, hi in ranges):
                return False
    return True


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k, v in a.items():
        if torch.is_tensor(v):
            w = b[k]
            assert (
                type(w) is type(v) and w.dtype == v.dtype and w.shape == v.shape and w.stride() == v.stride()
            ), k
            assert (w.is_conj(), w.is_neg(), w.requires_grad) == (v.is_conj(), v.is_neg(), v.requires_grad), k
            assert torch.equal(bits(w.resolve_conj().resolve_neg()), bits(v.resolve_conj().resolve_neg())), k
        else:
            assert v == b[k]


def test_forking_pickler_round_trip_copies_nothing() -> None:
    sd = _sd()
    with _stager() as stager:
        staged = _stage(stager, sd)
        ptrs = {k: v.data_ptr() for k, v in staged.items() if torch.is_tensor(v)}
        host, ranges = stager.host_bytes, _ranges(stager)
        _mp_reduce.counters(reset=True)
        data = ForkingPickler.dumps(staged)
        c = _mp_reduce.counters()
        assert c.copied_bytes == 0 and c.delegated == 0
        assert c.arena_descriptors == len(ranges) == 1  # one per arena, not per tensor
        assert c.by_reference == 6  # 7 tensors, but w and w_t share one storage
        got = pickle.loads(data)
        _assert_same(got, staged)
        _assert_same(got, sd)
        # Aliases stay aliases: w_t views the same storage as w.
        assert got["w_t"].untyped_storage().data_ptr() == got["w"].untyped_storage().data_ptr()
        # Nothing moved on the sending side.
        assert {k: v.data_ptr() for k, v in staged.items() if torch.is_tensor(v)} == ptrs
        assert stager.host_bytes == host and _ranges(stager) == ranges and _inside(staged, ranges)
        # The received tensors are the same memory: a write in one is seen in the other.
        staged["i"][0] = 99
        assert int(got["i"][0]) == 99
        del staged


def _child(inbox: Any, outbox: Any, conn: Any) -> None:
    held: Any = None
    while True:
        op, arg = inbox.get()
        if op == "stop":
            return
        try:
            held = _serve(op, arg, held, outbox, conn)
        except Exception as e:  # noqa: BLE001 - reported to the test, which fails
            outbox.put(("error", repr(e)))


def _serve(op: str, arg: Any, held: Any, outbox: Any, conn: Any) -> Any:
    """One request; returns what the child holds next."""
    if op == "read":
        key, index = arg
        outbox.put(float(held[key].reshape(-1)[index]))
        return held
    if op == "drop":
        outbox.put(None)
        return None
    held = arg if op == "queue" else conn.recv()
    maps: dict[str, int] = {}  # memfd inode -> mappings in this process
    with open("/proc/self/maps") as f:
        for line in f:
            if "memfd:async_stager" in line:
                ino = line.split()[4]
                maps[ino] = maps.get(ino, 0) + 1
    outbox.put((_expected(held), maps))
    return held


@pytest.fixture(scope="module")
def child() -> Iterator[tuple[Any, Any, Any]]:
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    parent_end, child_end = ctx.Pipe()
    p = ctx.Process(target=_child, args=(inbox, outbox, child_end), daemon=True)
    p.start()
    yield inbox, outbox, parent_end
    inbox.put(("stop", None))
    p.join(30)
    if p.is_alive():
        p.kill()


def _expected(sd: dict[str, Any]) -> dict[str, Any]:
    return {
        k: (
            str(v.dtype),
            v.is_conj(),
            v.is_neg(),
            v.detach().resolve_conj().resolve_neg().reshape(-1).tolist(),
        )
        for k, v in sd.items()
        if torch.is_tensor(v)
    }


@pytest.mark.parametrize("channel", ["queue", "pipe"])
def test_spawned_child_sees_the_arena(child: tuple[Any, Any, Any], channel: str) -> None:
    inbox, outbox, conn = child
    sd = _sd()
    with _stager() as stager:
        staged = _stage(stager, sd)
        host, ranges = stager.host_bytes, _ranges(stager)
        _mp_reduce.counters(reset=True)
        if channel == "queue":
            inbox.put(("queue", staged))
        else:
            inbox.put(("pipe", None))
            conn.send(staged)
        got, maps = outbox.get(timeout=60)
        c = _mp_reduce.counters()
        assert c.copied_bytes == 0 and c.delegated == 0 and c.arena_descriptors == 1
        assert got == _expected(sd)
        assert len(maps) == 1  # one arena, mapped once in the child
        assert stager.host_bytes == host and _inside(staged, ranges)
        # Written in the parent after sending: seen in the child (same pages).
        staged["w"][0, 0] = 12345.0
        inbox.put(("read", ("w", 0)))
        assert outbox.get(timeout=30) == 12345.0
        # The parent closes its stager while the child still holds the tensors:
        # the child's mapping stays valid.
        del staged
    inbox.put(("read", ("w", 0)))
    assert outbox.get(timeout=30) == 12345.0
    inbox.put(("drop", None))
    outbox.get(timeout=30)


def test_ten_checkpoints_stay_in_the_stagers_own_memory(child: tuple[Any, Any, Any]) -> None:
    inbox, outbox, _ = child
    sd = _sd()
    with _stager() as stager:
        _mp_reduce.counters(reset=True)
        first: tuple[int, list[tuple[int, int]]] | None = None
        for step in range(10):
            sd["w"].add_(1.0)
            staged = _stage(stager, sd)
            inbox.put(("queue", staged))
            got, _ = outbox.get(timeout=60)
            assert got == _expected(sd), step
            if first is None:
                first = (stager.host_bytes, _ranges(stager))
            assert (stager.host_bytes, _ranges(stager)) == first, step
            assert _inside(staged, first[1]), step
            del staged
        c = _mp_reduce.counters()
        assert c.copied_bytes == 0 and c.delegated == 0
        assert first is not None and c.arena_descriptors == 10 * len(first[1])
    inbox.put(("drop", None))
    outbox.get(timeout=30)


@pytest.mark.anyio
async def test_stager_share_memory_true(anyio_backend: Any) -> None:
    sd = {"a": torch.randn(1000), "b": torch.randn(10, 10)}
    async with Stager(share_memory=True) as stager:
        staged = await stager.stage(sd)
        _mp_reduce.counters(reset=True)
        got = pickle.loads(ForkingPickler.dumps(staged))
        assert _mp_reduce.counters().copied_bytes == 0
        _assert_same(got, sd)
        assert _inside(staged, _ranges(stager))


def test_many_tensors_one_descriptor_per_arena_per_message() -> None:
    sd = {f"t{i}": torch.full((16,), float(i)) for i in range(500)}
    with _stager() as stager:
        staged = _stage(stager, sd)
        arenas = len(_arenas(stager))
        for _ in range(3):
            _mp_reduce.counters(reset=True)
            got = pickle.loads(ForkingPickler.dumps(staged))
            c = _mp_reduce.counters()
            assert (c.by_reference, c.arena_descriptors, c.delegated) == (500, arenas, 0)
            assert all(torch.equal(got[k], v) for k, v in sd.items())
        del staged, got


def test_private_stager_keeps_torchs_behaviour_loudly() -> None:
    sd = {"a": torch.randn(1000)}
    with _stager(shared=False) as stager:
        staged = _stage(stager, sd)
        _mp_reduce.counters(reset=True)
        with pytest.warns(RuntimeWarning, match=r"4000 bytes .* without shared memory .* copies"):
            got = pickle.loads(ForkingPickler.dumps(staged))
        c = _mp_reduce.counters()
        assert (c.by_reference, c.delegated, c.copied_bytes, c.warned) == (0, 1, 4000, 1)
        assert torch.equal(got["a"], sd["a"])
        assert staged["a"].untyped_storage().is_shared()  # torch moved it, as torch does
        del staged


def test_closed_arena_falls_back_loudly() -> None:
    sd = {"a": torch.randn(256)}
    stager = _stager()
    staged = _stage(stager, sd)
    stager.close()  # the staged tensor stays valid memory; the arena's descriptor is gone
    _mp_reduce.counters(reset=True)
    with pytest.warns(
        RuntimeWarning, match=r"1024 bytes cannot be sent by reference \(its arena is closed\)"
    ):
        got = pickle.loads(ForkingPickler.dumps(staged))
    assert torch.equal(got["a"], sd["a"]) and _mp_reduce.counters().copied_bytes == 1024


def test_other_tensors_are_untouched_and_quiet(recwarn: pytest.WarningsRecorder) -> None:
    t = torch.randn(100)
    _mp_reduce.counters(reset=True)
    got = pickle.loads(ForkingPickler.dumps({"t": t}))
    assert torch.equal(got["t"], t) and t.untyped_storage().is_shared()
    c = _mp_reduce.counters()
    assert (c.by_reference, c.delegated, c.warned) == (0, 1, 0)
    assert not [w for w in recwarn if "async_stager" in str(w.message)]


def _fork_child(q: Any, out: Any) -> None:
    sd = q.get()
    out.put({k: v.tolist() for k, v in sd.items()})


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # fork with threads (Python 3.12+)
def test_fork_context_queue() -> None:
    ctx = mp.get_context("fork")
    q, out = ctx.Queue(), ctx.Queue()
    sd = {"a": torch.randn(32), "b": torch.arange(4)}
    with _stager() as stager:
        p = ctx.Process(target=_fork_child, args=(q, out))
        p.start()
        staged = _stage(stager, sd)
        _mp_reduce.counters(reset=True)
        q.put(staged)
        got = out.get(timeout=60)
        p.join(30)
        assert got == {k: v.tolist() for k, v in sd.items()}
        assert _mp_reduce.counters().copied_bytes == 0
        del staged


def _check_group(world: int) -> None:
    checkpoints, nbytes, tensors = 10, 1 << 20, 8
    with tempfile.TemporaryDirectory() as d:
        opts = {"checkpoints": checkpoints, "tensors": tensors, "nbytes": nbytes, "dir": d}
        results = bench_process.run_group("ours", world, opts, timeout=240)
    assert len(results) == world
    for r in results:
        c = r["counters"]
        assert r["exact"], r
        assert c["copied_bytes"] == 0 and c["delegated"] == 0, c
        assert c["by_reference"] == checkpoints * tensors, c
        assert c["arena_descriptors"] <= 2 * checkpoints, c  # one per arena (1 or 2 sets) per message
        assert all(r["in_own_arenas"]), r
        assert r["memory_last"]["rss"] - r["memory_first"]["rss"] < nbytes, r
        assert r["warnings"] == []


@pytest.mark.timeout(300)  # a hang guard: took up to 32 s beside a loaded suite
def test_dcp_process_writer_one_rank() -> None:
    _check_group(1)


@pytest.mark.slow  # 2 ranks, each beside its writer process: CI's second call
@pytest.mark.timeout(300)
def test_dcp_process_writer_two_ranks() -> None:
    _check_group(2)


@pytest.mark.stress
@pytest.mark.timeout(600)
def test_bench_process_all_contenders() -> None:
    rows = bench_process.run_process_bench(list(bench_process.CONTENDERS), 2, 10, 16, 8 << 20)
    by = {r["contender"]: r for r in rows}
    assert by["ours"]["copied_mib"] == 0 and by["ours"]["in_own_arenas"] is True
    assert by["ours-torch-reducers"]["copied_mib"] > 0 and by["ours-torch-reducers"]["in_own_arenas"] is False
    assert all(r["exact"] for r in rows)
    assert by["ours"]["descriptors_per_checkpoint"] < by["dcp"]["descriptors_per_checkpoint"]


def test_file_system_strategy_still_sends_arenas() -> None:
    """The file_system strategy bounds descriptors per storage; ours are per arena, so
    staged storages still go by reference (one descriptor per arena)."""
    before = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        sd = {"a": torch.randn(100), "b": torch.randn(7)}
        with _stager() as stager:
            staged = _stage(stager, sd)
            _mp_reduce.counters(reset=True)
            got = pickle.loads(ForkingPickler.dumps(staged))
            c = _mp_reduce.counters()
            assert (c.by_reference, c.arena_descriptors, c.copied_bytes) == (2, 1, 0)
            assert all(torch.equal(got[k], v) for k, v in sd.items())
            del staged, got
    finally:
        torch.multiprocessing.set_sharing_strategy(before)


def test_python_attributes_and_requires_grad_cross() -> None:
    p = torch.nn.Parameter(torch.randn(4))
    with _stager() as stager:
        staged = _stage(stager, {"p": p, "q": torch.nn.Parameter(torch.randn(2), requires_grad=False)})
        staged["p"].note = "kept"  # a Python attribute
        got = pickle.loads(ForkingPickler.dumps(staged))
        assert type(got["p"]) is torch.nn.Parameter and got["p"].requires_grad
        assert getattr(got["p"], "note", None) == "kept"
        assert type(got["q"]) is torch.nn.Parameter and not got["q"].requires_grad
        assert torch.equal(got["p"].detach(), p.detach())
        del staged, got


def _args_child(staged: dict[str, Any], out: Any) -> None:
    out.put({k: v.tolist() for k, v in staged.items()})


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_process_arguments(method: str) -> None:
    """As a Process argument, pickled while the process is being started (the
    descriptor travels with the new process, not through the resource sharer)."""
    ctx: Any = mp.get_context(method)
    out = ctx.Queue()
    sd = {"a": torch.randn(64), "b": torch.arange(5)}
    with _stager() as stager:
        staged = _stage(stager, sd)
        _mp_reduce.counters(reset=True)
        p = ctx.Process(target=_args_child, args=(staged, out))
        p.start()
        got = out.get(timeout=60)
        p.join(30)
        c = _mp_reduce.counters()
        assert (c.copied_bytes, c.delegated, c.arena_descriptors) == (0, 0, 1)
        assert got == {k: v.tolist() for k, v in sd.items()}
        del staged


class _Received:
    """A descriptor as the receiving side gets it (``DupFd.detach()``)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def detach(self) -> int:
        return self.fd


def test_a_descriptor_naming_another_file_is_refused() -> None:
    """The receiver checks the inode the sender named: a descriptor number reused for
    another file while the message was in flight is refused, never mapped."""
    fd = os.memfd_create("not-an-arena")
    os.ftruncate(fd, 4096)
    st = os.fstat(fd)
    with pytest.raises(RuntimeError, match="names another file"):
        _mp_reduce._attach_arena(_Received(fd), 4096, st.st_dev, st.st_ino + 1)
    with pytest.raises(OSError):
        os.fstat(fd)  # closed by the receiver either way
