"""A 2-rank job on gloo (CPU): DTensor-sharded and replicated parameters on a 2-device
CPU DeviceMesh, staged on every rank with async_stager, saved with DCP, loaded into
fresh DTensors and compared as full tensors.

Rank 0 runs its event loop on asyncio and rank 1 on trio: the collectives inside DCP
run in each rank's save thread, so the loop library does not matter. The same code
runs on GPUs with backend "nccl" and device_type "cuda" (see docs/recipes.md).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.timeout(600)  # a hang guard, not a speed check (see CONTRIBUTING.md, "Tests")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _full_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        # 7 rows over 2 ranks: an uneven Shard(0) split (4 + 3).
        "layer.weight": torch.randn(7, 6, generator=g),
        "layer.bias": torch.randn(6, generator=g),
        "embed": torch.randn(10, 4, generator=g).to(torch.bfloat16),
        "plain": torch.arange(5, dtype=torch.int64),
    }


def _rank_main(rank: int, world: int, port: int, ckpt: str) -> None:
    import anyio
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    import async_stager.dcp as adcp
    from async_stager import Stager

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        backend = "asyncio" if rank == 0 else "trio"
        full = _full_state(0)

        # 1. Plain (replicated) tensors: every rank stages, DCP writes each item once.
        async def save_plain() -> None:
            async with Stager() as stager:
                await adcp.save({"full": full, "rank_step": 5}, stager=stager, checkpoint_id=ckpt + "-plain")

        anyio.run(save_plain, backend=backend)
        back: dict[str, Any] = {"full": {k: torch.zeros_like(v) for k, v in full.items()}, "rank_step": 0}
        dcp.load(back, checkpoint_id=ckpt + "-plain")
        assert all(torch.equal(back["full"][k], v) for k, v in full.items()) and back["rank_step"] == 5

        # 2. DTensors on a 2-device CPU mesh: each rank stages and writes its shards.
        mesh = init_device_mesh("cpu", (world,))

        def as_dtensors(src: dict[str, torch.Tensor]) -> dict[str, Any]:
            return {
                "model": {
                    "layer.weight": distribute_tensor(src["layer.weight"], mesh, [Shard(0)]),
                    "layer.bias": distribute_tensor(src["layer.bias"], mesh, [Replicate()]),
                    "embed": distribute_tensor(src["embed"], mesh, [Shard(0)]),
                },
                "plain": src["plain"].clone(),
                "step": 11,
            }

        sd = as_dtensors(full)

        async def stage_and_save() -> None:
            async with Stager() as stager:
                # A snapshot to look at, then the save itself (its own lease).
                async with stager.snapshot(sd) as staged:
                    w = staged["model"]["layer.weight"]
                    assert isinstance(w, DTensor) and w.placements == (Shard(0),)
                    local = sd["model"]["layer.weight"].to_local()
                    assert torch.equal(w.to_local(), local)
                    assert w.to_local().data_ptr() != local.data_ptr()
                await adcp.save(sd, stager=stager, checkpoint_id=ckpt)
                assert stager.stats is not None and stager.stats.tensors == 4

        anyio.run(stage_and_save, backend=backend)

        fresh = as_dtensors({k: torch.zeros_like(v) for k, v in full.items()})
        fresh["step"] = 0
        dcp.load(fresh, checkpoint_id=ckpt)
        for key in ("layer.weight", "layer.bias", "embed"):
            got = fresh["model"][key].full_tensor()
            assert torch.equal(got, full[key]), f"rank {rank}: {key} differs"
        assert torch.equal(fresh["plain"], full["plain"])
        assert fresh["step"] == 11
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_ranks_gloo_dtensor_stage_save_load(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    mp.spawn(_rank_main, args=(2, _free_port(), ckpt), nprocs=2, join=True)
    assert (tmp_path / "ckpt-plain" / ".metadata").exists()
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert ".metadata" in files and sum(f.endswith(".distcp") for f in files) == 2
