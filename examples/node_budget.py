"""One host-memory budget for the whole node: the ranks of a machine share it.

Each rank of a torchrun job holds a shard of a model (DTensors sharded on dim 0, with
Adam-style moments) and saves it every ``--every`` steps through
``Checkpointer(node_budget_bytes=N)``: every rank on this machine reserves the host
memory its save needs from one node ledger (a few files under ``/dev/shm``, found by
torchrun's run id: no server, no extra process), so that the ranks' checkpoints
together never take more than N bytes of host memory, however many ranks save at
once. A save whose staged copy fits what the node can give stages; one that does not
streams within a share of the budget. ``SaveStats`` says which path each save took
and how long it waited for the node.

At the end every rank restores the newest checkpoint into fresh zeros and compares
its whole shard bit for bit with the trained one.

Run (CPU, gloo): ``torchrun --nproc-per-node 4 examples/node_budget.py --out /tmp/ckpt
--node-budget-mib 64``
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from async_stager import Checkpointer

MiB = 1 << 20


def say(text: str) -> None:
    """One line to stdout in one write: the ranks share the pipe, and print() writes the
    text and its newline separately, so two ranks' lines could run together."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def make_state(width: int, layers: int, mesh: Any, *, zeros: bool = False) -> dict[str, Any]:
    """A sharded "model": per layer a weight and its two moments (DTensors), and the
    step counter. The same seed on every rank: each keeps its own shard."""
    g = torch.Generator().manual_seed(0)
    model: dict[str, Any] = {}
    for i in range(layers):
        for name in ("weight", "exp_avg", "exp_avg_sq"):
            full = torch.zeros(width, width) if zeros else torch.randn(width, width, generator=g)
            model[f"layer{i}.{name}"] = distribute_tensor(full, mesh, [Shard(0)])
    return {"model": model, "step": 0}


def train_step(state: dict[str, Any]) -> None:
    for name, t in state["model"].items():
        local = t.to_local()
        local.mul_(0.999).add_(0.001 if name.endswith("weight") else 0.01)
    state["step"] += 1


def same(expected: dict[str, Any], actual: dict[str, Any]) -> bool:
    if expected["step"] != actual["step"]:
        return False
    for name, t in expected["model"].items():
        a = actual["model"][name]
        assert isinstance(a, DTensor)
        if not torch.equal(t.to_local(), a.to_local()):
            return False
    return True


async def main(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    state = make_state(args.width, args.layers, mesh)
    budget = args.node_budget_mib * MiB
    shard = sum(t.to_local().nbytes for t in state["model"].values())
    if rank == 0:
        print(
            f"{world} ranks, {shard / MiB:.1f} MiB of state each, one node budget of "
            f"{args.node_budget_mib} MiB for all of them"
        )
    async with Checkpointer(args.out, node_budget_bytes=budget, keep=2) as ckpt:
        for _ in range(args.steps):
            train_step(state)
            if state["step"] % args.every == 0:
                await ckpt.save(state, step=state["step"])
                await ckpt.wait()
                st = ckpt.last
                assert st is not None
                say(
                    f"rank {rank}: step {st.step} {st.admission}, waited {st.node_wait_seconds:.3f} s "
                    f"for the node budget, wrote {st.bytes / MiB:.1f} MiB"
                )
    fresh = make_state(args.width, args.layers, mesh, zeros=True)
    async with Checkpointer(args.out) as ckpt:
        step = await ckpt.restore(fresh)
    if step != state["step"] or not same(state, fresh):
        raise SystemExit(f"rank {rank}: the restored state differs from the trained one")
    say(f"rank {rank}: restored step {step} bit-exact")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--node-budget-mib", type=int, default=64)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--every", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        asyncio.run(main(args))
        dist.barrier()
    finally:
        dist.destroy_process_group()
