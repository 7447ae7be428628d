"""One rank of the job test_multirank_crash.py kills: restore, report, save every step.

``python crash_child_dist.py DIR RANK WORLD PORT KILL KILL_RANK`` joins a gloo group
(short timeout, so a rank whose peer died fails instead of hanging), restores from DIR
with ``fallback=False`` (the newest committed checkpoint must verify), prints
``restored STEP OK`` when the restored state is bit-exact with ``state(STEP)`` (the
state is a function of the step alone), then saves ``RUN`` more steps. Rank KILL_RANK
SIGKILLs itself at KILL: ``NAME:K`` is the K-th call, counted after the restore, of one
of the functions patched in ``arm``, so the kill falls in staging (``lease``), writing
(``write_item``: DCP's per-item write), or committing (``fsync``, ``rename``,
``replace``, ``rmtree``; ``gather``/``broadcast``: the commit's collectives).
``none`` runs to the end. WORLD 1 runs without torch.distributed (DCP reshards).
"""

from __future__ import annotations

import asyncio
import datetime
import os
import shutil
import signal
import sys
import warnings
from typing import Any

import torch

#: Steps one run saves past its restored step unless killed first.
RUN = 5
ROWS, COLS = 64, 96


def full(step: int) -> dict[str, torch.Tensor]:
    """The global (unsharded) tensors of the state at ``step``."""
    g = torch.Generator().manual_seed(1000 + step)
    return {
        "w": torch.randn(ROWS, COLS, generator=g),
        "b": torch.randn(COLS, generator=g),
        "e": torch.randn(ROWS, 8, generator=g).to(torch.bfloat16),
    }


_MESH: list[Any] = []


def _mesh(world: int) -> Any:
    if not _MESH:
        from torch.distributed.device_mesh import init_device_mesh

        _MESH.append(init_device_mesh("cpu", (world,)))
    return _MESH[0]


def state(step: int, world: int) -> dict[str, Any]:
    """What one rank saves: "w" and "e" sharded by rows over the ranks, "b" replicated."""
    tensors = full(step)
    if world > 1:
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = _mesh(world)
        tensors = {
            "w": distribute_tensor(tensors["w"], mesh, [Shard(0)]),
            "b": distribute_tensor(tensors["b"], mesh, [Replicate()]),
            "e": distribute_tensor(tensors["e"], mesh, [Shard(0)]),
        }
    return {"model": tensors, "progress": {"step": step}}


def matches(sd: dict[str, Any], step: int) -> bool:
    want = full(step)
    for k, v in sd["model"].items():
        got = v.full_tensor() if hasattr(v, "full_tensor") else v
        if not torch.equal(got, want[k]):
            return False
    return bool(sd["progress"]["step"] == step)


def arm(spec: str, rank: int, kill_rank: int) -> None:
    if spec == "none" or rank != kill_rank:
        return
    name, _, k = spec.partition(":")
    left = [int(k)]

    import torch.distributed.checkpoint.filesystem as fs

    import async_stager
    from async_stager._checkpoint import ranks as _ckptdist

    targets: dict[str, tuple[Any, str]] = {
        "lease": (async_stager.Stager, "lease"),
        "write_item": (fs, "_write_item"),
        "fsync": (os, "fsync"),
        "rename": (os, "rename"),
        "replace": (os, "replace"),
        "rmtree": (shutil, "rmtree"),
        "gather": (_ckptdist.Ranks, "gather"),
        "broadcast": (_ckptdist.Ranks, "broadcast"),
    }
    owner, attr = targets[name]
    orig = getattr(owner, attr)

    def patched(*args: Any, **kwargs: Any) -> Any:
        left[0] -= 1
        if left[0] == 0:
            print(f"killing rank {rank} at {spec}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return orig(*args, **kwargs)

    setattr(owner, attr, patched)


async def main(directory: str, rank: int, world: int, spec: str, kill_rank: int) -> None:
    from async_stager import Checkpointer

    async with Checkpointer(directory, keep=2, checksum_threads=1) as ckpt:
        sd = state(0, world)
        for v in sd["model"].values():
            (v.to_local() if hasattr(v, "to_local") else v).zero_()
        restored = await ckpt.restore(sd, fallback=False)
        step = 0 if restored is None else int(restored)
        ok = "OK" if restored is None or matches(sd, step) else "MISMATCH"
        print(f"restored {restored} {ok}", flush=True)
        arm(spec, rank, kill_rank)
        for s in range(step + 1, step + 1 + RUN):
            await ckpt.save(state(s, world), step=s)
            await ckpt.fence()
    print("done", flush=True)


if __name__ == "__main__":
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    directory, rank, world, port, spec, kill_rank = sys.argv[1:7]
    torch.set_num_threads(1)
    if int(world) > 1:
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        dist.init_process_group(
            "gloo", rank=int(rank), world_size=int(world), timeout=datetime.timedelta(seconds=20)
        )
    asyncio.run(main(directory, int(rank), int(world), spec, int(kill_rank)))
    if int(world) > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
