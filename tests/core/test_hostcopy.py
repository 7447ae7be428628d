"""Host copies in pieces claimed by several threads (``_hostcopy``): the cuts, bit-exact
results, errors and cancellation, per-thread OpenMP settings, thread lifetimes, and
the engine using it for big CPU programs."""

from __future__ import annotations

import gc
import os
import threading
import time
from typing import Any, ClassVar

import pytest
import torch
from helpers import assert_same, make_engine, stage_sync

from async_stager._core.copy import hostcopy as _hostcopy, openmp as _openmp
from async_stager._core.copy.hostcopy import GROUP_MAX, MIN_POOL_BYTES, CopyPool, Schedule, pieces, schedule
from async_stager._core.copy.openmp import helpers_supported, omp_threads

pytestmark = pytest.mark.timeout(60)

needs_helpers = pytest.mark.skipif(
    not helpers_supported(), reason="torch's OpenMP runtime is not reachable: no helper threads"
)


def _copy_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("async-stager-copy-")]


def _wait_no_copy_threads() -> None:
    deadline = time.monotonic() + 10
    while _copy_threads() and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert not _copy_threads()


def _covered(sched: Schedule, n: int) -> list[int]:
    seen: list[int] = []
    for lo, hi, parts in sched.items:
        assert lo < hi and parts >= 0
        if parts:
            assert hi == lo + 1
        seen.extend(range(lo, hi))
    assert seen == list(range(n)), "every destination once, in order"
    return seen


def test_schedule_cuts_big_contiguous_and_groups_small() -> None:
    piece = 1024
    dsts = [
        torch.empty(10, dtype=torch.float32),  # 40 B
        torch.empty(600, dtype=torch.float32),  # 2400 B: >= 2 pieces, cut in 3
        torch.empty(100, dtype=torch.float64),  # 800 B
        torch.empty(100, dtype=torch.float64),  # 800 B: the group reaches a piece
        torch.empty(40, 30, dtype=torch.float32).t(),  # 4800 B, not contiguous: whole
        torch.empty(0),
        torch.empty(5, dtype=torch.uint8),
    ]
    sched = schedule(dsts, piece)
    assert sched.nbytes == 40 + 2400 + 800 + 800 + 4800 + 0 + 5
    assert sched.items == ((0, 1, 0), (1, 2, 3), (2, 4, 0), (4, 5, 0), (5, 7, 0))
    _covered(sched, len(dsts))


def test_schedule_caps_group_length() -> None:
    dsts = [torch.empty(1) for _ in range(GROUP_MAX * 2 + 5)]
    sched = schedule(dsts)
    assert [hi - lo for lo, hi, _ in sched.items] == [GROUP_MAX, GROUP_MAX, 5]
    _covered(sched, len(dsts))


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool, torch.complex64]


def _source(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:  # only 0 and 1 are bools (copy_ normalizes other bytes)
        return torch.randint(0, 2, (n,), dtype=torch.uint8, generator=g).view(torch.bool)
    size = n * torch.empty(0, dtype=dtype).element_size()
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g).view(dtype)


@pytest.mark.parametrize("helpers", [0, 1, 3])
def test_pieces_copy_bit_exact(helpers: int) -> None:
    piece = 4096
    srcs = [_source(d, 3001 + i, i) for i, d in enumerate(DTYPES)]
    srcs += [torch.arange(7.0), torch.empty(0)]
    # A source whose layout differs from its (contiguous) destination: copied whole.
    odd = torch.arange(4000.0).reshape(40, 100).t()
    dsts = [torch.zeros_like(s) for s in srcs] + [torch.zeros(100, 40)]
    srcs.append(odd)
    sched = schedule(dsts, piece)
    work = pieces(sched, dsts, srcs)
    assert len(work) > len(sched.items), "something was cut"
    pool = CopyPool(helpers)
    try:
        pool.run(work)
    finally:
        pool.close()
    for d, s in zip(dsts, srcs):
        assert d.dtype == s.dtype
        assert torch.equal(d.contiguous().view(torch.uint8), s.contiguous().view(torch.uint8))


@needs_helpers
def test_copy_error_raised_after_every_piece_landed() -> None:
    piece = 4096
    good = [torch.arange(float(5000 + i)) for i in range(6)]
    dsts = [torch.zeros_like(s) for s in good]
    # The third pair cannot be copied (shapes differ and do not broadcast).
    srcs: list[Any] = list(good)
    srcs[2] = torch.arange(7.0)
    sched = schedule(dsts, piece)
    pool = CopyPool(2)
    try:
        with pytest.raises(RuntimeError):
            pool.run(pieces(sched, dsts, srcs))
        # Usable afterwards; nothing still copying into the destinations.
        for d in dsts:
            d.zero_()
        pool.run(pieces(sched, dsts, good))
        for d, s in zip(dsts, good):
            assert torch.equal(d, s)
    finally:
        pool.close()


@pytest.mark.parametrize("helpers", [0, 1])
def test_tick_cancels_between_pieces(helpers: int) -> None:
    class Stop(Exception):
        pass

    srcs = [torch.arange(float(2000)) for _ in range(8)]  # 8000 B each: one piece each
    dsts = [torch.zeros_like(s) for s in srcs]
    stop_at = 3 if helpers == 0 else 1
    calls = 0

    def tick() -> None:
        nonlocal calls
        calls += 1
        if calls == stop_at:
            raise Stop()

    pool = CopyPool(helpers)
    try:
        with pytest.raises(Stop):
            pool.run(pieces(schedule(dsts, 4096), dsts, srcs), tick)
        if helpers == 0:
            # Alone, the calling thread made two guided claims before the stop: half of
            # the 8 pieces, then half of half of the rest.
            assert all(torch.equal(d, s) for d, s in zip(dsts[:6], srcs[:6]))
            assert not any(d.any() for d in dsts[6:])
        pool.run(pieces(schedule(dsts, 4096), dsts, srcs))
        assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    finally:
        pool.close()


@needs_helpers
def test_omp_threads_is_per_thread() -> None:
    main_before = torch.get_num_threads()
    inside = threading.Event()
    release = threading.Event()
    seen: list[int] = []

    def other() -> None:
        with omp_threads(1):
            seen.append(torch.get_num_threads())
            inside.set()
            release.wait(10)
        seen.append(torch.get_num_threads())

    t = threading.Thread(target=other)
    t.start()
    try:
        assert inside.wait(10)
        # The other thread runs single-threaded; this one, and the process default
        # that new threads start from, are untouched.
        assert torch.get_num_threads() == main_before
        fresh: list[int] = []
        probe = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
        probe.start()
        probe.join()
        assert fresh == [main_before]
    finally:
        release.set()
        t.join()
    assert seen == [1, torch.get_num_threads()]


@needs_helpers
def test_helpers_start_lazily_and_stop_on_close() -> None:
    _wait_no_copy_threads()
    pool = CopyPool(2)
    assert not _copy_threads()
    srcs = [torch.arange(float(3000)) for _ in range(8)]
    dsts = [torch.zeros_like(s) for s in srcs]
    pool.run(pieces(schedule(dsts, 4096), dsts, srcs))
    assert len(_copy_threads()) == 2
    pool.close()
    assert not _copy_threads()
    pool.close()  # idempotent
    # Closed: still copies, on the calling thread alone.
    for d in dsts:
        d.zero_()
    pool.run(pieces(schedule(dsts, 4096), dsts, srcs))
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    assert not _copy_threads()


@needs_helpers
def test_dropped_pool_stops_its_helpers() -> None:
    _wait_no_copy_threads()
    pool = CopyPool(1)
    srcs = [torch.arange(float(3000)) for _ in range(4)]
    dsts = [torch.zeros_like(s) for s in srcs]
    pool.run(pieces(schedule(dsts, 4096), dsts, srcs))
    assert len(_copy_threads()) == 1
    del pool
    _wait_no_copy_threads()


@needs_helpers
@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="needs setpriority")
def test_helpers_take_the_creating_threads_priority() -> None:
    _wait_no_copy_threads()
    prios: list[int] = []

    def worker() -> None:
        me = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, me, os.getpriority(os.PRIO_PROCESS, me) + 3)
        pool = CopyPool(1)
        srcs = [torch.arange(float(3000)) for _ in range(4)]
        dsts = [torch.zeros_like(s) for s in srcs]
        pool.run(pieces(schedule(dsts, 4096), dsts, srcs))
        (helper,) = _copy_threads()
        assert helper.native_id is not None
        prios.extend([os.getpriority(os.PRIO_PROCESS, me), os.getpriority(os.PRIO_PROCESS, helper.native_id)])
        pool.close()

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert len(prios) == 2 and prios[0] == prios[1]


@needs_helpers
@pytest.mark.parametrize("copy_threads", [2, 1])
def test_engine_copies_big_cpu_programs_in_pieces(copy_threads: int) -> None:
    """Big programs go in pieces whatever the thread count (one thread drains them
    alone, so checksums can hash each piece as it lands)."""
    _wait_no_copy_threads()
    n = MIN_POOL_BYTES // 4 // 2  # float32 + bfloat16 + float32: over the threshold
    sd: dict[str, Any] = {
        "a": torch.randn(n),
        "b": {"c": torch.randn(n).to(torch.bfloat16), "d": torch.randn(n)},
        "small": [torch.arange(5), 3],
        "t": torch.randn(64, 32).t(),
    }
    eng = make_engine(copy_threads=copy_threads)
    try:
        staged = stage_sync(eng, sd)
        assert_same(staged.result, sd)
        (prog,) = eng.sets.recent.plans[next(iter(eng.sets.recent.plans))].programs  # type: ignore[union-attr]
        assert isinstance(prog.direct_layout, Schedule)
        del staged, prog  # a reachable result is never overwritten: drop it
        # Cached stage with new values: the fast path, through the same pieces.
        for t in (sd["a"], sd["b"]["c"], sd["b"]["d"]):
            t.add_(1)
        staged = stage_sync(eng, sd)
        assert staged.fast_path
        assert_same(staged.result, sd)
        assert len(_copy_threads()) == copy_threads - 1
    finally:
        eng.close()
    assert not _copy_threads(), "closing the engine stops its copy helpers"


def test_module_constants() -> None:
    assert MIN_POOL_BYTES >= 2 * _hostcopy.PIECE_BYTES


def test_claims_are_guided() -> None:
    # Big claims first (few GIL round trips), single pieces at the end (even finish).
    job = _hostcopy.CopyJob([([], [])] * 100, helpers=1)
    sizes = []
    while True:
        lo, hi = job._claim()
        if lo >= hi:
            break
        sizes.append(hi - lo)
    assert sum(sizes) == 100
    assert sizes[:3] == [25, 18, 14] and sizes[-1] == 1
    assert sizes == sorted(sizes, reverse=True)


def test_empty_work_returns() -> None:
    pool = CopyPool(2)
    try:
        pool.run([])
    finally:
        pool.close()


class _Recording(torch.Tensor):
    """A subclass whose ``__torch_function__`` notes the thread it runs on."""

    threads: ClassVar[list[str]] = []

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        cls.threads.append(threading.current_thread().name)
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_helper_copies_like_the_worker() -> None:
    """Grad mode and torch-function overrides are per thread: a helper (here: a fresh
    thread draining a job) must copy sources that require grad without recording
    autograd history into the host buffers, and bypass subclass overrides, as the
    worker does."""
    leaf = torch.randn(3000, requires_grad=True)
    param = torch.nn.Parameter(torch.randn(3000))
    nonleaf = leaf * 2
    sub = torch.randn(3000).as_subclass(_Recording)
    srcs = [leaf, param, nonleaf, sub]
    with torch.no_grad():  # as the engine makes them
        dsts = [torch.zeros(3000) for _ in srcs]
        work = pieces(schedule(dsts, 4096), dsts, srcs)
    _Recording.threads.clear()
    job = _hostcopy.CopyJob(work, helpers=0)
    t = threading.Thread(target=job.drain, name="async-stager-copy-test")
    t.start()
    t.join()
    assert job.error is None, job.error
    assert _Recording.threads == []
    for d, s in zip(dsts, srcs):
        assert d.grad_fn is None and not d.requires_grad
        assert torch.equal(d, torch.Tensor(s.detach()) if isinstance(s, _Recording) else s.detach())


@needs_helpers
def test_engine_stages_grad_tensors_with_helpers() -> None:
    n = MIN_POOL_BYTES // 4 // 2
    model = {"w": torch.nn.Parameter(torch.randn(n)), "v": torch.randn(n, requires_grad=True)}
    sd = {**model, "nonleaf": model["v"] * 2}
    eng = make_engine(copy_threads=2)
    try:
        for i in range(4):
            with torch.no_grad():
                model["w"].add_(1)
            staged = stage_sync(eng, sd)
            assert staged.fast_path == (i > 0)
            for key in ("w", "v", "nonleaf"):
                out = staged.result[key]
                assert torch.equal(out.detach(), sd[key].detach())
                assert out.grad_fn is None
            del staged, out  # dropped: the next stage reuses these buffers
    finally:
        eng.close()


@needs_helpers
def test_reshaped_leaf_is_not_flattened_into_the_old_plan() -> None:
    """A leaf reshaped between stages keeps its fingerprint (pointer, dtype, dim,
    numel); the piece copy must not flatten it into the plan's old shape."""
    base = torch.randn(MIN_POOL_BYTES // 4 + 1024)
    eng = make_engine(copy_threads=2)
    try:
        n = base.numel()
        first = stage_sync(eng, {"x": base.view(n // 1024, 1024)})
        assert first.result["x"].shape == (n // 1024, 1024)
        second = stage_sync(eng, {"x": base.view(1024, n // 1024)})
        assert second.result["x"].shape == (1024, n // 1024)
        assert torch.equal(second.result["x"], base.view(1024, n // 1024))
    finally:
        eng.close()


@needs_helpers
def test_one_big_tensor_is_copied_in_pieces() -> None:
    from async_stager._core.copy.copiers import CpuCopier

    copier = CpuCopier(torch.device("cpu"), threads=2)
    try:
        layout = copier.prepare([torch.empty(MIN_POOL_BYTES * 2, dtype=torch.uint8)])
        assert isinstance(layout, Schedule) and layout.items[0][2] > 1
        assert copier.prepare([torch.empty(MIN_POOL_BYTES // 2, dtype=torch.uint8)]) is None
    finally:
        copier.close()


@needs_helpers
def test_the_openmp_runtime_found_is_torchs() -> None:
    omp = _openmp.runtime()
    assert omp is not None and _openmp._controls_torch(omp)


def test_auto_copy_threads_rule() -> None:
    from async_stager._core.options import (
        AUTO_BIG_SHARE,
        auto_copy_threads,
        loop_friendly_threads,
        usable_cores,
    )

    every = max(1, min(torch.get_num_threads(), usable_cores()))
    assert auto_copy_threads(100, 100) == every
    assert auto_copy_threads(int(AUTO_BIG_SHARE * 100), 100) == every
    assert auto_copy_threads(10, 100) == loop_friendly_threads()
    assert auto_copy_threads(0, 100, first=True) == every
    assert auto_copy_threads(0, 0) == loop_friendly_threads()


def test_stager_default_copy_threads_is_auto_and_checked() -> None:
    from async_stager import InvalidOptionError, Stager

    assert Stager().options.copy_threads == "auto"
    assert Stager(copy_threads="auto").options.copy_threads == "auto"
    assert Stager(copy_threads=1).options.copy_threads == 1
    with pytest.raises(InvalidOptionError, match="copy_threads"):
        Stager(copy_threads="fast")  # type: ignore[arg-type]


@needs_helpers
@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one torch thread: every rule gives one")
def test_auto_decides_per_program(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under "auto" a program mostly of big (cut) tensors, and any first stage into new
    memory, copies with every core; a cached program of medium tensors leaves the
    loop's core free."""
    from async_stager._core.options import loop_friendly_threads, usable_cores

    _wait_no_copy_threads()
    every = max(1, min(torch.get_num_threads(), usable_cores()))
    asked: list[int | None] = []
    run = _hostcopy.CopyPool.run

    def spy(self: Any, work: Any, tick: Any = None, tasks: Any = None, helpers: int | None = None) -> None:
        asked.append(helpers)
        run(self, work, tick, tasks, helpers)

    monkeypatch.setattr(_hostcopy.CopyPool, "run", spy)
    big = {f"w{i}": torch.randn(5 << 20) for i in range(3)}  # 20 MiB each: cut
    medium = {f"m{i}": torch.randn(1 << 20) for i in range(8)}  # 4 MiB each: grouped
    eng = make_engine(copy_threads="auto")
    try:
        for sd in (big, medium):
            asked.clear()
            for _ in range(2):  # first (new memory), then cached
                staged = stage_sync(eng, sd)
                assert_same(staged.result, sd)
                del staged
            assert asked[0] == every - 1, asked  # the first stage: every core
            want = every - 1 if sd is big else loop_friendly_threads() - 1
            assert asked[1] == want, (asked, sd is big)
    finally:
        eng.close()
