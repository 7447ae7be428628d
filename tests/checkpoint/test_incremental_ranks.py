"""Incremental saves on a 2-rank gloo job (issue 43): DTensor shards and a replicated
tensor; a tensor referenced only when every rank's every chunk is unchanged (a change
on one rank's shard writes it in full on both); every kept step restores on the 2
ranks, and at another world size (one process: the Checkpointer and plain
``dcp.load``)."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from async_stager import Checkpointer

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.slow,  # 2 spawned gloo ranks: CI's second call
    pytest.mark.timeout(600),  # a hang guard, not a speed check (see CONTRIBUTING.md, "Tests")
]

STEPS = (1, 2, 3, 4)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def full(step: int) -> dict[str, torch.Tensor]:
    """The global values at ``step``: ``w`` frozen; ``b`` changes every step; ``e``'s
    first rows (rank 0's shard) change at step 3 only."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(128, 256, generator=g)
    e = torch.randn(64, 16, generator=g)
    if step >= 3:
        e[:8] += 1
    return {"w": w, "b": torch.full((256,), float(step)), "e": e}


def _rank_main(rank: int, world: int, port: int, directory: str) -> None:
    import anyio
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))

        def sharded(src: dict[str, torch.Tensor], step: int) -> dict[str, Any]:
            return {
                "model": {
                    "w": distribute_tensor(src["w"], mesh, [Shard(0)]),
                    "b": distribute_tensor(src["b"], mesh, [Replicate()]),
                    "e": distribute_tensor(src["e"], mesh, [Shard(0)]),
                },
                "step": step,
            }

        async def main() -> None:
            reused = []
            async with Checkpointer(directory, keep=3, incremental=True) as ckpt:
                for step in STEPS:
                    await ckpt.save(sharded(full(step), step), step=step)
                    await ckpt.wait()
                    assert ckpt.last is not None
                    reused.append(ckpt.last.reused_bytes)
                w_local = 64 * 256 * 4  # this rank's shard of w
                e_local = 32 * 16 * 4
                # 2: w and e referenced; 3: e changed on rank 0: written on both; 4: both.
                assert reused == [0, w_local + e_local, w_local, w_local + e_local], (rank, reused)
                for step in ckpt.steps():
                    out = sharded({k: torch.zeros_like(v) for k, v in full(step).items()}, -1)
                    assert await ckpt.restore(out, step=step, fallback=False) == step
                    for k, v in full(step).items():
                        assert torch.equal(out["model"][k].full_tensor(), v), (rank, step, k)
                    assert out["step"] == step

        anyio.run(main, backend="asyncio" if rank == 0 else "trio")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_ranks_incremental_with_dtensors_and_a_restore_at_one_rank(tmp_path: Path) -> None:
    import anyio

    directory = str(tmp_path / "ckpt")
    mp.spawn(_rank_main, args=(2, _free_port(), directory), nprocs=2, join=True)
    root = Path(directory)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == [
        "step-00000002",
        "step-00000003",
        "step-00000004",
    ]

    async def one_rank() -> None:
        async with Checkpointer(directory, keep=3, incremental=True) as ckpt:
            for step in (2, 3, 4):
                out: dict[str, Any] = {
                    "model": {k: torch.zeros_like(v) for k, v in full(step).items()},
                    "step": -1,
                }
                assert await ckpt.restore(out, step=step, fallback=False) == step
                for k, v in full(step).items():
                    assert torch.equal(out["model"][k], v), (step, k)

    anyio.run(one_rank)
    plain: dict[str, Any] = {"model": {k: torch.zeros_like(v) for k, v in full(4).items()}, "step": -1}
    dcp.load(plain, checkpoint_id=str(root / "step-00000004"), no_dist=True)
    assert all(torch.equal(plain["model"][k], v) for k, v in full(4).items()) and plain["step"] == 4
