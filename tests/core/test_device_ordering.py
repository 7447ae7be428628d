"""The CUDA path's ordering and resource logic, on the CPU through the fake device seam.

Each test models one hazard of the real CUDA path with ``FakeBackend``'s streams (work
queued on a caller's stream runs only when something waits for it), captures, fences,
device guards and scratch accounting, or checks the real helpers with torch.cuda's
functions replaced. The same hazards on a real GPU: tests/gpu/test_cuda.py (``cuda``-marked).
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar

import anyio
import pytest
import torch
from helpers import assert_same, make_engine, stage_sync

import async_stager._dcp.save as _dcp_save
import async_stager.dcp as adcp
from async_stager import CopyError, Stager, UnsupportedError
from async_stager._core.copy.copiers import RealBackend, ScratchCopier
from async_stager._core.copy.cuda import CudaPrimitives
from async_stager._core.copy.device import caller_cuda_device, order_after
from async_stager._core.copy.primitives import DeviceEvent
from async_stager.testing import FakeBackend, FakeCapture, FakeEvent, FakePinner, FakeStream

pytestmark = pytest.mark.timeout(60)

CPU = torch.device("cpu")
CUDA0 = torch.device("cuda", 0)
CUDA1 = torch.device("cuda", 1)


def small_sd(n: int = 300, numel: int = 16) -> dict[str, torch.Tensor]:
    """Small storages: gathered through device scratch (one run)."""
    return {f"p{i}": torch.arange(numel, dtype=torch.float32) + i for i in range(n)}


# -- captures on every device ------------------------------------------------------------


def test_first_stage_from_a_non_current_device_is_captured_at_the_call() -> None:
    # The CPU plays a second GPU that is not the caller's current device (cuda:0 is).
    backend = FakeBackend(devices=[CUDA0, CPU])
    engine = make_engine(backend=backend)
    x = torch.zeros(64)
    gpu1 = backend.stream(CPU)
    gpu1.enqueue(lambda: x.fill_(7.0))  # a producer still queued at the call
    captures = engine.capture()
    gpu1.enqueue(lambda: x.fill_(9.0))  # training after the call
    assert list(captures) == [CUDA0, CPU]
    staged = engine.run({"x": x}, captures)
    cap = backend.begun[-1]
    assert isinstance(cap, FakeCapture) and cap.stream is gpu1 and cap is captures[CPU]
    for c in staged.completions:
        c.synchronize()
    # The copies ran after the producer and before the later write.
    assert torch.equal(staged.result["x"], torch.full((64,), 7.0))
    engine.close()


def test_real_backend_knows_every_device_with_a_context(monkeypatch: pytest.MonkeyPatch) -> None:
    contexts = {1, 3}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", lambda d: d in contexts, raising=False)
    backend = RealBackend(non_blocking=True)
    # The caller's current device first, then the others with a context.
    assert list(backend.known_devices()) == [torch.device("cuda", 3), torch.device("cuda", 1)]
    assert caller_cuda_device() == 3
    # A thread whose current device has no context: never that device (a context
    # would be created on it), the first device that has one instead.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert list(backend.known_devices()) == [torch.device("cuda", 1), torch.device("cuda", 3)]
    assert caller_cuda_device() == 1
    assert backend.host_device() == torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert list(backend.known_devices()) == [] and caller_cuda_device() is None


def test_pinning_before_cuda_is_initialised_avoids_gpu0(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "6")
    assert RealBackend(non_blocking=True).host_device() == torch.device("cuda", 2)
    monkeypatch.delenv("LOCAL_RANK")
    assert RealBackend(non_blocking=True).host_device() == torch.device("cuda", 0)


def test_worker_runs_on_the_callers_device_and_pins_off_gpu0() -> None:
    # Captured devices: the worker takes the caller's current one (listed first).
    backend = FakeBackend(devices=[CUDA1, CUDA0])
    engine = make_engine(backend=backend)
    stage_sync(engine, {"w": torch.ones(8)})
    assert backend.guards and set(backend.guards) == {CUDA1}
    engine.close()
    # No device has a context yet (CPU-only state dict, CUDA not initialised): no
    # device at all, with pinning on too. A pinner needing a context (CUDA's) pins
    # nothing: it would create a context just for memory no device copy uses; one
    # that does not (mlock) pins as ever.
    for needs_context in (True, False):
        pinner = FakePinner(needs_context=needs_context)
        backend = FakeBackend(devices=[], host_device=torch.device("cuda", 2))
        engine = make_engine(backend=backend, pinner=pinner)
        stage_sync(engine, {"w": torch.ones(8)})
        assert backend.guards == []
        assert pinner.total_registrations == (0 if needs_context else 1)
        engine.close()
    backend = FakeBackend(devices=[], host_device=torch.device("cuda", 2))
    engine = make_engine(backend=backend)
    stage_sync(engine, {"w": torch.ones(8)})
    assert backend.guards == []
    engine.close()


# -- CPU leaves after the capture ------------------------------------------------------------


def test_cpu_leaves_wait_for_pending_device_to_host_copies() -> None:
    backend = FakeBackend(devices=[CUDA0], host_copies=True)
    engine = make_engine(backend=backend)
    pinned = torch.zeros(1000)  # think: pinned, being filled by a non_blocking copy
    step = torch.tensor(3.0)
    stage_sync(engine, {"buf": pinned, "step": step})  # plan and buffers
    stream = backend.stream(CUDA0)
    stream.enqueue(lambda: pinned.fill_(5.0))  # buf.copy_(gpu, non_blocking=True)
    captures = engine.capture()
    stream.enqueue(lambda: pinned.fill_(-1.0))  # queued after the call: not in the snapshot
    staged = engine.run({"buf": pinned, "step": step}, captures)
    assert not staged.completions  # host copies: done when run() returns
    assert torch.equal(staged.result["buf"], torch.full((1000,), 5.0))
    assert torch.equal(staged.result["step"], step)
    assert isinstance(captures[CUDA0], FakeCapture) and captures[CUDA0].synchronized >= 1
    assert stream.finished == 1  # the later write is still queued
    engine.close()


def test_order_after() -> None:
    a, b = torch.ones(1), torch.ones(1)
    assert order_after(CUDA0, {CUDA0: a, CUDA1: b}) is a
    assert order_after(CPU, {CUDA0: a, CUDA1: b}) == (a, b)
    assert order_after(CPU, {CPU: a, CUDA0: b}) is a  # the fake's CPU "accelerator"
    assert order_after(CPU, {}) is None
    assert order_after(CUDA1, {CUDA0: a}) is None


# -- the error path's copies ----------------------------------------------------------------


def test_copy_error_recopies_are_ordered_and_protected() -> None:
    bad = torch.ones(300)
    x = torch.ones(100)
    sd = {"a": x, "b": {"c": bad}, "d": torch.ones(50)}
    backend = FakeBackend(fail_copy_of=bad)
    engine = make_engine(backend=backend)
    backend.stream(CPU).enqueue(lambda: x.fill_(4.0))  # a producer queued at the call
    with pytest.raises(CopyError) as info:
        stage_sync(engine, sd)
    assert "['b']['c']" in str(info.value)
    # Every begin, the diagnostic re-copies' included, is ordered after the capture
    # and followed by a protect of its sources.
    assert backend.begun and all(isinstance(c, FakeCapture) for c in backend.begun)
    assert len(backend.protected) == len(backend.begun)
    assert backend.protected[-1] == 1  # the failing unit's re-copy kept its source
    # Its completion is what a fence now orders after.
    assert engine.latest[CPU] is backend.events[-1]
    backend.fail_copy_of = None
    staged = stage_sync(engine, sd)
    assert torch.equal(staged.result["a"], torch.full((100,), 4.0))
    engine.close()


# -- graph capture -------------------------------------------------------------------------


async def test_stage_and_fence_refused_while_capturing(anyio_backend: Any) -> None:
    backend = FakeBackend()
    async with Stager(backend=backend) as stager:
        sd = {"w": torch.ones(8)}
        staged = await stager.stage(sd)
        backend.stream(CPU).capturing = True
        with pytest.raises(UnsupportedError, match="thread_local") as info:
            stager.stage(sd)  # type: ignore[unused-coroutine]
        assert "capturing a CUDA graph" in str(info.value)
        with pytest.raises(UnsupportedError, match="thread_local"):
            stager.fence()  # type: ignore[unused-coroutine]
        backend.stream(CPU).capturing = False
        del staged
        assert_same(await stager.stage(sd), sd)  # still usable
        await stager.fence()


# -- events --------------------------------------------------------------------------------


class _RecordingEvent:
    """Stands in for torch.cuda.Event: records its flags and the device current at
    each call."""

    calls: ClassVar[list[tuple[str, int]]] = []

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs

    def record(self, stream: Any) -> None:
        self.calls.append(("record", _current[0]))

    def query(self) -> bool:
        self.calls.append(("query", _current[0]))
        return False

    def synchronize(self) -> None:
        self.calls.append(("synchronize", _current[0]))


_current = [0]


class _Device:
    def __init__(self, index: int | torch.device) -> None:
        self.index = index.index if isinstance(index, torch.device) else index

    def __enter__(self) -> None:
        self.prev, _current[0] = _current[0], self.index

    def __exit__(self, *exc: Any) -> None:
        _current[0] = self.prev


def test_cuda_events_block_and_run_under_their_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "Event", _RecordingEvent)
    monkeypatch.setattr(torch.cuda, "device", _Device)
    _RecordingEvent.calls = []

    ev = DeviceEvent(CudaPrimitives(torch.device("cuda", 3)), object(), timeout=0.05)
    assert ev.event.kwargs == {"blocking": True}  # type: ignore[attr-defined]  # host waits sleep, they do not spin
    assert ev.query() is False
    # Bounded (review finding 7): a wedged device is an error, not a hang.
    with pytest.raises(CopyError, match="wedged"):
        ev.synchronize()
    # From a thread whose current device is 0: each call ran with device 3 current.
    polls = [c for c in _RecordingEvent.calls if c[0] != "record"]
    assert polls and all(c == ("query", 3) for c in polls)
    assert _current[0] == 0


# -- fence reads the stream at the call --------------------------------------------------------


async def test_fence_orders_the_stream_current_at_the_call(anyio_backend: Any) -> None:
    backend = FakeBackend(manual=True)
    w = torch.ones(1000)
    async with Stager(backend=backend) as stager:
        await stager.reserve({"w": w})
        training = FakeStream("training")
        with backend.use_stream(CPU, training):
            pending = stager.stage({"w": w})  # explicit order: submitted, then fenced
            fence = stager.fence()  # reads the training stream now
        # Awaited later, with another stream current (another task, another thread).
        other = FakeStream("other")
        with backend.use_stream(CPU, other):
            await fence
        assert backend.fence_points[-1] is training
        assert other.queued == 0
        training.enqueue(lambda: w.add_(1.0))  # the optimizer step, after the fence
        assert not backend.events[-1].fired
        training.run()  # the stream reaches the fence's wait: the copies land first
        assert backend.events[-1].fired
        staged = await pending
        assert torch.equal(staged["w"], torch.ones(1000))
        assert torch.equal(w, torch.full((1000,), 2.0))


async def test_dcp_save_reads_the_device_at_the_call(
    anyio_backend: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    current = [3]
    seen: list[Any] = []
    monkeypatch.setattr(_dcp_save, "_current_cuda_device", lambda: current[0])

    def fake_save(staged: Any, *, cuda_device: Any = None, **kwargs: Any) -> str:
        seen.append(cuda_device)
        return "metadata"

    monkeypatch.setattr(_dcp_save, "save_blocking", fake_save)
    async with Stager(backend=FakeBackend()) as stager:
        pending = adcp.save({"w": torch.ones(4)}, stager=stager, checkpoint_id=tmp_path, no_dist=True)
        current[0] = 5  # the coroutine runs where another device is current
        assert await pending == "metadata"  # type: ignore[comparison-overlap]
        staged_pending = adcp.save_staged({"w": torch.ones(4)}, no_dist=True)
        current[0] = 6
        assert await staged_pending == "metadata"  # type: ignore[comparison-overlap]
    assert seen == [3, 5]


# -- device scratch ------------------------------------------------------------------------------


def _copier(engine: Any) -> ScratchCopier:
    c = engine._copiers[CPU]
    assert isinstance(c, ScratchCopier)
    return c


def test_scratch_is_held_only_while_a_run_is_copied() -> None:
    backend = FakeBackend()
    engine = make_engine(backend=backend)
    sd = small_sd()
    stage_sync(engine, {"other": torch.ones(4), **small_sd(50)}, copy=False)  # a reserve
    assert backend.scratch_in_use == 0  # released once the plan is made
    for _ in range(3):
        staged = stage_sync(engine, sd)
        assert_same(staged.result, sd)
        assert backend.scratch_in_use == 0 and _copier(engine).scratch_live_bytes == 0
    plan = next(iter(staged.bufset.plans.values()))
    runs = [r for p in plan.programs for r in p.runs]
    assert runs, "small storages were not gathered"
    # Never more than one run's scratch at once, whatever the plans and buffer sets.
    assert backend.scratch_peak <= max(r.scratch.numel() for r in runs)
    assert _copier(engine).scratch_budget == engine.options.scratch_bytes
    engine.close()


@pytest.mark.parametrize("when", ["plan", "stage", "budget"])
def test_scratch_out_of_memory_falls_back_to_direct_copies(when: str) -> None:
    backend = FakeBackend(scratch_limit=0 if when == "plan" else None)
    engine = make_engine(backend=backend)
    sd = small_sd(2500, numel=4)  # gathers in several chunks
    staged = stage_sync(engine, sd)
    assert_same(staged.result, sd)
    del staged
    if when == "stage":
        backend.scratch_limit = 0  # training took the memory since the plan was made
    elif when == "budget":
        _copier(engine).scratch_budget = 8
    launches = backend.launches
    for k in range(2):
        sd = {name: t + k for name, t in sd.items()}  # new values, same layout
        staged = stage_sync(engine, sd)
        assert_same(staged.result, sd)
        del staged
    assert _copier(engine).scratch_fallbacks > 0
    if when != "plan":
        # Direct: one copy call per chunk instead of a gather and a span copy.
        assert backend.launches - launches > 4
    assert backend.scratch_in_use == 0
    engine.close()


class _SyncScratchCopier(ScratchCopier):
    """A ScratchCopier whose copies run at once, with the real scratch memory calls
    (storage resize to nothing and back): the CUDA copier's logic on the CPU."""

    def copy_now(self, dsts: Any, srcs: Any) -> None:
        if dsts:
            torch._foreach_copy_(list(dsts), list(srcs))


class _SyncScratchBackend(FakeBackend):
    def copier(self, device: torch.device) -> Any:
        return _SyncScratchCopier(device)


def test_scratch_storage_is_freed_and_rematerialized_between_stages() -> None:
    engine = make_engine(backend=_SyncScratchBackend())
    sd = small_sd(500)
    for k in range(3):
        sd = {name: t + k for name, t in sd.items()}
        staged = stage_sync(engine, sd)
        assert_same(staged.result, sd)
        plan = next(iter(staged.bufset.plans.values()))
        scratches = [r.scratch for p in plan.programs for r in p.runs]
        assert scratches and all(s.untyped_storage().nbytes() == 0 for s in scratches)
        del staged
    engine.close()


# -- the fake's streams ------------------------------------------------------------------------


def test_fake_stream_runs_in_order_without_deadlock() -> None:
    s = FakeStream()
    out: list[int] = []
    s.enqueue(lambda: out.append(1))
    cap = FakeCapture(s, 1)
    s.enqueue(lambda: out.append(2))
    assert not cap.query()
    done = threading.Event()

    def waiter() -> None:
        cap.synchronize()
        done.set()

    t = threading.Thread(target=waiter)
    t.start()
    t.join(5)
    assert done.is_set() and out == [1] and cap.query()
    s.run()
    assert out == [1, 2]


async def test_fake_stream_fence_in_a_task_group(anyio_backend: Any) -> None:
    # The fence's awaitable, run as a task started after the stage: the ordering is the
    # one read at the fence() call, whatever order the tasks run in.
    backend = FakeBackend(manual=True)
    w = torch.ones(64)
    async with Stager(backend=backend) as stager:
        await stager.reserve({"w": w})
        training = FakeStream("training")
        with backend.use_stream(CPU, training):
            pending = stager.stage({"w": w})
            fence = stager.fence()

        async def run_fence() -> None:
            await fence

        async with anyio.create_task_group() as tg:
            tg.start_soon(run_fence)
        assert backend.fence_points[-1] is training
        backend.complete_all()
        assert torch.equal((await pending)["w"], w)


# -- the fake copier checks shapes like a real enqueue ----------------------------------


@pytest.mark.parametrize(
    ("dst", "src"),
    [((2, 3), (6,)), ((2, 3), (2,)), ((3,), (2, 3)), ((2, 3), (3, 2)), ((4,), (0,))],
)
def test_fake_copier_refuses_a_source_that_does_not_broadcast_at_enqueue(
    dst: tuple[int, ...], src: tuple[int, ...]
) -> None:
    # Same number of elements is not enough: a real copy_ raises for (2, 3) <- (6,) too.
    with pytest.raises(RuntimeError):
        torch.empty(dst).copy_(torch.zeros(src))
    backend = FakeBackend(manual=True)
    copier = backend.copier(CPU)
    copier.begin(None)
    with pytest.raises(RuntimeError, match="does not broadcast"):
        copier.copy([torch.empty(dst)], [torch.zeros(src)])
    assert backend.launches == 0  # refused at enqueue, nothing recorded
    copier.close()


@pytest.mark.parametrize(("dst", "src"), [((2, 3), (3,)), ((2, 3), (2, 1)), ((2, 3), ()), ((0,), (1,))])
def test_fake_copier_takes_a_source_that_broadcasts(dst: tuple[int, ...], src: tuple[int, ...]) -> None:
    backend = FakeBackend(manual=True)
    copier = backend.copier(CPU)
    copier.begin(None)
    out = torch.zeros(dst)
    source = torch.arange(1, 1 + torch.zeros(src).numel(), dtype=torch.float32).reshape(src)
    copier.copy([out], [source])
    event = copier.end()
    assert isinstance(event, FakeEvent)
    assert not torch.equal(out, torch.empty(dst).copy_(source)) or out.numel() == 0  # not landed yet
    event.complete()
    assert torch.equal(out, torch.empty(dst).copy_(source))
    copier.close()


def test_host_wait_is_bounded_and_says_what_is_stuck() -> None:
    from async_stager._core.memory.buffer_sets import wait_bounded

    stuck = FakeEvent([], delay=0.0, polls=None, manual=True)  # a wedged device
    with pytest.raises(CopyError, match=r"copies into a buffer set still not finished after 0 s"):
        wait_bounded(stuck, "copies into a buffer set", 0.05)
    done = FakeEvent([], delay=0.0, polls=3, manual=False)
    wait_bounded(done, "copies", 5.0)
    assert done.fired


def test_trim_waits_for_copies_without_the_lock() -> None:
    # trim() waiting for copies in flight must leave the lock free: releases (from the
    # event loop) take it.
    from async_stager._core.memory.buffer_sets import BufferSet

    e = make_engine(backend=FakeBackend())
    try:
        stage_sync(e, {"a": torch.ones(1000)})
        sets = e.sets
        bs = sets._sets[0]
        pending = FakeEvent([], delay=0.0, polls=None, manual=True)
        bs.inflight.append(pending)
        took_lock = threading.Event()
        result: list[int] = []
        t = threading.Thread(target=lambda: result.append(sets.trim()))
        t.start()

        def grab() -> None:
            with sets.cond:
                took_lock.set()

        g = threading.Thread(target=grab)
        g.start()
        assert took_lock.wait(5), "trim() held the lock while waiting for copies"
        assert t.is_alive()  # still waiting for the copy
        assert isinstance(bs, BufferSet) and bs.busy  # and no stage may select the set
        pending.complete()
        t.join(5)
        g.join(5)
        assert not t.is_alive() and result and result[0] > 0 and not bs.busy
    finally:
        e.close()
