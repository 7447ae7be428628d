"""Reliability: injected faults. Host allocation, pinning, copies, the worker thread,
the event loop and close() fail or interfere at the worst moment; each gives a typed
StagingError (or a clean ClosedError), leaves nothing registered or leaked, and the
stager (or a fresh one, after close) stages correctly afterwards."""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import os
import threading
import time
import types
from typing import Any

import anyio
import pytest
import torch
from helpers import assert_same, make_engine, stage_sync

from async_stager import (
    ClosedError,
    CopyError,
    DefaultStager,
    HostAllocationError,
    PinningError,
    Stager,
    StagingError,
)
from async_stager._core.memory import arena as _arena
from async_stager.testing import FakeBackend, FakePinner

pytestmark = [pytest.mark.timeout(300)]  # a hang guard, not a speed check (see CONTRIBUTING.md, "Tests")


def memfds() -> int:
    n = 0
    for f in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{f}").startswith("/memfd:async_stager"):
                n += 1
        except OSError:
            pass
    return n


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def sd_of(n: int = 16, size: int = 1000, value: float = 0.0) -> dict[str, Any]:
    return {f"w{i}": torch.full((size,), value + i) for i in range(n)}


def assert_clean(engine: Any) -> None:
    """No buffer set is leased, selected or holding copies in flight; the engine's
    lock is free."""
    assert engine.sets.cond.acquire(timeout=1.0), "engine lock stuck"
    engine.sets.cond.release()
    for s in engine.sets.all():
        assert s.leases == 0 and not s.busy and not s.inflight, (s.index, s.leases, s.busy, s.inflight)


# -- host allocation -----------------------------------------------------------------


def _enospc(*args: Any, **kwargs: Any) -> Any:
    raise OSError(errno.ENOSPC, "No space left on device")


def _mmap_module_failing() -> Any:
    import mmap

    fake = types.SimpleNamespace(**{k: getattr(mmap, k) for k in dir(mmap) if not k.startswith("__")})
    fake.mmap = _enospc
    return fake


@pytest.mark.parametrize("shared", [False, True])
def test_mmap_failure_is_host_allocation_error(monkeypatch: pytest.MonkeyPatch, shared: bool) -> None:
    pinner = FakePinner()
    engine = make_engine(backend=FakeBackend(), pinner=pinner, share_memory=shared)
    try:
        stage_sync(engine, sd_of(4))  # an arena exists; the next stage needs another
        before_fds, before_arenas = fds(), sum(len(s.pool.arenas) for s in engine.sets.all())
        with monkeypatch.context() as m:
            m.setattr(_arena, "mmap", _mmap_module_failing())
            with pytest.raises(HostAllocationError) as ei:
                stage_sync(engine, sd_of(4, size=400_000))
        assert "No space left" in str(ei.value) and isinstance(ei.value.__cause__, OSError)
        assert fds() == before_fds
        assert sum(len(s.pool.arenas) for s in engine.sets.all()) == before_arenas
        assert len(pinner.registered) == before_arenas
        assert_clean(engine)
        sd = sd_of(4, size=400_000, value=3.0)
        assert_same(stage_sync(engine, sd).result, sd)
    finally:
        engine.close()
    assert pinner.registered == {}


def test_shm_full_is_host_allocation_error(monkeypatch: pytest.MonkeyPatch) -> None:
    gc.collect()
    engine = make_engine(share_memory=True)
    try:
        before, before_memfd = fds(), memfds()
        with monkeypatch.context() as m:
            m.setattr(os, "posix_fallocate", _enospc)
            with pytest.raises(HostAllocationError, match="No space left"):
                stage_sync(engine, sd_of())
        assert fds() == before and memfds() == before_memfd  # the memfd was closed
        assert all(not s.pool.arenas for s in engine.sets.all())
        with monkeypatch.context() as m:
            m.setattr(os, "memfd_create", _enospc)  # e.g. EMFILE, out of descriptors
            with pytest.raises(HostAllocationError):
                stage_sync(engine, sd_of())
        assert fds() == before
        sd = sd_of(value=1.0)
        assert_same(stage_sync(engine, sd).result, sd)
        # One arena: its memfd, and the duplicate Python's mmap keeps of it.
        assert 1 <= memfds() - before_memfd <= 2
    finally:
        engine.close()


# -- pinning -------------------------------------------------------------------------


@pytest.mark.anyio
async def test_pinning_failure_then_recovery(anyio_backend: Any, no_thread_leak: None) -> None:
    pinner = FakePinner(fail=True)
    stager = Stager(backend=FakeBackend(delay=0.001), pinner=pinner, share_memory=True)
    before = fds()
    try:
        with pytest.raises(PinningError):
            await stager.stage(sd_of())
        assert pinner.registered == {} and fds() == before
        assert all(not s.pool.arenas for s in stager._engine.sets.all())
        assert_clean(stager._engine)
        pinner.fail = False
        sd = sd_of(value=2.0)
        assert_same(await stager.stage(sd), sd)
        assert len(pinner.registered) == 1  # one registration per arena
        # A second arena fails to pin: the first stays pinned and usable.
        pinner.fail = True
        with pytest.raises(PinningError):
            await stager.stage(sd_of(2, size=600_000))
        assert len(pinner.registered) == 1
        assert_same(await stager.stage(sd), sd)
    finally:
        await stager.aclose()
    assert pinner.registered == {} and fds() == before


class UnpinFails(FakePinner):
    def unregister(self, ptr: int) -> None:
        del self.registered[ptr]
        raise RuntimeError("cudaHostUnregister failed")


def test_unpinning_failure_still_releases_everything() -> None:
    pinner = UnpinFails()
    engine = make_engine(backend=FakeBackend(), pinner=pinner, share_memory=True, max_buffer_sets=2)
    gc.collect()
    before = memfds()
    stage_sync(engine, sd_of(2, size=300_000), lease=True)
    stage_sync(engine, sd_of(2, size=300_000))  # a second buffer set, a second arena
    assert memfds() > before
    with pytest.raises(StagingError) as ei:
        engine.close()
    assert isinstance(ei.value.__cause__, PinningError)
    del ei
    gc.collect()
    assert memfds() == before, "an arena whose unpinning failed kept its memfd"
    assert pinner.registered == {}


# -- copies --------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("k", [0, 1, 7, 15])
async def test_copy_failure_at_kth_tensor(anyio_backend: Any, k: int) -> None:
    backend = FakeBackend(delay=0.001, fail_copy_at=k)
    # small_tensor_bytes=0: every tensor is copied on its own, so the k-th one fails.
    async with Stager(backend=backend, small_tensor_bytes=0) as stager:
        sd = sd_of(16)
        with pytest.raises(CopyError):
            await stager.stage(sd)
        with pytest.raises(CopyError):  # again: still failing, still typed
            await stager.stage(sd)
        backend.fail_copy_at = None
        assert_same(await stager.stage(sd), sd)
        assert_same(await stager.stage(sd), sd)  # the fast path, too
        assert_clean(stager._engine)


@pytest.mark.anyio
@pytest.mark.parametrize("small", [0, 1 << 20], ids=["direct", "batched"])
async def test_copy_failure_names_the_path(anyio_backend: Any, small: int) -> None:
    bad = torch.arange(8.0)
    backend = FakeBackend(delay=0.001, fail_copy_of=bad)
    sd = {"model": sd_of(4), "optim": {"state": {3: {"exp_avg": bad, "step": torch.tensor(3.0)}}}}
    async with Stager(backend=backend, small_tensor_bytes=small) as stager:
        with pytest.raises(CopyError) as ei:
            await stager.stage(sd)
        assert str(ei.value).startswith("sd['optim']['state'][3]['exp_avg']:"), str(ei.value)
        assert isinstance(ei.value.__cause__, RuntimeError)
        backend.fail_copy_of = None
        assert_same(await stager.stage(sd), sd)
        # Fails on the fast path too (a plan exists now): same typed error.
        backend.fail_copy_of = bad
        with pytest.raises(CopyError, match=r"\['exp_avg'\]"):
            await stager.stage(sd)
        backend.fail_copy_of = None
        assert_same(await stager.stage(sd), sd)
        assert_clean(stager._engine)


def test_partial_copies_of_a_failed_stage_are_waited_for() -> None:
    """Copies enqueued before a failure may still land: the set keeps them as in
    flight, and the next stage into it waits for them before writing."""
    backend = FakeBackend(manual=True, fail_copy_at=3)
    engine = make_engine(backend=backend, small_tensor_bytes=0, max_buffer_sets=1)
    try:
        with pytest.raises(CopyError):
            engine.run(sd_of(8), engine.capture())
        assert engine.sets.all()[0].inflight, "partial copies were forgotten"
        backend.fail_copy_at = None
        backend.manual = False
        backend.complete_all()
        sd = sd_of(8, value=5.0)
        assert_same(stage_sync(engine, sd).result, sd)
    finally:
        engine.close()


# -- the worker thread ---------------------------------------------------------------


@pytest.mark.anyio
async def test_worker_thread_cannot_start(
    anyio_backend: Any, monkeypatch: pytest.MonkeyPatch, no_thread_leak: None
) -> None:
    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    stager = Stager()
    with monkeypatch.context() as m:
        m.setattr(threading.Thread, "start", refuse)
        with pytest.raises(StagingError, match="could not start"):
            await stager.stage(sd_of())
        with pytest.raises(StagingError, match="could not start"):
            _ = stager.stage(sd_of())  # fails at the call, nothing left half-submitted
    sd = sd_of(value=4.0)
    assert_same(await stager.stage(sd), sd)
    await stager.aclose()


def test_default_stager_worker_cannot_start(monkeypatch: pytest.MonkeyPatch, no_thread_leak: None) -> None:
    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    ds = DefaultStager()
    with monkeypatch.context() as m:
        m.setattr(threading.Thread, "start", refuse)
        with pytest.raises(StagingError, match="could not start"):
            ds.stage(sd_of())
    fut = ds.stage(sd_of(value=1.0))
    assert not isinstance(fut, dict)
    assert_same(fut.result(), sd_of(value=1.0))
    ds.close()


# -- the event loop closing under a stage --------------------------------------------


def _big() -> dict[str, Any]:
    return {f"w{i}": torch.full((64,), float(i)) for i in range(8000)}


def test_asyncio_run_ends_during_a_stage(no_thread_leak: None) -> None:
    """asyncio.run() returns (cancelling the stage's task) while the worker is still
    walking: no exception in the thread, no warning, the stager works on a new loop."""
    stager = Stager(backend=FakeBackend(delay=0.2))

    async def main() -> None:
        asyncio.get_running_loop().create_task(stager.stage(_big()))
        await asyncio.sleep(0.005)

    asyncio.run(main())
    assert stager._worker.alive
    sd = sd_of(value=6.0)
    assert_same(asyncio.run(stager.stage(sd)), sd)
    assert_clean(stager._engine)
    stager.close()


def test_loop_closed_with_the_stage_pending(caplog: pytest.LogCaptureFixture, no_thread_leak: None) -> None:
    """The rawest case: loop.close() with the stage's task still pending and the worker
    still running. Its wake-up finds a closed loop and is dropped quietly."""
    stager = Stager(backend=FakeBackend(delay=0.05))
    loop = asyncio.new_event_loop()
    task = loop.create_task(stager.stage(_big()))
    loop.run_until_complete(asyncio.sleep(0.005))
    job = stager._last_job
    assert job is not None
    assert not job.future.done(), "the worker finished before the loop closed: tested nothing"
    loop.close()
    job.future.exception(timeout=30)  # the worker finished after the loop closed
    with caplog.at_level(logging.CRITICAL, logger="asyncio"):
        del task  # "Task was destroyed but it is pending": the user's own doing
        gc.collect()
    sd = sd_of(value=7.0)
    assert_same(asyncio.run(stager.stage(sd)), sd)
    assert_clean(stager._engine)
    stager.close()


def test_trio_run_ends_during_a_stage(no_thread_leak: None) -> None:
    import trio

    stager = Stager(backend=FakeBackend(delay=0.2))

    async def main() -> None:
        with trio.move_on_after(0.005):
            await stager.stage(_big())

    trio.run(main)
    job = stager._last_job
    assert job is not None
    job.future.exception(timeout=30)
    sd = sd_of(value=8.0)
    assert_same(trio.run(stager.stage, sd), sd)
    assert_clean(stager._engine)
    stager.close()


# -- close() during a stage ----------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("when", [0.0, 0.003, 0.03])
async def test_close_during_a_stage(anyio_backend: Any, when: float, no_thread_leak: None) -> None:
    pinner = FakePinner()
    stager = Stager(backend=FakeBackend(delay=0.05), pinner=pinner, share_memory=True)
    before = memfds()
    sd = _big()
    outcome: list[Any] = []

    async def stage() -> None:
        try:
            outcome.append(await stager.stage(sd))
        except ClosedError as e:
            outcome.append(e)

    async with anyio.create_task_group() as tg:
        tg.start_soon(stage)
        await anyio.sleep(when)
        await stager.aclose()
    (res,) = outcome
    if not isinstance(res, ClosedError):
        assert_same(res, sd)  # it finished before the close: it must be whole
    assert stager._engine.sets.all() == [] and pinner.registered == {}
    assert_clean(stager._engine)
    with pytest.raises(ClosedError):
        await stager.stage(sd)
    del res
    outcome.clear()
    gc.collect()
    assert memfds() == before
    async with Stager(backend=FakeBackend(delay=0.001), pinner=pinner) as fresh:
        assert_same(await fresh.stage(sd), sd)


@pytest.mark.anyio
async def test_on_stage_callback_raising_releases_the_lease(anyio_backend: Any) -> None:
    def explode(stats: Any) -> None:
        raise ValueError("callback failed")

    async with Stager(on_stage=explode, max_buffer_sets=1) as stager:
        with pytest.raises(ValueError, match="callback failed"):
            async with stager.snapshot(sd_of()):
                pass
        assert_clean(stager._engine)
        stager._on_stage = None
        with anyio.fail_after(5):  # would wait forever for the leaked lease
            sd = sd_of(value=9.0)
            assert_same(await stager.stage(sd), sd)


def test_default_stager_close_during_stage(no_thread_leak: None) -> None:
    ds = DefaultStager(backend=FakeBackend(delay=0.05))
    fut = ds.stage(_big())
    time.sleep(0.01)
    ds.close()
    assert not isinstance(fut, dict)
    assert fut.done()
    if fut.exception() is None:
        assert_same(fut.result(), _big())
    assert ds._engine.sets.all() == []
