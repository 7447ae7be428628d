"""An asyncio training loop that checkpoints while it trains.

Every ``--every`` steps the loop starts ``stager.stage(state)`` as a task and keeps
training: forward and backward only read the parameters, so they overlap with the
copies. Before ``optimizer.step()`` (which writes parameters and optimizer state in
place) it awaits ``stager.fence()``, so the snapshot holds the values as of the call.
The stage is a lease (``stager.lease``): the checkpoint task receives it, writes the
staged copy to disk in a worker thread and releases it, so no later stage overwrites a
checkpoint being written, and the next stage reuses the buffers once it is released. At
most one write is in flight (a checkpoint due while one is in flight is skipped, except
at the last step, which is always saved). At the end the last checkpoint is read back
with ``torch.load`` into a fresh model and optimizer, and their whole state (parameters,
buffers, AdamW's ``exp_avg``, ``exp_avg_sq`` and ``step``, ``param_groups``) and the step
counter are compared bit for bit with the trained ones.

Run: ``python examples/asyncio_training.py --steps 200 --every 50 --out /tmp/ckpt``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from async_stager import Lease, Stager, state_differences


def make_model(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))


def state_of(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step}


def write_atomically(staged: dict[str, Any], path: Path) -> None:
    """Worker thread: torch.save to a temporary name, fsync, then rename into place."""
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        torch.save(staged, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def optimizer_keys(optimizer: torch.optim.Optimizer) -> str:
    """The names in an optimizer's per-parameter state (AdamW: exp_avg, exp_avg_sq, step)."""
    return ", ".join(sorted({k for s in optimizer.state_dict()["state"].values() for k in s}))


def verify_last(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, step: int, width: int) -> str:
    """Load the checkpoint at ``path`` into a fresh model and optimizer and compare
    their whole state with the trained ones; SystemExit naming what differs."""
    back = torch.load(path, weights_only=True)
    fresh = make_model(width)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)  # no state yet: load gives it all
    fresh.load_state_dict(back["model"])
    fresh_opt.load_state_dict(back["optim"])
    bad = state_differences(state_of(model, optimizer, step), state_of(fresh, fresh_opt, back["step"]))
    if bad:
        raise SystemExit(f"{path} does not restore the trained state: {', '.join(bad[:8])}")
    return (
        f"restored step {back['step']}: model, optimizer ({optimizer_keys(optimizer)}, param_groups)"
        " and step counter bit-exact"
    )


async def checkpoint(staging: Awaitable[Lease[dict[str, Any]]], path: Path) -> None:
    """Finish a stage (overlapping training), then write it in a thread; the lease is
    released once the file is durable, and no stage writes into its buffers before."""
    lease = await staging
    async with lease as staged:
        await asyncio.to_thread(write_atomically, staged, path)


async def train(steps: int, every: int, width: int, out: Path) -> int:
    torch.manual_seed(0)
    model = make_model(width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, width), torch.randn(64, 1)
    out.mkdir(parents=True, exist_ok=True)
    saves = 0
    pending: asyncio.Task[None] | None = None
    async with Stager() as stager:
        for step in range(1, steps + 1):
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            # The stage started at an earlier step must have read the parameters
            # before the optimizer writes them.
            await stager.fence()
            optimizer.step()
            last = step == steps
            if (step % every == 0 or last) and (pending is None or pending.done() or last):
                if pending is not None:
                    await pending  # re-raise its error, if any (the last step waits for it)
                # The snapshot point is this call (after step(): it holds this step);
                # the task only finishes it and writes.
                staging = stager.lease(state_of(model, optimizer, step))
                pending = asyncio.create_task(checkpoint(staging, out / f"step{step}.pt"))
                saves += 1
        if pending is not None:
            await pending
    print(await asyncio.to_thread(verify_last, out / f"step{steps}.pt", model, optimizer, steps, width))
    return saves


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--out", type=Path, default=Path("checkpoints"))
    args = p.parse_args()
    t0 = time.perf_counter()
    saves = asyncio.run(train(args.steps, args.every, args.width, args.out))
    print(f"trained {args.steps} steps, {saves} checkpoints in {time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    main()
