"""The budgeted save (``dcp.save(..., host_budget_bytes=N)``) copies through the device
seam: driven here by a ``FakeBackend`` given to the ``Stager`` (a fake device over CPU
tensors whose copies land only when their completion fires, which the test controls).

Checked: each piece's copy is ordered after the capture on the caller's stream; a ring
piece is not written again before the copy of what it held has landed; a failed copy
or completion is the save's error and the ring is released; a cancelled save holds
nothing; a fence orders the caller's stream after the copies; the restore is
bit-exact. The real path (CUDA) is the ``cuda``-marked test at the end.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, cast

import anyio
import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import bits

import async_stager._core.copy.copiers as copiers_mod
import async_stager.dcp as adcp
from async_stager import CopyError, Stager, UnsupportedError
from async_stager._core.aio.stager import stager_internals
from async_stager._core.copy.accelerator import AcceleratorCopier
from async_stager.testing import (
    FakeBackend,
    FakeCapture,
    FakeCopier,
    FakePinner,
    SimulatedBackend,
    SimulatedDevice,
    SimulatedPinner,
)

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.timeout(60),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.usefixtures("no_thread_leak"),
]

KIB = 1024
CPU = torch.device("cpu")
#: Bytes of one tensor of ``tensors()`` (16 Ki float32): one piece of the ring.
PIECE = 64 * KIB


def tensors(n: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {f"w{i}": torch.randn(16 * KIB, generator=g) for i in range(n)}


def load(path: Path, like: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {
        k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in like.items()
    }
    dcp.load(out, checkpoint_id=str(path), no_dist=True)
    return out


async def _await(coro: Any) -> None:
    await coro


class _Recording(FakeBackend):
    """A FakeBackend that records, at each copy's enqueue, the ring bytes it writes and
    which earlier copies had landed by then; ``fail_completion_of``: the completion of
    a copy reading that tensor raises when it fires (a device error reported there)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        #: (ring address, bytes, whether each earlier completion had fired).
        self.enqueues: list[tuple[int, int, list[bool]]] = []
        self.fail_completion_of: torch.Tensor | None = None

    def copier(self, device: torch.device) -> Any:
        return _RecordingCopier(self, device)


class _RecordingCopier(FakeCopier):
    def copy_now(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        backend = cast(_Recording, self._backend)
        d = dsts[0]
        backend.enqueues.append(
            (d.data_ptr(), d.numel() * d.element_size(), [e.fired for e in backend.events])
        )
        super().copy_now(dsts, srcs)
        bad = backend.fail_completion_of
        if bad is not None and any(
            s.untyped_storage().data_ptr() == bad.untyped_storage().data_ptr() for s in srcs
        ):

            def boom() -> None:
                raise RuntimeError("injected completion failure")

            self._ops.append(boom)


class _WatchedPinner(FakePinner):
    """Checks, at the ring's unregistration, that every copy has landed."""

    def __init__(self, backend: FakeBackend) -> None:
        super().__init__()
        self.backend = backend
        self.unregistered_with_all_landed: list[bool] = []

    def unregister(self, ptr: int) -> None:
        self.unregistered_with_all_landed.append(all(e.fired for e in self.backend.events))
        super().unregister(ptr)


async def test_each_copy_waits_for_the_capture_on_the_callers_stream(tmp_path: Path) -> None:
    backend = FakeBackend()
    sd: dict[str, Any] = {**tensors(3), "step": 7}
    want = {k: torch.full_like(v, 5.0) for k, v in sd.items() if isinstance(v, torch.Tensor)}
    async with Stager(backend=backend) as stager:
        stream = backend.stream(CPU)
        # Queued on the caller's stream before the call (a producer kernel that has not
        # run yet): in the snapshot. Queued after the call: not in it.
        stream.enqueue(lambda: [sd[k].fill_(5.0) for k in want])
        coro = adcp.save(sd, stager=stager, checkpoint_id=tmp_path, no_dist=True, host_budget_bytes=2 * PIECE)
        stream.enqueue(lambda: [sd[k].fill_(-1.0) for k in want])
        await coro
    assert backend.captures == 1  # one capture, at the call, on the caller's stream
    (cap,) = {id(c): c for c in backend.begun}.values()
    assert isinstance(cap, FakeCapture) and cap.stream is stream and cap.position == 1
    # Each piece its stage, and one around the bytes items' serialization (their
    # values read after the capture, on the copy stream).
    assert len(backend.events) == 4 and backend.protected == [1, 1, 1]
    assert stream.finished == 1  # the work after the call never ran for the save
    got = load(tmp_path, sd)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    assert got["step"] == 7


async def test_a_ring_piece_is_not_written_again_before_its_copy_landed(tmp_path: Path) -> None:
    # Completions fire on the third query: the copier runs ahead, fills the ring of two
    # pieces and waits for the writer to release the oldest.
    backend = _Recording(polls=3)
    sd = tensors(9)
    stats: list[adcp.BudgetStats] = []
    async with Stager(backend=backend) as stager:
        await adcp.save(
            sd,
            stager=stager,
            checkpoint_id=tmp_path,
            no_dist=True,
            host_budget_bytes=2 * PIECE,
            on_budget_stats=stats.append,
        )
    assert len(backend.enqueues) == 9
    reused = 0
    for k, (ptr, n, fired) in enumerate(backend.enqueues):
        for j in range(k):
            p, m, _ = backend.enqueues[j]
            if p < ptr + n and ptr < p + m:  # piece k overwrites ring bytes of copy j
                reused += 1
                assert fired[j], f"copy {k} was enqueued into copy {j}'s piece before {j} landed"
    assert reused >= 7  # the ring of two pieces was reused for every later copy
    assert stats[0].peak_bytes <= 2 * PIECE
    got = load(tmp_path, sd)
    for name, v in sd.items():
        assert torch.equal(got[name], v), name


@pytest.mark.parametrize("where", ["enqueue", "completion"])
async def test_a_failed_copy_is_the_saves_error_and_releases_the_ring(tmp_path: Path, where: str) -> None:
    backend = _Recording()
    pinner = _WatchedPinner(backend)
    sd = tensors(6)
    if where == "enqueue":
        backend.fail_copy_of = sd["w3"]
    else:
        backend.fail_completion_of = sd["w3"]
    async with Stager(backend=backend, pinner=pinner) as stager:
        with pytest.raises(CopyError, match="'w3'") as err:
            await adcp.save(
                sd, stager=stager, checkpoint_id=tmp_path / "c", no_dist=True, host_budget_bytes=2 * PIECE
            )
        assert "injected" in str(err.value.__cause__)
        assert not (tmp_path / "c" / ".metadata").exists()
        # The ring was pinned once, by the stager's pinner, every copy had landed when
        # the save returned, and the ring is kept for the next save (its lane's).
        assert pinner.total_registrations == 1 and len(pinner.registered) == 1
        assert all(e.fired for e in backend.events)
        with anyio.fail_after(5):
            await stager.fence()
        backend.fail_copy_of = backend.fail_completion_of = None
        await adcp.save(
            sd, stager=stager, checkpoint_id=tmp_path / "d", no_dist=True, host_budget_bytes=2 * PIECE
        )
        assert pinner.total_registrations == 1  # the same ring again: not pinned anew
    # Closing the stager unpins it, every copy landed.
    assert pinner.registered == {} and pinner.unregistered_with_all_landed == [True]
    got = load(tmp_path / "d", sd)
    for k, v in sd.items():
        assert torch.equal(got[k], v), k


async def test_a_cancelled_save_holds_nothing(tmp_path: Path) -> None:
    # Manual completions: the writer waits for the first copy, the copier for ring space.
    backend = FakeBackend(manual=True)
    pinner = _WatchedPinner(backend)
    sd = tensors(8)
    landing = threading.Event()
    stop = threading.Event()

    def device() -> None:
        # Once cancelled, the device lands whatever was enqueued (the save waits for it
        # before it releases the ring).
        landing.wait(10)
        while not stop.wait(0.001):
            backend.complete_all()

    driver = threading.Thread(target=device)
    driver.start()
    try:
        async with Stager(backend=backend, pinner=pinner) as stager:
            with anyio.CancelScope() as scope:
                coro = adcp.save(
                    sd, stager=stager, checkpoint_id=tmp_path / "c", no_dist=True, host_budget_bytes=2 * PIECE
                )
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_await, coro)
                    while len(backend.events) < 2:  # the ring is full, nothing landed
                        await anyio.sleep(0.001)
                    assert not any(e.fired for e in backend.events)
                    scope.cancel()
                    landing.set()
            assert scope.cancelled_caught
            assert not (tmp_path / "c" / ".metadata").exists()
            # Every copy it enqueued landed before the cancelled save returned; its ring
            # is kept for the next save.
            assert all(e.fired for e in backend.events) and len(pinner.registered) == 1
            assert len(backend.events) < 8  # the copies stopped
            with anyio.fail_after(5):
                await stager.fence()  # the cancelled save no longer holds the fence
            backend.manual = False
            await adcp.save(
                sd, stager=stager, checkpoint_id=tmp_path / "d", no_dist=True, host_budget_bytes=2 * PIECE
            )
    finally:
        landing.set()
        stop.set()
        driver.join()
    assert pinner.registered == {} and pinner.total_registrations == 1
    assert pinner.unregistered_with_all_landed == [True]
    got = load(tmp_path / "d", sd)
    for k, v in sd.items():
        assert torch.equal(got[k], v), k


async def test_fence_orders_the_callers_stream_after_the_copies(tmp_path: Path) -> None:
    backend = FakeBackend(manual=True)
    sd = tensors(4)
    want = {k: v.clone() for k, v in sd.items()}
    async with Stager(backend=backend) as stager, anyio.create_task_group() as tg:
        coro = adcp.save(sd, stager=stager, checkpoint_id=tmp_path, no_dist=True, host_budget_bytes=8 * PIECE)
        tg.start_soon(_await, coro)
        try:
            await stager.fence()  # every copy enqueued; none has landed
            assert len(backend.events) == 4 and not any(e.fired for e in backend.events)
            stream = backend.stream(CPU)
            assert [p for p in backend.fence_points if p is stream] and len(backend.fences) == 4
            # Training's in-place update, after the fence on the caller's stream: the
            # device runs the fence's waits first (the copies land), then the update.
            stream.enqueue(lambda: [t.fill_(-1.0) for t in sd.values()])
            stream.run()
            assert all(e.fired for e in backend.events)
        finally:
            backend.complete_all()  # on a failure, the save is not left waiting
    got = load(tmp_path, sd)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def _odd_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(4 * KIB, generator=g)
    # NaN payloads and signed NaNs, which a copy through float would change.
    payloads = torch.tensor([0x7FC1, -0x003D, 0x7F81, 0x0001], dtype=torch.int16)
    return {
        "bf16": payloads.view(torch.bfloat16).repeat(64),
        "fp16": torch.tensor([0x7E01, -0x01FF, 0x0001], dtype=torch.int16).view(torch.float16).repeat(50),
        "view": base[100:1100],  # storage larger than the tensor
        "t": torch.randn(40, 30, generator=g).t(),  # not contiguous
        "empty": torch.empty(0, 3),
        "i64": torch.arange(11),
        "flags": torch.tensor([True, False, True]),
        "conj": torch.randn(8, dtype=torch.complex64, generator=g).conj(),  # a lazy bit
        "big": torch.randn(40 * KIB, generator=g),
        "step": 11,
    }


async def test_restore_is_bit_exact(tmp_path: Path) -> None:
    backend = FakeBackend(polls=2)
    sd = _odd_state()
    async with Stager(backend=backend) as stager:
        await adcp.save(sd, stager=stager, checkpoint_id=tmp_path, no_dist=True, host_budget_bytes=200 * KIB)
    got = load(tmp_path, sd)
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(bits(got[k]), bits(v)), k
    assert got["step"] == 11


async def test_a_capturing_stream_is_refused_before_any_capture(tmp_path: Path) -> None:
    backend = FakeBackend()
    async with Stager(backend=backend) as stager:
        backend.stream(CPU).capturing = True
        with pytest.raises(UnsupportedError, match="capturing a CUDA graph") as err:
            _ = adcp.save(
                tensors(2), stager=stager, checkpoint_id=tmp_path, no_dist=True, host_budget_bytes=PIECE
            )
        assert "dcp.save" in str(err.value)
        assert backend.captures == 0 and backend.events == []
        backend.stream(CPU).capturing = False
        with anyio.fail_after(5):
            await stager.fence()  # nothing registered a fence hook
    assert not (tmp_path / ".metadata").exists()


async def test_the_real_backends_capture_check_comes_before_any_copier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A CUDA machine whose device 0 is capturing a graph, seen through the two queries
    # the real backend asks; no copier (no copy stream, no event) may be made once it
    # is refused.
    made: list[Any] = []
    monkeypatch.setattr(copiers_mod, "cuda_context_devices", lambda: [0])
    monkeypatch.setattr(copiers_mod, "capturing", lambda index: index == 0)
    monkeypatch.setattr(copiers_mod, "CudaCopier", lambda *a, **k: made.append(a))
    async with Stager() as stager:
        with pytest.raises(UnsupportedError, match="capturing a CUDA graph") as err:
            _ = adcp.save(
                tensors(2), stager=stager, checkpoint_id=tmp_path, no_dist=True, host_budget_bytes=PIECE
            )
        assert "dcp.save" in str(err.value) and "cuda:0" in str(err.value)
        assert made == []
        monkeypatch.undo()  # the stager's own fence asks the same (patched) queries
        with anyio.fail_after(5):
            await stager.fence()  # nothing registered a fence hook
    assert not (tmp_path / ".metadata").exists()


# -- the real accelerator copier on the simulated device ----------------------------------


def _odd_device_state(sim: SimulatedDevice) -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    z = sim.tensor(torch.randn(64, 33, dtype=torch.complex64, generator=g))
    m = sim.tensor(torch.randn(96, 40, generator=g))
    payloads = torch.tensor([0x7FC1, -0x003D, 0x7F81, 0x0001], dtype=torch.int16).view(torch.bfloat16)
    return {
        "f32": sim.tensor(torch.randn(16 * KIB, generator=g)),
        "bf16": sim.tensor(payloads.repeat(2048)),
        "f16": sim.tensor(torch.randn(999, generator=g).half()),
        "conj": z.conj(),  # lazy conj bit
        "neg": z.conj().imag,  # lazy neg bit
        "t": m.t(),  # non-contiguous
        "step": m[::3, 1::2],
        "count": 3,
    }


async def _budgeted(sim: SimulatedDevice, sd: dict[str, Any], path: Path, **kw: Any) -> None:
    async with Stager(backend=SimulatedBackend(sim), **kw) as stager:
        await adcp.save(sd, stager=stager, checkpoint_id=path, no_dist=True, host_budget_bytes=2 * PIECE)


async def test_simulated_device_budgeted_save_is_bit_exact_with_lazy_bits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Review finding 2: a conj or neg view through the ring. Bytes of a view with lazy
    # bits are not its values, and ATen resolves the bits of an async device-to-host
    # copy on the host right after enqueueing it, racing the copy: the copier resolves
    # them on the device first.
    with SimulatedDevice(seed=11, delay=(0.001, 0.004)) as sim:
        sd = _odd_device_state(sim)
        want = {k: bits(v.clone()) for k, v in sd.items() if isinstance(v, torch.Tensor)}
        await _budgeted(sim, sd, tmp_path / "a")
        got = load(tmp_path / "a", sd)
        for k, v in want.items():
            assert torch.equal(bits(got[k]), v), k
        # Without the resolution on the device, the simulated device shows the race.
        monkeypatch.setattr(AcceleratorCopier, "_resolved", lambda self, srcs: srcs)
        await _budgeted(sim, sd, tmp_path / "b")
        got = load(tmp_path / "b", sd)
        assert not torch.equal(bits(got["conj"]), want["conj"])
        assert sim.errors == []


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # about the device, not the loop
async def test_simulated_device_budgeted_saves_reuse_streams_and_ring(tmp_path: Path) -> None:
    # Review findings 4 and 5: a budgeted save drew a new copy stream (from a pool of
    # 32 that training and NCCL share) and allocated and pinned a new ring every time.
    with SimulatedDevice(seed=2) as sim:
        backend = SimulatedBackend(sim, pin=True)
        sd = _odd_device_state(sim)
        async with Stager(backend=backend) as stager:
            for i in range(4):
                await adcp.save(
                    sd,
                    stager=stager,
                    checkpoint_id=tmp_path / str(i),
                    no_dist=True,
                    host_budget_bytes=2 * PIECE,
                )
            assert stager_internals(stager).lanes.made == 1
            pinner = sim.pinner()
            assert isinstance(pinner, SimulatedPinner) and len(pinner.registered) == 1
        assert sim.streams_made == 1 and len(backend.made) == 1
        assert pinner.total_registrations == 1 and pinner.registered == {}
        got = load(tmp_path / "3", sd)
        assert torch.equal(bits(got["conj"]), bits(sd["conj"]))


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # about the device, not the loop
async def test_concurrent_budgeted_saves_take_separate_lanes_and_trim_frees_them(tmp_path: Path) -> None:
    # Saves in parallel take a lane each; given back, every lane keeps its streams (one
    # keeps its ring): the next round of parallel saves draws no stream from the pool
    # (32 on CUDA, shared with training and NCCL: a drawn stream may be theirs).
    with SimulatedDevice(seed=6) as sim:
        backend = SimulatedBackend(sim, pin=True)
        pinner = sim.pinner()
        assert isinstance(pinner, SimulatedPinner)
        a, b = _odd_device_state(sim), tensors(4)
        async with Stager(backend=backend) as stager:
            drawn = []
            for rnd in range(3):
                async with anyio.create_task_group() as tg:
                    for name, sd in (("a", a), ("b", b)):
                        tg.start_soon(
                            _await,
                            adcp.save(
                                sd,
                                stager=stager,
                                checkpoint_id=tmp_path / f"{name}{rnd}",
                                no_dist=True,
                                host_budget_bytes=2 * PIECE,
                            ),
                        )
                drawn.append(sim.streams_made)
                assert (
                    stager_internals(stager).lanes.made == 2 and len(pinner.registered) == 1
                )  # one idle ring kept
            assert drawn[0] == drawn[1] == drawn[2], drawn  # no stream drawn after the first round
            registrations = pinner.total_registrations
            await adcp.save(
                a, stager=stager, checkpoint_id=tmp_path / "alone", no_dist=True, host_budget_bytes=2 * PIECE
            )
            assert pinner.total_registrations == registrations  # alone: the lane with the ring
            assert await stager.trim() >= 2 * PIECE // 2
            assert pinner.registered == {}
            await adcp.save(
                b, stager=stager, checkpoint_id=tmp_path / "c", no_dist=True, host_budget_bytes=2 * PIECE
            )
            assert (
                sim.streams_made == drawn[0] and stager_internals(stager).lanes.made == 2
            )  # trim kept the streams
        for name, sd in (("a2", a), ("c", b)):
            got = load(tmp_path / name, sd)
            for k, v in sd.items():
                if isinstance(v, torch.Tensor):
                    assert torch.equal(bits(got[k]), bits(v)), (name, k)
        assert pinner.registered == {}


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # about the device, not the loop
async def test_a_ring_a_copy_may_still_land_in_is_never_reused_nor_freed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Review finding 7: after a host wait gave up, the ring was freed (and unpinned)
    # while a copy could still land in it.
    import async_stager._core.run.lanes as lanes_mod
    import async_stager._dcp.budget.copies as copies_mod

    monkeypatch.setattr(copies_mod, "HOST_WAIT_SECONDS", 0.03)
    monkeypatch.setattr(lanes_mod, "_QUARANTINE", [])
    with SimulatedDevice(seed=3, delay=(0.25, 0.25)) as sim:
        backend = SimulatedBackend(sim, pin=True)
        pinner = sim.pinner()
        assert isinstance(pinner, SimulatedPinner)
        async with Stager(backend=backend) as stager:
            with pytest.raises(CopyError, match="wedged"):
                await adcp.save(
                    {k: sim.tensor(v) for k, v in tensors(2).items()},  # copied by the device
                    stager=stager,
                    checkpoint_id=tmp_path,
                    no_dist=True,
                    host_budget_bytes=2 * PIECE,
                )
        # Closed, but the ring is still registered and referenced: a copy may land.
        assert len(pinner.registered) == 1 and len(lanes_mod._QUARANTINE) == 1
        sim.synchronize()  # the copies land, into memory that is still there
    assert not (tmp_path / ".metadata").exists()


class _Probe:
    """A pickled value that records the simulated device's current stream when read."""

    sim: ClassVar[SimulatedDevice | None] = None
    seen: ClassVar[list[Any]] = []

    def __reduce__(self) -> Any:
        assert _Probe.sim is not None
        _Probe.seen.append(_Probe.sim.current_stream())
        return (_Probe, ())


async def test_values_are_read_as_of_the_call_on_the_copy_stream(tmp_path: Path) -> None:
    # Review finding 8: the copier thread read generators late (after training advanced
    # them) and serialized values with the default stream current.
    with SimulatedDevice(seed=4) as sim:
        _Probe.sim, _Probe.seen = sim, []
        gen = torch.Generator().manual_seed(123)
        at_call = gen.get_state()
        sd: dict[str, Any] = {"w": sim.tensor(torch.randn(100)), "rng": gen, "probe": _Probe()}
        backend = SimulatedBackend(sim)
        async with Stager(backend=backend) as stager:
            coro = adcp.save(
                sd, stager=stager, checkpoint_id=tmp_path, no_dist=True, host_budget_bytes=2 * PIECE
            )
            torch.randn(1000, generator=gen)  # training draws right after the call
            await coro
        out: dict[str, Any] = {"w": torch.zeros(100), "rng": torch.Generator(), "probe": None}
        dcp.load(out, checkpoint_id=str(tmp_path), no_dist=True)
        assert torch.equal(out["rng"].get_state(), at_call)
        assert _Probe.seen and _Probe.seen[0] is backend.made[0].stream  # not the default stream


class _TimedDevice(SimulatedDevice):
    """Records when the first copy is enqueued, and says so (``first``)."""

    first_copy: float | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.first = threading.Event()

    def copy(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        if self.first_copy is None:
            self.first_copy = time.monotonic()
            self.first.set()
        super().copy(dsts, srcs)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # about the device, not the loop
async def test_small_items_are_copied_in_batches_without_a_host_wait(tmp_path: Path) -> None:
    # Review finding 10: each tensor item was its own stage (an event and a wait each),
    # and the copier waited on the host for the captures before any copy, also when no
    # value read on the host could need it.
    sim = _TimedDevice(seed=5)
    with sim:
        g = torch.Generator().manual_seed(0)
        sd: dict[str, Any] = {f"b{i}": sim.tensor(torch.randn(256, generator=g)) for i in range(100)}
        sd["epoch"] = 3  # a bytes item without a tensor inside
        want = {k: v.clone() for k, v in sd.items() if isinstance(v, torch.Tensor)}
        done_at: list[float] = []

        def producer() -> None:
            # Runs until the first copy is enqueued (a hang guard of 60 s: a copier
            # that waited on the host for this producer would enqueue it only after).
            sim.first.wait(60)
            done_at.append(time.monotonic())

        backend = SimulatedBackend(sim)
        async with Stager(backend=backend) as stager:
            # A producer still running on the caller's stream at the call.
            sim.launch(producer)
            await adcp.save(
                sd, stager=stager, checkpoint_id=tmp_path, no_dist=True, host_budget_bytes=4 * PIECE
            )
        assert sim.first_copy is not None and done_at and sim.first_copy < done_at[0]
        assert sim.copies < 10  # 100 items in a few batches, not 100 stages
        got = load(tmp_path, sd)
        for k, v in want.items():
            assert torch.equal(got[k], v), k
        assert got["epoch"] == 3


# -- the real path ---------------------------------------------------------------------


class _RecordingReal(copiers_mod.RealBackend):
    """The real backend, keeping every copier it makes (to look at their streams)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.made: list[Any] = []

    def copier(self, device: torch.device) -> Any:
        c = super().copier(device)
        self.made.append(c)
        return c


@pytest.mark.cuda
async def test_cuda_budgeted_save_through_the_seam(tmp_path: Path) -> None:
    from async_stager._core.memory.arena import CudaPinner

    class Pinner(CudaPinner):
        def __init__(self) -> None:
            self.seen: list[str] = []

        def register(self, ptr: int, nbytes: int) -> None:
            super().register(ptr, nbytes)
            self.seen.append("register")

        def unregister(self, ptr: int) -> None:
            super().unregister(ptr)
            self.seen.append("unregister")

    dev = torch.device("cuda", torch.cuda.current_device())
    sd: dict[str, Any] = {f"w{i}": torch.zeros(64 * KIB, device=dev) for i in range(10)}
    payloads = torch.tensor([0x7FC1, -0x003D, 0x7F81, 0x0001], dtype=torch.int16)
    sd["bf16"] = payloads.view(torch.bfloat16).repeat(1024).to(dev)
    sd["host"] = torch.zeros(1024).pin_memory()  # filled by a copy queued on the caller's stream
    backend = _RecordingReal(non_blocking=True, copy_threads="auto")
    pinner = Pinner()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        # Queued on the caller's (side) stream before the call: in the snapshot.
        torch.cuda._sleep(50_000_000)
        for i in range(10):
            sd[f"w{i}"].fill_(float(i))
        sd["host"].copy_(torch.full((1024,), 3.0, device=dev), non_blocking=True)
        async with Stager(backend=backend, pinner=pinner) as stager, anyio.create_task_group() as tg:
            coro = adcp.save(
                sd, stager=stager, checkpoint_id=tmp_path, no_dist=True, host_budget_bytes=3 * 256 * KIB
            )
            tg.start_soon(_await, coro)
            await stager.fence()
            for i in range(10):
                sd[f"w{i}"].fill_(-1.0)  # ordered after the copies by the fence
    cuda_copiers = [c for c in backend.made if isinstance(c, copiers_mod.CudaCopier)]
    assert cuda_copiers
    for c in cuda_copiers:
        # The copy stream is the save's own: neither the default nor the caller's.
        assert c.stream.cuda_stream not in (side.cuda_stream, torch.cuda.default_stream(dev).cuda_stream)
    assert pinner.seen == ["register", "unregister"]
    out: dict[str, Any] = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in sd.items()}
    dcp.load(out, checkpoint_id=str(tmp_path), no_dist=True)
    for i in range(10):
        assert torch.equal(out[f"w{i}"], torch.full((64 * KIB,), float(i))), i
    assert torch.equal(bits(out["bf16"]), bits(sd["bf16"].cpu()))
    assert torch.equal(out["host"], torch.full((1024,), 3.0))
