"""The real accelerator copier (``AcceleratorCopier``) on the simulated device.

``SimulatedDevice`` runs each stream in its own thread, lands copies after seeded random
delays and overwrites freed device memory at once, so a missing wait or protection is
wrong bytes here. The first tests check that the simulation does catch each hazard (the
copier's protection switched off gives wrong bytes); the rest stage through the real
copier and check the bytes. Seeds are fixed: a failure replays.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers import bits, make_engine

from async_stager import CopyError, Stager
from async_stager._core.copy.accelerator import AcceleratorCopier
from async_stager._core.copy.primitives import DeviceEvent
from async_stager._core.copy.simulated import POISON, SimulatedBackend, SimulatedDevice, UseAfterFree

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_thread_leak")]


@pytest.fixture
def sim() -> Iterator[SimulatedDevice]:
    with SimulatedDevice(seed=7, delay=(0.0, 0.004)) as device:
        yield device
    assert device.errors == []


def odd_state(sim: SimulatedDevice) -> dict[str, torch.Tensor]:
    """Every dtype kind, NaN payloads, lazy conj/neg views, non-contiguous views and
    many small storages (gathered through scratch), all on the simulated device."""
    g = torch.Generator().manual_seed(3)
    payloads = torch.tensor([0x7FC1, -0x3D, 0x7F81, 0x0001], dtype=torch.int16).view(torch.bfloat16)
    z = sim.tensor(torch.randn(6, 5, dtype=torch.complex64, generator=g))
    m = sim.tensor(torch.randn(8, 6, generator=g))
    sd: dict[str, torch.Tensor] = {
        "f32": sim.tensor(torch.randn(4096, generator=g)),
        "bf16": sim.tensor(payloads.repeat(64)),
        "f16": sim.tensor(torch.randn(300, generator=g).half()),
        "i8": sim.tensor(torch.randint(-100, 100, (77,), dtype=torch.int8, generator=g)),
        "conj": z.conj(),
        "neg": z.conj().imag,
        "t": m.t(),
        "step": m[::2, 1::3],
    }
    for i in range(40):
        sd[f"small{i}"] = sim.tensor(torch.full((3,), float(i)))
    return sd


def expected(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: bits(v.clone()) for k, v in sd.items()}


def check(staged: dict[str, Any], want: dict[str, torch.Tensor]) -> None:
    for k, v in want.items():
        assert torch.equal(bits(staged[k]), v), k


def later(seconds: float, fn: Any) -> Any:
    """Device work that takes ``seconds`` and then runs ``fn()`` (a slow producer)."""

    def run() -> None:
        time.sleep(seconds)
        fn()

    return run


def poisoned(t: torch.Tensor) -> bool:
    return bool((bits(t) == POISON).all())


# -- the simulation catches the hazards -----------------------------------------------


def test_a_copy_not_ordered_after_the_capture_reads_old_values(
    sim: SimulatedDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(backend=SimulatedBackend(sim))
    x = sim.tensor(torch.zeros(64))
    train = sim.stream("train")

    def stage() -> torch.Tensor:
        with sim.using(train):
            sim.launch(later(0.05, lambda: x.fill_(7.0)))  # a producer still queued
            staged = engine.run({"x": x}, engine.capture())
        for c in staged.completions:
            c.synchronize()
        engine.settle(staged)
        out: torch.Tensor = staged.result["x"].clone()
        return out

    assert torch.equal(stage(), torch.full((64,), 7.0))  # the copy stream waited
    sim.synchronize()
    x.zero_()
    monkeypatch.setattr(DeviceEvent, "wait", lambda self, stream: None)
    assert torch.equal(stage(), torch.zeros(64))  # without the wait: the old values
    engine.close()


def test_a_source_freed_without_protection_is_overwritten(
    sim: SimulatedDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    sim.delay = (0.05, 0.05)
    engine = make_engine(backend=SimulatedBackend(sim))

    def stage() -> torch.Tensor:
        sd = {"x": sim.tensor(torch.arange(4096, dtype=torch.float32))}
        staged = engine.run(sd, engine.capture())
        del sd  # training drops the source while its copy is in flight
        for c in staged.completions:
            c.synchronize()
        engine.settle(staged)
        out: torch.Tensor = staged.result["x"].clone()
        return out

    assert torch.equal(stage(), torch.arange(4096, dtype=torch.float32))
    monkeypatch.setattr(AcceleratorCopier, "protect", lambda self, srcs: None)
    assert poisoned(stage())  # the allocator handed the memory on: overwritten
    assert sim.errors and all(isinstance(e, UseAfterFree) for e in sim.errors), sim.errors
    sim.errors.clear()
    engine.close()


def test_a_cpu_leaf_copied_before_the_captures_reads_old_values(
    sim: SimulatedDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A CPU leaf (AdamW's step, a pinned buffer) is copied by the host copier, as on
    # CUDA; it may be the target of a device-to-host copy queued on the caller's
    # stream before the call, so the host copier first waits for the captures.
    from async_stager._core.copy.copiers import CpuCopier

    backend = SimulatedBackend(sim)
    engine = make_engine(backend=backend)
    src = sim.tensor(torch.full((1024,), 3.0))
    train = sim.stream("train")

    def stage() -> torch.Tensor:
        buf = torch.zeros(1024)  # the CPU leaf
        with sim.using(train):
            sim.launch(later(0.05, lambda: None))  # the producer still running
            sim.copy([buf], [src])  # then a copy into the CPU leaf, queued before the call
            staged = engine.run({"buf": buf, "w": src}, engine.capture())
        for c in staged.completions:
            c.synchronize()
        engine.settle(staged)
        sim.synchronize()  # the copy into buf has landed by now (it must outlive it)
        out: torch.Tensor = staged.result["buf"].clone()
        return out

    assert torch.equal(stage(), torch.full((1024,), 3.0))  # the host copier waited
    assert len(backend.host_made) == 1 and isinstance(backend.host_made[0], CpuCopier)
    assert backend.guards and set(backend.guards) == {sim.device}  # the worker's device guard
    monkeypatch.setattr(CpuCopier, "begin", lambda self, capture: None)
    assert torch.equal(stage(), torch.zeros(1024))  # without the wait: the old values
    engine.close()


def test_a_hash_buffer_freed_outside_its_stream_order_is_poisoned(
    sim: SimulatedDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The hash kernel holds nothing (as a CUDA kernel): its output buffer is freed when
    # the copier drops it, right after the enqueue, and reused in the order of the
    # stream that allocated it. Allocated with the hash stream current, it outlives
    # the kernel and the copy of the digests to the host; allocated on another stream
    # (the copier's mistake, played here), the device hands it on at once.
    from async_stager._core.checksum.digest import Checksums

    engine = make_engine(backend=SimulatedBackend(sim))
    train = sim.stream("train")
    sd = {"big": sim.tensor(torch.randn(1 << 18))}  # 1 MiB: hashed on the device

    def stage() -> bool:
        with sim.using(train):
            sim.launch(later(0.05, lambda: None))  # the hash waits for the capture
            staged = engine.run(sd, engine.capture(), checksums=True)
        for c in staged.completions:
            c.synchronize()
        engine.settle(staged)
        sums, host = staged.checksums, staged.result["big"]
        assert sums is not None and sums.algorithm_of(host) == "wsum64"
        return bool(sums.get(host) == Checksums.compute(host, "wsum64"))

    assert stage()  # the digest is the staged copy's
    empty = SimulatedDevice.empty

    def on_the_default_stream(self: SimulatedDevice, nbytes: int) -> torch.Tensor:
        with self.using(self.default_stream()):
            return empty(self, nbytes)

    monkeypatch.setattr(SimulatedDevice, "empty", on_the_default_stream)
    stage()
    # The kernel wrote, and the copy read, memory the device had taken back.
    assert sim.errors and all(isinstance(e, UseAfterFree) for e in sim.errors), sim.errors
    sim.errors.clear()
    engine.close()


def test_memory_the_allocator_does_not_own_is_kept_by_the_event_hold(
    sim: SimulatedDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A DLPack import or a CUDA IPC handle: record_stream does nothing for it, and its
    # owner frees it when the last tensor dies. Only the completion event's hold of
    # the sources keeps it until the copies have read it.
    sim.delay = (0.05, 0.05)
    engine = make_engine(backend=SimulatedBackend(sim))

    def stage() -> torch.Tensor:
        sd = {"x": sim.foreign(torch.arange(4096, dtype=torch.float32))}
        staged = engine.run(sd, engine.capture())
        del sd  # the importer drops it while its copy is in flight
        for c in staged.completions:
            c.synchronize()
        engine.settle(staged)
        out: torch.Tensor = staged.result["x"].clone()
        return out

    assert torch.equal(stage(), torch.arange(4096, dtype=torch.float32))

    def record_stream_only(self: AcceleratorCopier, srcs: Any) -> None:
        for s in srcs:
            if self.prims.owns(s):
                self.prims.record_stream(s, self.stream)

    monkeypatch.setattr(AcceleratorCopier, "protect", record_stream_only)
    assert poisoned(stage())  # record_stream alone: the owner freed it under the copy
    assert sim.errors and all(isinstance(e, UseAfterFree) for e in sim.errors), sim.errors
    sim.errors.clear()
    engine.close()


def test_a_kernel_holds_nothing(sim: SimulatedDevice) -> None:
    # As a CUDA kernel: a tensor passed to launch() is freed when the caller drops it,
    # even with the kernel still queued; the kernel then touches freed memory.
    stream = sim.stream("kernels")
    gate = threading.Event()
    x = sim.tensor(torch.zeros(64))
    seen: list[float] = []
    with sim.using(stream):
        sim.launch(lambda: gate.wait(60))
        sim.launch(lambda t: seen.append(float(t.sum())), x)
    del x  # nothing else holds it: freed (in the order of its stream, idle)
    gate.set()
    sim.synchronize()
    assert len(sim.errors) == 1 and isinstance(sim.errors[0], UseAfterFree), sim.errors
    sim.errors.clear()
    assert seen and seen[0] != 0.0  # it read what the memory held then: poison


def test_scratch_is_reallocated_and_a_gather_without_grow_is_caught(
    sim: SimulatedDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    # free() gives the scratch's block back (in stream order) and grow() takes a new
    # one, as CUDA's resize_(0)/resize_(n): a gather into scratch that was not grown
    # again writes freed memory (a trap here).
    engine = make_engine(backend=SimulatedBackend(sim), small_tensor_bytes=64)

    def stage() -> dict[str, torch.Tensor]:
        sd = {f"s{i}": sim.tensor(torch.full((3,), float(i))) for i in range(40)}
        staged = engine.run(sd, engine.capture())
        for c in staged.completions:
            c.synchronize()
        engine.settle(staged)
        out: dict[str, torch.Tensor] = {k: v.clone() for k, v in staged.result.items()}
        return out

    first = stage()
    assert all(torch.equal(first[f"s{i}"], torch.full((3,), float(i))) for i in range(40))
    frees = sim.frees
    again = stage()  # the plan's scratch grown again (a new block), gathered, freed
    assert sim.frees > frees and again.keys() == first.keys()
    assert all(torch.equal(again[f"s{i}"], torch.full((3,), float(i))) for i in range(40))
    monkeypatch.setattr(AcceleratorCopier, "_grow_scratch", lambda self, base: None)
    wrong = stage()
    assert sim.errors and all(isinstance(e, UseAfterFree) for e in sim.errors), sim.errors
    sim.errors.clear()
    assert not torch.equal(wrong["s7"], torch.full((3,), 7.0))  # poison, not the values
    engine.close()


# -- the real copier on it --------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_engine_stage_is_bit_exact(seed: int) -> None:
    with SimulatedDevice(seed=seed, delay=(0.0, 0.003)) as sim:
        engine = make_engine(backend=SimulatedBackend(sim), small_tensor_bytes=64)
        for _ in range(2):  # the second one reuses the plan and its scratch
            sd = odd_state(sim)
            want = expected(sd)
            staged = engine.run(sd, engine.capture())
            del sd  # the sources die while their copies are in flight
            for c in staged.completions:
                c.synchronize()
            engine.settle(staged)
            check(staged.result, want)
        engine.close()
        assert sim.errors == []


@pytest.mark.anyio
async def test_stager_on_the_simulated_device(sim: SimulatedDevice, anyio_backend: Any) -> None:
    sd = odd_state(sim)
    want = expected(sd)
    train = sim.stream("train")
    async with Stager(backend=SimulatedBackend(sim), small_tensor_bytes=64) as stager:
        for _ in range(3):
            with sim.using(train):
                staged = await stager.stage(sd)
                await stager.fence()
                # Training writes the sources after the fence: ordered after the copies.
                for v in sd.values():
                    if not (v.is_conj() or v.is_neg()):
                        sim.launch(later(0.0, functools.partial(v.add_, 1)))
            check(staged, want)
            sim.synchronize()
            want = expected(sd)
            del staged


@pytest.mark.anyio
async def test_device_hashes_read_the_sources_as_of_the_call(
    sim: SimulatedDevice, anyio_backend: Any
) -> None:
    from async_stager._core.checksum.digest import Checksums

    sim.kernel_delay = (0.15, 0.2)  # the hash kernels outlast the copies (and a late poll)
    big = sim.tensor(torch.randn(1 << 18))  # 1 MiB: hashed on the device
    train = sim.stream("train")
    async with Stager(backend=SimulatedBackend(sim)) as stager:
        with sim.using(train):
            sim.launch(later(0.02, lambda: big.add_(1)))  # queued at the call
            coro = stager.lease({"big": big}, checksums=True)
        lease = await coro
        staged = lease.state_dict["big"]
        sums = lease.checksums
        assert sums is not None and sums.algorithm_of(staged) == "wsum64"
        # Read as soon as the stage is complete: its completion covers the hashes.
        digest = sums.get(staged)
        sim.synchronize()
        assert torch.equal(bits(staged), bits(big))
        assert digest == Checksums.compute(staged, "wsum64")
        lease.release()


def test_close_waits_for_the_streams_bounded(sim: SimulatedDevice) -> None:
    copier = AcceleratorCopier(sim, non_blocking=True, wait_seconds=0.05)
    # Wedged until released (an event, not a time: a loaded machine cannot unwedge it).
    gate = threading.Event()
    with sim.using(copier.stream):
        sim.launch(lambda: gate.wait(60))
    with pytest.raises(CopyError, match="wedged"):
        copier.close()  # bounded: a wedged stream is an error, not a hang
    gate.set()
    sim.synchronize()
    copier.close()  # idle now


def test_blocking_copier_and_a_device_without_a_capture(sim: SimulatedDevice) -> None:
    # non_blocking=False: end() waits for the copies and returns None; no capture for
    # the device (it had no context at the call): the copies wait for its default stream.
    copier = AcceleratorCopier(sim, non_blocking=False, wait_seconds=30.0)
    src = sim.tensor(torch.zeros(1024))
    sim.launch(later(0.03, lambda: src.fill_(5.0)))  # queued on the default stream
    dst = torch.empty(1024)
    copier.begin(None)
    copier.copy([dst], [src])
    copier.protect([src])
    assert copier.end() is None
    assert torch.equal(dst, torch.full((1024,), 5.0))
    copier.close()


@pytest.mark.anyio
async def test_a_capturing_stream_is_refused_on_the_simulated_device(
    sim: SimulatedDevice, anyio_backend: Any
) -> None:
    from async_stager import UnsupportedError

    x = sim.tensor(torch.ones(64))
    async with Stager(backend=SimulatedBackend(sim)) as stager:
        stream = sim.stream("graph")
        with sim.using(stream):
            stream.capturing = True
            with pytest.raises(UnsupportedError, match="capturing a CUDA graph"):
                stager.stage({"x": x})  # type: ignore[unused-coroutine]
            with pytest.raises(UnsupportedError, match="thread_local"):
                stager.fence()  # type: ignore[unused-coroutine]
            stream.capturing = False
            staged = await stager.stage({"x": x})
        assert torch.equal(staged["x"], torch.ones(64))


@pytest.mark.anyio
async def test_device_hash_falls_back_to_the_host_copy_when_device_memory_runs_out(
    anyio_backend: Any,
) -> None:
    from async_stager._core.checksum.digest import Checksums

    with SimulatedDevice(seed=8, capacity=(1 << 20) + 64) as sim:
        # 1 MiB on the device, hashed there if it could be: the 64 bytes left hold no
        # hash tables.
        big = sim.tensor(torch.randn(1 << 18))
        full = sim.tensor(torch.zeros(16))  # and not even them
        backend = SimulatedBackend(sim)
        async with Stager(backend=backend) as stager:
            lease = await stager.lease({"big": big}, checksums=True)
            staged = lease.state_dict["big"]
            sums = lease.checksums
            assert sums is not None and sums.algorithm_of(staged) != "wsum64"
            assert torch.equal(staged, big)
            algorithm = sums.algorithm_of(staged)
            if algorithm is not None:  # hashed from the host copy, when the copy threads could
                assert sums.get(staged) == Checksums.compute(staged, algorithm)
            lease.release()
        assert [c.hash_fallbacks for c in backend.made] == [1]
        del full
