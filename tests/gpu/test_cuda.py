"""The real CUDA path: copy stream, capture event, allocator protection, fence, pinning.

Every test here is marked ``cuda`` and skipped without a GPU; scripts/gpu_check.sh
runs them on a CUDA machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from typing import Any, SupportsIndex

import anyio
import pytest
import torch
from helpers import assert_same

from async_stager import (
    CheckpointStagerConfig,
    DefaultStager,
    Stager,
    UnsupportedError,
    UnsupportedTensorError,
)
from async_stager._core.copy.copiers import CudaCopier

pytestmark = [pytest.mark.cuda, pytest.mark.anyio, pytest.mark.timeout(120)]

# About 50 ms of GPU busy-wait on current GPUs: long enough that a copy not ordered
# after it would read the old values.
_SPIN_CYCLES = 50_000_000


def _side_stream() -> torch.cuda.Stream:
    """A side stream ordered after the work already queued on the current stream (the
    tensors' initial values), as training on a side stream would be. The tests run
    there: on the default stream, a stage that missed its capture would still be
    ordered by the copier's fallback (it waits for the default stream)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    return side


async def test_gpu_state_dict_is_staged_pinned(anyio_backend: Any) -> None:
    sd: dict[str, Any] = {
        "w": torch.randn(256, 256, device="cuda"),
        "b": torch.randn(256, device="cuda"),
        "small": [torch.randn(16, device="cuda") for _ in range(500)],
        "cpu_step": torch.tensor(3),
        "bf16": torch.randn(64, device="cuda", dtype=torch.bfloat16),
    }
    async with Stager() as stager:
        assert stager.options.pin_memory and stager.options.non_blocking
        staged = await stager.stage(sd)
        assert staged["w"].device.type == "cpu" and staged["w"].is_pinned()
        assert torch.equal(staged["w"], sd["w"].cpu())
        assert torch.equal(staged["bf16"], sd["bf16"].cpu())
        assert all(torch.equal(a, b.cpu()) for a, b in zip(staged["small"], sd["small"]))
        assert torch.equal(staged["cpu_step"], torch.tensor(3))
        again = await stager.stage(sd)
        assert stager.stats is not None and stager.stats.fast_path
        assert torch.equal(again["w"], sd["w"].cpu())


async def test_producer_still_running_at_the_call(anyio_backend: Any) -> None:
    x = torch.zeros(1 << 20, device="cuda")
    side = _side_stream()
    async with Stager() as stager:
        await stager.reserve({"x": x})
        with torch.cuda.stream(side):
            torch.cuda._sleep(_SPIN_CYCLES)  # the producer is still busy...
            x.fill_(7.0)  # ...and this write is queued behind it
            staged = await stager.stage({"x": x})  # snapshot point: after the fill
        assert torch.equal(staged["x"], torch.full((1 << 20,), 7.0))


async def test_copies_are_asynchronous(anyio_backend: Any) -> None:
    # The worker must enqueue the copies and return while the capture is still held
    # back by a long kernel: copies made synchronous (a blocking copy, a host wait in
    # the worker) would leave no completion in flight.
    x = torch.ones(1 << 20, device="cuda")
    side = _side_stream()
    async with Stager() as stager:
        await stager.reserve({"x": x})
        with torch.cuda.stream(side):
            torch.cuda._sleep(4 * _SPIN_CYCLES)
            pending = stager.stage({"x": x})
        job = stager._last_job
        assert job is not None
        while not job.future.done():
            await anyio.sleep(0.001)
        record = job.future.result()
        assert record.completions, "the copies were synchronous"
        assert not side.query(), "the kernel ended before the copies were enqueued"
        assert not any(c.query() for c in record.completions)
        del record
        staged = await pending
        assert torch.equal(staged["x"], torch.ones(1 << 20))


async def test_host_waits_sleep_instead_of_spinning(anyio_backend: Any) -> None:
    x = torch.ones(1 << 20, device="cuda")
    side = _side_stream()
    async with Stager() as stager:
        await stager.reserve({"x": x})
        with torch.cuda.stream(side):
            torch.cuda._sleep(8 * _SPIN_CYCLES)
            pending = stager.stage({"x": x})
        job = stager._last_job
        assert job is not None
        while not job.future.done():
            await anyio.sleep(0.001)
        (completion,) = job.future.result().completions
        wall0, cpu0 = time.perf_counter(), time.thread_time()
        completion.synchronize()  # what the worker, close() and the seed's API do
        wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
        assert wall > 0.05, "the kernel ended too soon to tell"
        assert cpu < 0.5 * wall, f"a host wait of {wall:.3f} s used {cpu:.3f} s of CPU: it spins"
        await pending


async def test_pinned_cpu_leaf_filled_by_a_pending_copy(anyio_backend: Any) -> None:
    # A CPU leaf still being filled by a non_blocking device-to-host copy queued on the
    # caller's stream before the call: the host copy must wait for it.
    n = 8 << 20
    src = torch.full((n,), 3.0, device="cuda")
    buf = torch.zeros(n).pin_memory()
    side = _side_stream()
    async with Stager() as stager:
        await stager.reserve({"buf": buf, "w": src})
        with torch.cuda.stream(side):
            torch.cuda._sleep(4 * _SPIN_CYCLES)  # the copy into buf lands after this
            buf.copy_(src, non_blocking=True)
            staged = await stager.stage({"buf": buf, "w": src})
        assert bool((staged["buf"] == 3.0).all())
        assert bool((staged["w"] == 3.0).all())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
async def test_first_stage_from_another_device_is_captured(anyio_backend: Any) -> None:
    # The caller is on GPU 0; the source lives on GPU 1, whose current stream is a side
    # stream with the producer still queued. Nothing was staged from GPU 1 before.
    torch.cuda.set_device(0)
    x = torch.zeros(1 << 20, device="cuda:1")
    s1 = torch.cuda.Stream(device=1)
    s1.wait_stream(torch.cuda.current_stream(1))
    prev = torch.cuda.current_stream(1)
    torch.cuda.set_stream(s1)  # GPU 1's current stream (this makes GPU 1 current)...
    torch.cuda.set_device(0)  # ...and the caller is back on GPU 0
    try:
        with torch.cuda.device(1):
            torch.cuda._sleep(4 * _SPIN_CYCLES)
            x.fill_(7.0)  # queued on GPU 1's current stream, behind the kernel
        assert torch.cuda.current_device() == 0
        async with Stager() as stager:
            staged = await stager.stage({"x": x})
        assert torch.equal(staged["x"], torch.full((1 << 20,), 7.0))
    finally:
        torch.cuda.set_stream(prev)
        torch.cuda.set_device(0)
        torch.cuda.synchronize(1)


async def test_stage_inside_a_graph_capture_is_refused(anyio_backend: Any) -> None:
    x = torch.ones(1 << 10, device="cuda")
    async with Stager() as stager:
        assert torch.equal((await stager.stage({"x": x}))["x"], x.cpu())
        side = _side_stream()
        with torch.cuda.stream(side):  # warm-up, as torch's CUDA graph docs ask
            y = x * 2
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = x * 2
            with pytest.raises(UnsupportedError, match="thread_local"):
                stager.stage({"x": x})  # type: ignore[unused-coroutine]
            with pytest.raises(UnsupportedError, match="capturing a CUDA graph"):
                stager.fence()  # type: ignore[unused-coroutine]
        # The capture was not disturbed, and the stager stays usable.
        x.fill_(3.0)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, torch.full_like(x, 6.0))
        assert torch.equal((await stager.stage({"x": x, "y": y}))["y"], y.cpu())


async def test_source_freed_and_reallocated_during_the_copy(anyio_backend: Any) -> None:
    n = 64 << 20  # 256 MiB of float32: the copy takes a while
    src = torch.full((n,), 3.0, device="cuda")
    async with Stager() as stager:
        await stager.reserve({"src": src})
        torch.cuda._sleep(4 * _SPIN_CYCLES)  # the copy stream waits behind this
        pending = stager.stage({"src": src})  # submitted (and captured) now
        job = stager._last_job
        assert job is not None
        result: dict[str, Any] = {}

        async def finish() -> None:
            result["staged"] = await pending

        async with anyio.create_task_group() as tg:
            tg.start_soon(finish)
            # Wait until the worker has enqueued the copies and let go of the dict,
            # while the copy stream is still held back by the capture event.
            while not job.future.done():
                await anyio.sleep(0.001)
            await anyio.sleep(0.005)
            del src  # the last reference: the allocator may now reuse the memory...
            other = torch.full((n,), -1.0, device="cuda")  # ...unless record_stream held it
        assert bool((result["staged"]["src"] == 3.0).all())
        del other


async def test_fence_orders_training_after_the_copies(anyio_backend: Any) -> None:
    w = torch.full((32 << 20,), 1.0, device="cuda")
    side = _side_stream()
    result: dict[str, Any] = {}
    async with Stager() as stager:
        await stager.reserve({"w": w})
        with torch.cuda.stream(side):
            torch.cuda._sleep(_SPIN_CYCLES)  # the copies wait behind the capture
            # Submitted (snapshot point) before the fence, whatever order the event
            # loop runs the tasks in (trio randomizes it): the stage is a task only for
            # its wait.
            pending = stager.stage({"w": w})

            async def checkpoint() -> None:
                result["staged"] = await pending

            async with anyio.create_task_group() as tg:
                tg.start_soon(checkpoint)
                await stager.fence()  # the optimizer step may now run on this stream
                w.add_(1.0)
        torch.cuda.synchronize()
    assert bool((result["staged"]["w"] == 1.0).all())
    assert bool((w == 2.0).all())


async def test_fence_orders_the_stream_current_at_the_call(anyio_backend: Any) -> None:
    w = torch.full((32 << 20,), 1.0, device="cuda")
    side = _side_stream()
    async with Stager() as stager:
        await stager.reserve({"w": w})
        with torch.cuda.stream(side):
            torch.cuda._sleep(2 * _SPIN_CYCLES)  # the copies wait behind the capture
            pending = stager.stage({"w": w})
            fence = stager.fence()  # reads the side stream now...
        await fence  # ...and is awaited with the default stream current
        with torch.cuda.stream(side):
            w.add_(1.0)  # the optimizer step on the side stream: after the copies
        staged = await pending
        torch.cuda.synchronize()
        assert bool((staged["w"] == 1.0).all())
        assert bool((w == 2.0).all())


async def test_scratch_is_returned_between_stages_and_falls_back(
    anyio_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    sd = {f"n{i}": torch.randn(16, device="cuda") for i in range(5000)}
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    async with Stager() as stager:
        staged = await stager.stage(sd)
        copier = stager._engine._copiers[torch.device("cuda", torch.cuda.current_device())]
        assert isinstance(copier, CudaCopier)
        plan = next(iter(staged_set_plans(stager)))
        runs = [r for p in plan.programs for r in p.runs]
        assert runs, "small storages were not gathered"
        # Between stages the scratch holds no device memory (the allocator may give
        # it to training): the views stay, their storage is empty.
        assert all(r.scratch.untyped_storage().nbytes() == 0 for r in runs)
        del plan, runs
        assert copier.scratch_live_bytes == 0
        assert torch.cuda.memory_allocated() == base
        del staged
        for v in sd.values():
            v.add_(1.0)
        staged = await stager.stage(sd)  # re-materialized on the copy stream
        for k in ("n0", "n2500", "n4999"):
            assert torch.equal(staged[k], sd[k].cpu())
        del staged

        def out_of_memory(scratch: torch.Tensor) -> None:
            raise torch.OutOfMemoryError("no scratch for you")

        # Out of device memory when a run's scratch is needed: copied directly.
        monkeypatch.setattr(copier, "_grow_scratch", out_of_memory)
        fallbacks = copier.scratch_fallbacks
        for v in sd.values():
            v.add_(1.0)
        staged = await stager.stage(sd)
        assert copier.scratch_fallbacks > fallbacks
        for k in ("n0", "n2500", "n4999"):
            assert torch.equal(staged[k], sd[k].cpu())


async def test_many_small_tensors_are_batched(anyio_backend: Any) -> None:
    sd = {f"n{i}": torch.randn(16, device="cuda") for i in range(20_000)}
    async with Stager() as stager:
        staged = await stager.stage(sd)
        staged = await stager.stage(sd)
        for k in ("n0", "n9999", "n19999"):
            assert torch.equal(staged[k], sd[k].cpu())
        prog = stager._engine.sets.all()[0].plans[next(iter(stager._engine.sets.all()[0].plans))].programs
        assert any(p.runs for p in prog)


async def test_views_and_offsets_on_the_gpu(anyio_backend: Any) -> None:
    base = torch.arange(1000.0, device="cuda")
    sd = {"base": base, "view": base[100:200].view(10, 10), "t": base[:100].view(10, 10).t()}
    async with Stager() as stager:
        staged = await stager.stage(sd)
        b = base.cpu()  # one CPU copy, so the expected views keep their offsets too
        assert_same(staged, {"base": b, "view": b[100:200].view(10, 10), "t": b[:100].view(10, 10).t()})
        assert staged["view"].untyped_storage().data_ptr() == staged["base"].untyped_storage().data_ptr()


async def test_dtypes_without_a_fused_cuda_copy(anyio_backend: Any) -> None:
    # The small-tensor gather uses CUDA's fused foreach copy, which lacks some dtypes:
    # those storages must go as raw bytes.
    sd = {"u16": torch.arange(64, dtype=torch.int32, device="cuda").to(torch.uint16)}
    sd["f32"] = torch.randn(64, device="cuda")
    async with Stager() as stager:
        staged = await stager.stage(sd)
        staged = await stager.stage(sd)
        assert staged["u16"].dtype == torch.uint16
        assert torch.equal(staged["u16"].to(torch.int32), torch.arange(64, dtype=torch.int32))
        assert torch.equal(staged["f32"], sd["f32"].cpu())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
async def test_two_accelerator_devices_are_refused(anyio_backend: Any) -> None:
    sd = {"a": torch.ones(2, device="cuda:0"), "b": torch.ones(2, device="cuda:1")}
    async with Stager() as stager:
        with pytest.raises(UnsupportedTensorError, match="cuda"):
            await stager.stage(sd)


def test_default_stager_on_cuda() -> None:
    sd: dict[str, Any] = {"w": torch.randn(1024, 1024, device="cuda"), "step": 5}
    with DefaultStager(CheckpointStagerConfig()) as stager:
        staged = stager.stage(sd).result(timeout=60)  # type: ignore[union-attr]
        assert staged["w"].is_pinned() and torch.equal(staged["w"], sd["w"].cpu())
    with DefaultStager(CheckpointStagerConfig(use_async_staging=False, use_shared_memory=False)) as stager:
        staged = stager.stage(sd)
        assert torch.equal(staged["w"], sd["w"].cpu())  # type: ignore[index]


def staged_set_plans(stager: Stager) -> list[Any]:
    return [p for s in stager._engine.sets.all() for p in s.plans.values()]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_no_context_is_created_on_gpu0() -> None:
    # A fresh process (contexts cannot be undone): a rank on GPU 1 stages a CPU-only
    # state dict before CUDA is initialised (nothing is pinned, no context made), then
    # stages from GPU 1 with the event loop in a thread that never selected a device.
    # GPU 0 must stay untouched.
    code = textwrap.dedent(
        """
        import asyncio, threading, torch
        from async_stager import Stager

        has = torch._C._cuda_hasPrimaryContext

        async def cpu_only(stager):
            staged = await stager.stage({"w": torch.ones(1 << 20)})
            assert torch.equal(staged["w"], torch.ones(1 << 20))

        async def from_gpu1(stager, x):
            staged = await stager.stage({"x": x})
            await stager.fence()
            assert torch.equal(staged["x"], torch.full((1 << 20,), 2.0))

        stager = Stager()
        asyncio.run(cpu_only(stager))
        assert not torch.cuda.is_initialized(), "a CPU-only stage initialised CUDA"
        torch.cuda.set_device(1)
        x = torch.full((1 << 20,), 2.0, device="cuda:1")
        torch.cuda.synchronize(1)
        t = threading.Thread(target=lambda: asyncio.run(from_gpu1(stager, x)))
        t.start()
        t.join()
        stager.close()
        assert not has(0), "staging from GPU 1 created a context on GPU 0"
        print("ok")
        """
    )
    env = dict(os.environ, LOCAL_RANK="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-4000:]


def _odd_bit_tensors(device: str) -> dict[str, torch.Tensor]:
    """bf16/fp16/fp8 tensors whose bits a value copy changes: NaN payloads, negative
    NaNs, negative zero; small (gathered) and large (copied directly)."""
    sd: dict[str, torch.Tensor] = {}
    bf16 = torch.tensor([0x7FC1, 0xFFA5, 0x8000, 0x7F81, 0x3F80], dtype=torch.int32).to(torch.int16)
    fp16 = torch.tensor([0x7E01, 0xFC01, 0x8000, 0x7C01, 0x3C00], dtype=torch.int32).to(torch.int16)
    fp8 = torch.tensor([0x7F, 0xFF, 0x80, 0x01], dtype=torch.uint8)
    for i in range(64):
        sd[f"bf16.{i}"] = bf16.to(device).view(torch.bfloat16)
        sd[f"fp16.{i}"] = fp16.to(device).view(torch.float16)
        sd[f"fp8.{i}"] = fp8.to(device).view(torch.float8_e4m3fn)
    sd["bf16.large"] = bf16.repeat(1 << 18).to(device).view(torch.bfloat16)
    return sd


async def test_reduced_float_gathers_are_bit_copies(anyio_backend: Any) -> None:
    # CUDA's _foreach_copy_ fast path converts bf16/fp16/fp8 through float: the
    # gather must copy bytes.
    sd = _odd_bit_tensors("cuda")
    async with Stager() as stager:
        for _ in range(2):  # the first stage (plans) and the cached one
            staged = await stager.stage(sd)
            for k, v in sd.items():
                got = staged[k]
                assert got.dtype == v.dtype, k
                assert torch.equal(got.view(torch.uint8), v.cpu().view(torch.uint8)), k
            del staged


# -- issue 25: budgeted saves under capture, the ring's pinning ------------------------


async def test_budgeted_save_inside_a_graph_capture_is_refused(anyio_backend: Any, tmp_path: Any) -> None:
    import torch.distributed.checkpoint as dcp

    import async_stager.dcp as adcp

    x = torch.ones(1 << 14, device="cuda")
    async with Stager() as stager:
        side = _side_stream()
        with torch.cuda.stream(side):  # warm-up, as torch's CUDA graph docs ask
            y = x * 2
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = x * 2
            with pytest.raises(UnsupportedError, match="capturing a CUDA graph"):
                _ = adcp.save(
                    {"x": x},
                    stager=stager,
                    checkpoint_id=tmp_path / "g",
                    no_dist=True,
                    host_budget_bytes=1 << 20,
                )
        # The capture was not disturbed, and a budgeted save outside it works.
        x.fill_(3.0)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, torch.full_like(x, 6.0))
        await adcp.save(
            {"y": y}, stager=stager, checkpoint_id=tmp_path / "ok", no_dist=True, host_budget_bytes=1 << 20
        )
    out = {"y": torch.zeros(1 << 14)}
    dcp.load(out, checkpoint_id=str(tmp_path / "ok"), no_dist=True)
    assert torch.equal(out["y"], torch.full((1 << 14,), 6.0))


async def test_budget_ring_pins_through_the_arenas_pinner(
    anyio_backend: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import async_stager.dcp as adcp
    from async_stager._core.memory.arena import CudaPinner

    seen: list[tuple[str, int]] = []

    class Recording(CudaPinner):
        def register(self, ptr: int, nbytes: int) -> None:
            super().register(ptr, nbytes)
            seen.append(("register", nbytes))

        def unregister(self, ptr: int) -> None:
            super().unregister(ptr)
            seen.append(("unregister", 0))

    sd = {f"w{i}": torch.full((1 << 16,), float(i), device="cuda") for i in range(4)}
    async with Stager(pinner=Recording()) as stager:  # the budget ring pins with the stager's pinner
        await adcp.save(sd, stager=stager, checkpoint_id=tmp_path, no_dist=True, host_budget_bytes=1 << 20)
    assert [k for k, _ in seen] == ["register", "unregister"], seen
    assert 0 < seen[0][1] <= 1 << 20


def test_failed_pin_registration_raises_and_leaves_no_cuda_error() -> None:
    from async_stager import PinningError
    from async_stager._core.memory.arena import CudaPinner, pin
    from async_stager._core.memory.ring import Ring

    mem = torch.empty(1 << 20, dtype=torch.uint8)
    pinner = CudaPinner()
    pinner.register(mem.data_ptr(), mem.numel())
    try:
        # Registered twice: cudaErrorHostMemoryAlreadyRegistered, raised as PinningError.
        with pytest.raises(PinningError, match="cudaHostRegister"):
            pin(pinner, mem, mem.data_ptr(), mem.numel())
        # The failure is not left on the thread for the next kernel launch to report.
        y = torch.ones(1 << 10, device="cuda") * 2
        torch.cuda.synchronize()
        assert float(y.sum()) == 2.0 * (1 << 10)
    finally:
        pinner.unregister(mem.data_ptr())
    ring = Ring(1 << 20, pinner=pinner)
    assert ring.pinned
    ring.close()
    assert not ring.pinned


# -- issue 25: restore's verification hashes on the rank's device ----------------------


def test_verification_in_a_worker_thread_hashes_on_the_ranks_device() -> None:
    import threading

    from async_stager._checkpoint import integrity
    from async_stager._core.checksum.digest import chunk_key
    from async_stager._core.checksum.wordhash import ALGORITHM, OFFLOAD_BYTES, wsum64_digest

    dev = torch.cuda.current_device()
    big = torch.randn(OFFLOAD_BYTES // 2)  # 16 MiB: hashed on a GPU
    entry = {
        "fqn": "w",
        "offsets": [0],
        "shape": list(big.shape),
        "dtype": "float32",
        "digest": wsum64_digest(big.clone()),
        "hash": ALGORITHM,
    }
    if "LOCAL_RANK" not in os.environ:
        assert integrity.rank_cuda_device() == dev
    seen: list[object] = []

    def worker() -> None:
        try:
            n = integrity.verify_flat(1, {chunk_key("w", [0]): entry}, {"w": big})
            seen.append(n)
        except BaseException as e:  # noqa: BLE001 - reported below
            seen.append(e)

    t = threading.Thread(target=worker)
    t.start()
    t.join(60)
    assert seen == [1], seen


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_verification_creates_no_context_on_gpu0() -> None:
    # A fresh process: rank 1 verifies a big host chunk from a worker thread (whose
    # current device is 0); GPU 0 must stay untouched.
    code = textwrap.dedent(
        """
        import threading, torch
        from async_stager._checkpoint import integrity
        from async_stager._core.checksum.digest import chunk_key
        from async_stager._core.checksum.wordhash import ALGORITHM, wsum64_digest

        torch.cuda.set_device(1)
        torch.ones(1, device="cuda:1")
        big = torch.randn(1 << 23)
        entry = {"fqn": "w", "offsets": [0], "shape": list(big.shape), "dtype": "float32",
                 "digest": wsum64_digest(big), "hash": ALGORITHM}
        assert not torch._C._cuda_hasPrimaryContext(0)
        out = []
        t = threading.Thread(target=lambda: out.append(
            integrity.verify_flat(1, {chunk_key("w", [0]): entry}, {"w": big})))
        t.start()
        t.join()
        assert out == [1], out
        assert not torch._C._cuda_hasPrimaryContext(0), "verification made a context on GPU 0"
        print("ok")
        """
    )
    env = dict(os.environ, LOCAL_RANK="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-4000:]


# -- issue 25: a CPU-only state dict creates no CUDA context to pin ----------------------


def test_cpu_only_state_dict_creates_no_cuda_context() -> None:
    # A fresh process (contexts cannot be undone): CPU-only stages leave CUDA
    # uninitialised; once a GPU tensor is staged, its memory is pinned.
    code = textwrap.dedent(
        """
        import asyncio, torch
        from async_stager import Stager

        async def main():
            async with Stager() as stager:
                assert stager.options.pin_memory
                sd = {"w": torch.randn(1 << 20), "step": torch.tensor(3)}
                for _ in range(2):
                    staged = await stager.stage(sd)
                    assert torch.equal(staged["w"], sd["w"])
                    del staged
                assert not torch.cuda.is_initialized(), "a CPU-only stage initialised CUDA"
                x = torch.full((1 << 20,), 2.0, device="cuda")
                staged = await stager.stage({"x": x})
                await stager.fence()
                assert staged["x"].is_pinned(), "a GPU stage's memory is not pinned"
                assert torch.equal(staged["x"], torch.full((1 << 20,), 2.0))

        asyncio.run(main())
        print("ok")
        """
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-4000:]


# -- issue 25: CUDA generator states are taken at the call --------------------------------


class _WalkGate:
    """An object the worker's walk stops at (its reduce waits) until the test says."""

    def __init__(self) -> None:
        import threading

        self.go = threading.Event()

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        assert self.go.wait(30)
        return (_WalkGate, ())


async def test_cuda_default_generator_is_staged_as_of_the_call(anyio_backend: Any) -> None:
    dev = torch.cuda.current_device()
    default = torch.cuda.default_generators[dev]
    gate = _WalkGate()
    async with Stager() as stager:
        want = default.get_state()
        coro = stager.stage({"gate": gate, "rng": default, "w": torch.ones(1 << 10, device="cuda")})
        torch.rand(1 << 10, device="cuda")  # advances the default CUDA generator
        gate.go.set()
        staged = await coro
        rng = staged["rng"]
        assert isinstance(rng, torch.Generator) and torch.equal(rng.get_state(), want)
        assert not torch.equal(default.get_state(), want)
        await stager.fence()


def test_cuda_generator_at_the_top_level_is_staged_as_of_the_call() -> None:
    from async_stager._core.run.make import build_engine

    engine = build_engine()
    try:
        g = torch.Generator(device="cuda").manual_seed(7)
        sd = {"train": {"rng": g}, "w": torch.ones(1 << 10, device="cuda")}
        for _ in range(2):  # the slow path, then the fast path
            want = g.get_state()
            captures = engine.capture(sd)
            torch.rand(1 << 10, device="cuda", generator=g)  # launched right after the call
            staged = engine.run(sd, captures)
            for c in staged.completions:
                c.synchronize()
            engine.settle(staged)
            rng = staged.result["train"]["rng"]
            assert rng.device == g.device and torch.equal(rng.get_state(), want)
            assert torch.equal(staged.result["w"], torch.ones(1 << 10))
            del staged, rng
    finally:
        engine.close()


# -- issue 25: the copy and hash streams are never the caller's -------------------------


def test_streams_drawn_after_the_pool_cycles_are_never_the_callers() -> None:
    from async_stager._core.copy.cuda import CudaPrimitives

    dev = torch.device("cuda", torch.cuda.current_device())
    default = torch.cuda.default_stream(dev).cuda_stream
    for _ in range(3):
        mine = torch.cuda.Stream(device=dev)
        for _ in range(31):  # the pool holds 32: the next plain draw may be ``mine``
            torch.cuda.Stream(device=dev)
        with torch.cuda.stream(mine):
            copier = CudaCopier(dev, non_blocking=True)
            try:
                assert copier.stream.cuda_stream not in (mine.cuda_stream, default)
                copier.capture()
                other = CudaPrimitives(dev).new_stream((copier.stream,))
                assert other.cuda_stream not in (mine.cuda_stream, default, copier.stream.cuda_stream)
            finally:
                copier.close()


async def test_hash_stream_is_neither_the_copy_stream_nor_the_callers(anyio_backend: Any) -> None:
    side = _side_stream()
    x = torch.randn(4 << 20, device="cuda")  # 16 MiB: hashed on the device (WSUM64)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        async with Stager() as stager:
            for _ in range(40):  # cycle the pool well past the stager's own streams
                torch.cuda.Stream()
            lease = await stager.lease({"x": x}, checksums=True)
            assert torch.equal(lease.state_dict["x"], x.cpu())
            assert lease.checksums is not None
            lease.release()
            copiers = [c for c in stager._engine._copiers.values() if isinstance(c, CudaCopier)]
            assert copiers
            default = torch.cuda.default_stream().cuda_stream
            for c in copiers:
                hs = c._hash_stream
                assert hs is not None  # the stage hashed on the device
                assert c.stream.cuda_stream not in (side.cuda_stream, default)
                assert hs.cuda_stream not in (side.cuda_stream, default, c.stream.cuda_stream)
            await stager.fence()


async def test_foreign_cuda_memory_is_held_until_its_copies_landed(anyio_backend: Any) -> None:
    """Issue 25: ``record_stream`` does nothing for memory torch's caching allocator
    does not own (DLPack imports, CUDA IPC handles). The stage's completion event holds
    every CUDA source until its copies have read it, then lets go."""
    import gc
    import weakref

    from torch.utils import dlpack

    owner = torch.full((1 << 22,), 3.0, device="cuda")  # 16 MiB
    src = dlpack.from_dlpack(dlpack.to_dlpack(owner))  # the same memory, via DLPack
    alive = weakref.ref(src)
    copier = CudaCopier(torch.device("cuda", torch.cuda.current_device()), non_blocking=True)
    dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    copier.begin(copier.capture())
    copier.copy([dst], [src])
    copier.protect([src])
    done = copier.end()
    assert done is not None
    del src
    gc.collect()
    held = alive() is not None  # held by the event while the copy may still be reading
    done.synchronize()
    gc.collect()
    assert held and alive() is None  # let go once the copy landed
    assert torch.equal(dst, torch.full_like(dst, 3.0))
