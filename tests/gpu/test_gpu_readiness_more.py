"""CUDA defects of issue 25 reached on the CPU through the fakes: the budget ring pins
through the arenas' pinning path, restore's hashing runs on the tensor's device, a
CPU-only state dict pins nothing on a machine with a fake accelerator, and generator
states are taken at the call. The real paths are in tests/gpu/test_cuda.py."""

from __future__ import annotations

from typing import Any, SupportsIndex

import pytest
import torch

from async_stager import PinningError
from async_stager._core.memory.arena import pin
from async_stager._core.memory.ring import Ring
from async_stager._dcp.budget.pipeline import Pipeline
from async_stager.testing import FakePinner

pytestmark = [pytest.mark.timeout(60)]


# -- the budget ring pins as the arenas do ---------------------------------------------


def test_ring_registers_through_the_pinner_once_and_close_unregisters() -> None:
    pinner = FakePinner()
    ring = Ring(4096, pinner=pinner)
    assert ring.pinned
    (ptr, nbytes), *rest = pinner.registered.items()
    assert rest == [] and nbytes == 4096 and pinner.total_registrations == 1
    start = ring.alloc(100, stop=lambda: False)
    assert start == 0 and ring.view(start, 100, torch.uint8, (100,)).data_ptr() == ptr
    ring.close()
    ring.close()  # idempotent: unregistered once
    assert pinner.registered == {} and not ring.pinned


def test_ring_dropped_without_close_unregisters() -> None:
    pinner = FakePinner()
    ring = Ring(1024, pinner=pinner)
    assert len(pinner.registered) == 1
    del ring
    import gc

    gc.collect()
    assert pinner.registered == {}


def test_ring_failing_registration_raises_pinning_error() -> None:
    with pytest.raises(PinningError, match="injected pinning failure"):
        Ring(4096, pinner=FakePinner(fail=True))


class _Broken:
    """A pinner failing with something other than PinningError (a driver binding)."""

    def register(self, ptr: int, nbytes: int) -> None:
        raise RuntimeError("CUDA error: invalid argument")

    def unregister(self, ptr: int) -> None:  # pragma: no cover - never registered
        raise AssertionError("nothing was registered")


def test_one_pinning_path_wraps_any_failure() -> None:
    with pytest.raises(PinningError, match="pinning 4096 bytes failed: CUDA error") as err:
        Ring(4096, pinner=_Broken())
    assert isinstance(err.value.__cause__, RuntimeError)
    owner = Ring(64)
    with pytest.raises(PinningError, match="pinning 64 bytes"):
        pin(_Broken(), owner, 1, 64)


def test_budget_pipeline_fails_with_the_ring_pinning_error() -> None:
    from torch.distributed.checkpoint.planner import SavePlan

    from async_stager._core.run.lanes import Lanes
    from async_stager.testing import FakeBackend

    lanes = Lanes(FakeBackend(), None)
    pipeline = Pipeline(
        1 << 16, captures={}, t0=0.0, lanes=lanes, lane=lanes.take([]), pinner=FakePinner(fail=True)
    )
    with pytest.raises(PinningError):
        pipeline.start(SavePlan([]))
    assert isinstance(pipeline.error, PinningError)  # raised by the save as itself
    pipeline.finish()
    assert lanes.close() is None


# -- restore's verification hashes on the rank's device --------------------------------


def _wsum64_entry(t: torch.Tensor) -> dict[str, object]:
    from async_stager._core.checksum.wordhash import ALGORITHM, wsum64_digest

    return {
        "fqn": "w",
        "offsets": [0],
        "shape": list(t.shape),
        "dtype": "float32",
        "digest": wsum64_digest(t),
        "hash": ALGORITHM,
    }


def test_verification_hashes_on_the_ranks_device_not_device_0(monkeypatch: pytest.MonkeyPatch) -> None:
    import contextlib
    from collections.abc import Iterator

    import async_stager._checkpoint.integrity as integrity
    from async_stager._core.checksum.digest import chunk_key
    from async_stager._core.checksum.wordhash import OFFLOAD_BYTES

    # Rank 2 of a machine where this process has contexts on devices 0 and 2 (the
    # calling worker thread's current device, 0, first): big chunks hash on device 2.
    guarded: list[object] = []

    @contextlib.contextmanager
    def device(d: object) -> Iterator[None]:
        guarded.append(d)
        yield

    monkeypatch.setattr(integrity, "cuda_context_devices", lambda: [0, 2])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert integrity.rank_cuda_device() == 2
    big = torch.arange(OFFLOAD_BYTES // 4, dtype=torch.float32)
    small = torch.arange(1000, dtype=torch.float32)
    for t, want in ((big, [2]), (small, [])):
        guarded.clear()
        assert integrity.verify_flat(1, {chunk_key("w", [0]): _wsum64_entry(t)}, {"w": t}) == 1
        assert guarded == want
    guarded.clear()
    integrity.verify_flat(1, {chunk_key("w", [0]): _wsum64_entry(big)}, {"w": big}, device=3)
    assert guarded == [3]  # the caller's choice wins
    # Without LOCAL_RANK: the first device with a context; with none, the CPU.
    monkeypatch.delenv("LOCAL_RANK")
    assert integrity.rank_cuda_device() == 0
    monkeypatch.setattr(integrity, "cuda_context_devices", lambda: [])
    assert integrity.rank_cuda_device() is None
    guarded.clear()
    integrity.verify_flat(1, {chunk_key("w", [0]): _wsum64_entry(big)}, {"w": big})
    assert guarded == []


# -- a CPU-only state dict with no device in use pins nothing --------------------------


def _in_registered(pinner: FakePinner, t: torch.Tensor) -> bool:
    p = t.data_ptr()
    return any(base <= p < base + n for base, n in pinner.registered.items())


def test_pool_keeps_unpinned_arenas_out_of_pinned_allocations() -> None:
    from async_stager._core.memory.arena import HostPool, pinning_skipped

    pinner = FakePinner()
    pool = HostPool(shared=False, pinner=pinner)
    with pinning_skipped():
        (a,) = pool.allocate([100])
    assert a.arena is not None and not a.arena.pinned and pinner.total_registrations == 0
    pool.free([a])
    (b,) = pool.allocate([100])  # pinning wanted: never the unpinned arena's free space
    assert b.arena is not None and b.arena.pinned and b.arena is not a.arena
    assert pinner.total_registrations == 1 and _in_registered(pinner, b.tensor)
    with pinning_skipped():
        (c,) = pool.allocate([100])  # any arena's free space will do
    assert c.arena is a.arena and pinner.total_registrations == 1
    pool.close()
    assert pinner.registered == {}


def test_cpu_only_stage_with_no_device_in_use_pins_nothing_and_a_device_stage_pins() -> None:
    from helpers import make_engine, stage_sync

    from async_stager.testing import FakeBackend

    pinner = FakePinner(needs_context=True)  # as CudaPinner
    backend = FakeBackend(devices=[])  # no accelerator context: every source on the host
    engine = make_engine(backend=backend, pinner=pinner)
    cpu_sd = {"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(7)}
    staged = stage_sync(engine, cpu_sd)
    assert torch.equal(staged.result["w"], cpu_sd["w"]) and torch.equal(staged.result["b"], cpu_sd["b"])
    assert pinner.total_registrations == 0 and backend.guards == []
    assert engine.host_bytes > 0
    del staged
    # A device comes into use (a context exists now): a new state dict's memory is
    # pinned, in a new arena.
    backend.devices = (torch.device("cpu"),)  # the fake accelerator
    dev_sd = {"x": torch.full((2000,), 3.0)}
    staged = stage_sync(engine, dev_sd)
    assert torch.equal(staged.result["x"], dev_sd["x"])
    assert pinner.total_registrations >= 1 and _in_registered(pinner, staged.result["x"])
    del staged
    engine.close()
    assert pinner.registered == {}


# -- generator states are taken at the call --------------------------------------------


def _draw(g: torch.Generator) -> torch.Tensor:
    return torch.rand(4, generator=g)


def test_generators_at_the_top_levels_are_staged_as_of_the_call() -> None:
    from helpers import make_engine

    from async_stager.testing import FakeBackend

    engine = make_engine(backend=FakeBackend())
    top = torch.Generator().manual_seed(1)
    nested = torch.Generator().manual_seed(2)
    deep = torch.Generator().manual_seed(3)
    sd = {"rng": top, "train": {"rng": nested, "w": torch.ones(3)}, "far": {"a": {"rng": deep}}}
    for _ in range(2):  # the slow path, then the fast path
        want_top, want_nested = top.get_state(), nested.get_state()
        captures = engine.capture(sd)
        _draw(top), _draw(nested), _draw(deep)  # the caller goes on right after the call
        staged = engine.run(sd, captures)
        for c in staged.completions:
            c.synchronize()
        engine.settle(staged)
        out = staged.result
        assert torch.equal(out["rng"].get_state(), want_top)
        assert torch.equal(out["train"]["rng"].get_state(), want_nested)
        # Deeper than the look at the call: read when the worker walks (documented).
        assert torch.equal(out["far"]["a"]["rng"].get_state(), deep.get_state())
        assert out["rng"] is not top  # a copy, drawing from the state as of the call
        assert torch.equal(_draw(out["rng"]), _draw(torch.Generator().set_state(want_top)))
        del staged, out
    engine.close()


def test_default_generator_is_staged_as_of_the_call_anywhere() -> None:
    from helpers import make_engine

    from async_stager.testing import FakeBackend

    engine = make_engine(backend=FakeBackend())
    deep = {"a": {"b": {"c": [torch.default_generator]}}}
    want = torch.default_generator.get_state()
    captures = engine.capture()  # no state given (as today's stagers call it)
    torch.rand(8)  # advances torch.default_generator
    staged = engine.run(deep, captures)
    assert torch.equal(staged.result["a"]["b"]["c"][0].get_state(), want)
    engine.settle(staged)
    del staged
    engine.close()


class _Gate:
    """An object the worker's walk stops at (its reduce waits) until the test says."""

    def __init__(self) -> None:
        import threading

        self.reached = threading.Event()
        self.go = threading.Event()

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        self.reached.set()
        assert self.go.wait(10)
        return (_Gate, ())


@pytest.mark.anyio
async def test_stager_stages_the_default_generator_as_of_the_call(anyio_backend: object) -> None:
    from async_stager import Stager

    gate = _Gate()
    async with Stager() as stager:
        want = torch.default_generator.get_state()
        # stage() captures at the call, synchronously; the worker's walk stops at the
        # gate (before it reaches the generator) until the caller has drawn.
        coro = stager.stage({"gate": gate, "rng": torch.default_generator})
        torch.rand(8)  # the caller draws right after the call
        gate.go.set()
        staged = await coro
    rng = staged["rng"]
    assert isinstance(rng, torch.Generator) and rng is not torch.default_generator
    assert torch.equal(rng.get_state(), want)
