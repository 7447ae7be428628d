"""The real CUDA path: copy stream, capture event, allocator protection, fence, pinning.

Every test here is marked ``cuda`` and skipped without a GPU; scripts/gpu_check.sh
runs them on a CUDA machine.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch
from helpers import assert_same

from async_stager import CheckpointStagerConfig, DefaultStager, Stager, UnsupportedTensorError

pytestmark = [pytest.mark.cuda, pytest.mark.anyio, pytest.mark.timeout(120)]

# About 50 ms of GPU busy-wait on current GPUs: long enough that a copy not ordered
# after it would read the old values.
_SPIN_CYCLES = 50_000_000


async def test_gpu_state_dict_is_staged_pinned(anyio_backend: Any) -> None:
    sd = {
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
    async with Stager() as stager:
        await stager.reserve({"x": x})
        torch.cuda._sleep(_SPIN_CYCLES)  # the producer is still busy...
        x.fill_(7.0)  # ...and this write is queued behind it
        staged = await stager.stage({"x": x})  # snapshot point: after the fill
        assert torch.equal(staged["x"], torch.full((1 << 20,), 7.0))


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
    async with Stager() as stager:
        await stager.reserve({"w": w})
        async with anyio.create_task_group() as tg:
            result: dict[str, Any] = {}

            async def checkpoint() -> None:
                result["staged"] = await stager.stage({"w": w})

            tg.start_soon(checkpoint)
            await anyio.sleep(0)
            await stager.fence()  # the optimizer step may now run on the current stream
            w.add_(1.0)
        assert bool((result["staged"]["w"] == 1.0).all())
        assert bool((w == 2.0).all())


async def test_many_small_tensors_are_batched(anyio_backend: Any) -> None:
    sd = {f"n{i}": torch.randn(16, device="cuda") for i in range(20_000)}
    async with Stager() as stager:
        staged = await stager.stage(sd)
        staged = await stager.stage(sd)
        for k in ("n0", "n9999", "n19999"):
            assert torch.equal(staged[k], sd[k].cpu())
        prog = stager._engine._sets[0].plans[next(iter(stager._engine._sets[0].plans))].programs
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
    sd = {"w": torch.randn(1024, 1024, device="cuda"), "step": 5}
    with DefaultStager(CheckpointStagerConfig()) as stager:
        staged = stager.stage(sd).result(timeout=60)  # type: ignore[union-attr]
        assert staged["w"].is_pinned() and torch.equal(staged["w"], sd["w"].cpu())
    with DefaultStager(CheckpointStagerConfig(use_async_staging=False, use_shared_memory=False)) as stager:
        staged = stager.stage(sd)
        assert torch.equal(staged["w"], sd["w"].cpu())  # type: ignore[index]
