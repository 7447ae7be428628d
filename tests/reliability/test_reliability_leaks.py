"""Reliability: leaks over many stage cycles, low limits, and the storage cache's truth.

Each cycle stages, checks, and drops its result; over hundreds of cycles (1,000 in the
stress run) the process must not grow: resident memory, file descriptors, threads,
shared-memory segments (memfds, /dev/shm), pin registrations, host arena bytes. Only
this process's own resources are counted (its descriptors and mappings, never the
machine-wide /dev/shm, which other processes change meanwhile). A
closed stager must be collectable without the cyclic GC. With RLIMIT_NOFILE at 256,
30,000 tensors in shared memory still stage. The storage cache never returns a stale
or wrong hit: freed and reused addresses, tensors moved off and back, resized storages.
"""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import textwrap
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import anyio
import pytest
import torch
from helpers import assert_same, make_engine, stage_sync

from async_stager import DefaultStager, Stager
from async_stager.testing import FakeBackend, FakePinner

_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass
class Usage:
    rss: int
    fds: int
    memfds: int
    threads: int
    shm: int

    @staticmethod
    def now() -> Usage:
        gc.collect()
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * _PAGE
        links = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                links.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                pass
        return Usage(
            rss=rss,
            fds=len(links),
            memfds=sum(1 for x in links if x.startswith("/memfd:async_stager")),
            threads=len(_our_threads()),
            shm=_shared_mappings(),
        )


def _shared_mappings() -> int:
    """Shared-memory objects this process maps (files under /dev/shm and memfds,
    /proc/self/maps), each counted once however many ranges map it."""
    seen: set[tuple[str, str]] = set()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            path = fields[5].strip() if len(fields) == 6 else ""
            if path.startswith(("/dev/shm/", "/memfd:")):
                seen.add((fields[3], fields[4]))  # device, inode
    return len(seen)


def _our_threads() -> list[str]:
    # The loop library's own thread caches (trio keeps idle helper threads) are not
    # ours to count; everything else is.
    return [t.name for t in threading.enumerate() if not t.name.startswith("Trio thread")]


def layered(n: int, value: float) -> dict[str, Any]:
    return {
        "model": {f"l{i}.w": torch.full((256,), value + i) for i in range(n)},
        "optim": {"state": {i: {"exp_avg": torch.full((256,), -value - i)} for i in range(n)}},
        "step": int(value),
    }


async def cycles(n: int, *, fresh: bool, shared: bool) -> dict[str, Any]:
    """``n`` stage cycles on one Stager (fake accelerator, pinned, shared memory)."""
    pinner = FakePinner()
    before = Usage.now()
    reused = layered(64, 1.0)
    stager = Stager(backend=FakeBackend(delay=0.0005), pinner=pinner, share_memory=shared)
    host_peak = 0
    mid = before
    try:
        for i in range(n):
            sd = layered(64, float(i)) if fresh else reused
            out = await stager.stage(sd)
            assert_same(out, sd)
            if i % 2:
                async with stager.snapshot(sd) as snap:
                    assert_same(snap, sd)
                del snap
            del out, sd
            host_peak = max(host_peak, stager.host_bytes)
            if i == n // 10:
                mid = Usage.now()  # after warm-up: arenas, plans, torch's own caches
        registrations = pinner.total_registrations
    finally:
        await stager.aclose()
    del stager
    after = Usage.now()
    assert pinner.registered == {}, "pin registrations left after close"
    assert after.fds <= before.fds, (before, after)
    assert after.memfds == before.memfds, (before, after)
    assert after.threads == before.threads, (before, after, _our_threads())
    assert after.shm == before.shm, (before, after)
    if shared:  # the count sees the stager's arenas while it lives
        assert mid.shm > before.shm, (before, mid)
    state_bytes = 2 * 64 * 256 * 4
    # Two buffer sets of about the state dict's size each (plus arena minimum).
    assert host_peak <= 2 * max(state_bytes * 2, 1 << 20), host_peak
    return {
        "cycles": n,
        "rss_delta_after_warmup_mb": (after.rss - mid.rss) / 2**20,
        "rss_delta_total_mb": (after.rss - before.rss) / 2**20,
        "fd_delta": after.fds - before.fds,
        "memfd_delta": after.memfds - before.memfds,
        "thread_delta": after.threads - before.threads,
        "shm_delta": after.shm - before.shm,
        "host_peak_mb": host_peak / 2**20,
        "pin_registrations": registrations,
    }


#: The default run keeps each event loop once and each kind of state dict at least once
#: (60 cycles each: 2-4 s); CI's second call (slow) runs the whole matrix.
_LEAK_DEFAULT = {("asyncio", False), ("uvloop", True), ("trio", False)}
_LEAK_CASES = [
    pytest.param(
        backend,
        fresh,
        id=f"{name}-{'fresh' if fresh else 'reused'}",
        marks=() if (name, fresh) in _LEAK_DEFAULT else pytest.mark.slow,
    )
    for name, backend in (
        ("asyncio", ("asyncio", {})),
        ("uvloop", ("asyncio", {"use_uvloop": True})),
        ("trio", ("trio", {})),
    )
    for fresh in (False, True)
]


@pytest.mark.anyio
@pytest.mark.timeout(90)
@pytest.mark.parametrize(("anyio_backend", "fresh"), _LEAK_CASES)
async def test_stage_cycles_leak_nothing(anyio_backend: Any, fresh: bool, no_thread_leak: None) -> None:
    if anyio_backend[1].get("use_uvloop"):
        pytest.importorskip("uvloop")
    fig = await cycles(60, fresh=fresh, shared=True)
    assert fig["rss_delta_after_warmup_mb"] < 32, fig
    # Reused tensors: arenas made once. Fresh ones: dead sources' blocks are reused.
    assert fig["pin_registrations"] <= (2 if not fresh else 8), fig


@pytest.mark.stress  # skipped unless ASYNC_STAGER_STRESS=1 (conftest.py)
@pytest.mark.anyio
@pytest.mark.timeout(600)
@pytest.mark.parametrize("fresh", [False, True], ids=["reused", "fresh"])
async def test_1000_stage_cycles_stress(anyio_backend: Any, fresh: bool, no_thread_leak: None) -> None:
    fig = await cycles(1000, fresh=fresh, shared=True)
    name = anyio_backend[0] + ("+uvloop" if anyio_backend[1] else "")
    print(f"\n[stress] 1000 cycles {'fresh' if fresh else 'reused'} on {name}: {fig}")
    assert fig["rss_delta_after_warmup_mb"] < 32, fig


def test_default_stager_cycles_leak_nothing(no_thread_leak: None) -> None:
    before = Usage.now()
    ds = DefaultStager()
    for i in range(40):
        sd = layered(32, float(i))
        fut = ds.stage(sd)
        assert not isinstance(fut, dict)
        assert_same(fut.result(), sd)
        del fut
    ds.close()
    del ds
    after = Usage.now()
    assert (after.fds, after.memfds, after.threads, after.shm) == (
        before.fds,
        before.memfds,
        before.threads,
        before.shm,
    ), (before, after)


# -- collectable without the cyclic GC -----------------------------------------------


def test_stager_collectable_without_gc() -> None:
    async def use(stager: Stager) -> None:
        await stager.stage({"a": torch.ones(3)})
        async with stager.snapshot({"b": torch.ones(4)}):
            pass
        try:
            await stager.stage({"m": torch.empty(1, device="meta")})  # an error, too
        except Exception:  # noqa: BLE001
            pass
        with anyio.move_on_after(0):  # and a cancelled stage
            await stager.stage({"c": torch.ones(5)})
        await stager.aclose()

    for backend in ("asyncio", "trio"):
        gc.collect()
        gc.disable()
        try:
            stager = Stager(backend=FakeBackend(delay=0.001), pinner=FakePinner())
            anyio.run(use, stager, backend=backend)
            ref = weakref.ref(stager)
            del stager
            assert ref() is None, f"the Stager lives on in a reference cycle ({backend})"
        finally:
            gc.enable()


def test_default_stager_collectable_without_gc() -> None:
    gc.collect()
    gc.disable()
    try:
        ds = DefaultStager()
        ds.stage({"a": torch.ones(3)}).result()  # type: ignore[union-attr]
        bad = ds.stage({"m": torch.empty(1, device="meta")})
        assert not isinstance(bad, dict)
        assert bad.exception() is not None
        del bad
        ds.close()
        ref = weakref.ref(ds)
        del ds
        assert ref() is None, "the DefaultStager lives on in a reference cycle"
    finally:
        gc.enable()


def test_stager_dropped_without_close_leaks_nothing(no_thread_leak: None) -> None:
    """A stager dropped without close(): its worker thread must not keep it alive, and
    once it is collected the thread ends and its shared-memory descriptors close."""
    before = Usage.now()
    stager = Stager(share_memory=True)
    asyncio.run(stager.stage({"a": torch.ones(2)}))  # type: ignore[arg-type]
    ref = weakref.ref(stager)
    del stager
    gc.collect()
    assert ref() is None
    for t in threading.enumerate():
        if t.name.startswith("async-stager"):
            t.join(5.0)
    after = Usage.now()
    assert (after.threads, after.memfds, after.fds) == (before.threads, before.memfds, before.fds)


# -- low limits ----------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_30k_tensors_in_shared_memory_with_256_fds() -> None:
    code = textwrap.dedent(
        """
        import os, resource, sys
        sys.path.insert(0, "tests")
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
        import torch
        from helpers import make_engine, stage_sync
        from async_stager import DefaultStager
        sd = {f"t{i}": torch.full((16,), float(i)) for i in range(30_000)}
        engine = make_engine(share_memory=True)
        for _ in range(2):
            out = stage_sync(engine, sd).result
            assert all(torch.equal(out[k], sd[k]) for k in sd)
        engine.close()
        ds = DefaultStager()  # DCP's defaults: shared memory, async staging
        out = ds.stage(sd).result()
        assert all(torch.equal(out[k], sd[k]) for k in sd)
        ds.close()
        print("fds", len(os.listdir("/proc/self/fd")))
        """
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=110, check=False
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert int(r.stdout.split()[-1]) < 64


# -- the storage cache's truth -------------------------------------------------------


def test_freed_source_address_reused_never_stale() -> None:
    # The CPU copier: a fake accelerator would hold the sources until its next stage
    # (as record_stream does), so their addresses would not come free.
    engine = make_engine()
    try:
        reused = 0
        for i in range(50):
            x = torch.full((4096,), float(i))
            ptr = x.data_ptr()
            assert torch.equal(stage_sync(engine, {"a": x}).result["a"], x)
            del x
            y = torch.empty(4096)
            reused += y.data_ptr() == ptr
            y.fill_(1000.0 + i)
            out = stage_sync(engine, {"a": y}).result
            assert torch.equal(out["a"], y), f"stale hit at cycle {i}"
        assert reused, "the allocator never reused an address: the test tested nothing"
    finally:
        engine.close()


def test_tensor_moved_off_and_back_never_stale() -> None:
    engine = make_engine()
    try:
        p = torch.nn.Parameter(torch.zeros(1000))
        sd = {"p": p, "q": torch.ones(10)}
        seen: set[int] = set()
        back = 0
        for i in range(30):
            # "Off the device and back": new storage each time, often at an address
            # an earlier storage had (then the fast path's fingerprint matches); new
            # values each time.
            p.data = p.data.clone()
            p.data.fill_(float(i))
            back += p.data_ptr() in seen
            seen.add(p.data_ptr())
            out = stage_sync(engine, sd).result
            assert torch.equal(out["p"], p) and float(out["p"][0].detach()) == i, i
        assert back, "never back at an old address: the test tested nothing"
    finally:
        engine.close()


def test_resized_storage_never_a_wrong_hit() -> None:
    engine = make_engine(backend=FakeBackend())
    try:
        t = torch.arange(100.0)
        v = t[10:20]
        sd = {"t": t, "v": v}
        assert_same(stage_sync(engine, sd).result, sd)
        t.resize_(400)  # grows: new memory, same StorageImpl
        t[:] = torch.arange(400.0) * 2
        v2 = t[10:20]
        sd2 = {"t": t, "v": v2}
        assert_same(stage_sync(engine, sd2).result, sd2)
        t.untyped_storage().resize_(50 * 4)  # shrinks under the tensor's own shape
        t.set_(t.untyped_storage(), 0, (50,), (1,))
        t[:] = -1.0
        sd3 = {"t": t, "v": t[10:20]}
        assert_same(stage_sync(engine, sd3).result, sd3)
        # Swap two tensors' storages in place: same shapes and dtypes, other memory.
        a, b = torch.full((64,), 1.0), torch.full((64,), 2.0)
        sd4 = {"a": a, "b": b}
        assert_same(stage_sync(engine, sd4).result, sd4)
        a.data, b.data = b.data, a.data
        out = stage_sync(engine, sd4).result
        assert float(out["a"][0]) == 2.0 and float(out["b"][0]) == 1.0
    finally:
        engine.close()
