"""The asyncio training example under trio: checkpoints overlap training.

Every ``--every`` steps the loop calls ``stager.lease(state)`` (the snapshot point)
and hands the awaitable to a task in a nursery that finishes the stage and writes the
result with ``trio.to_thread.run_sync``; at most one checkpoint is in flight. Before
``optimizer.step()`` the loop awaits ``stager.fence()``. The last step is always
saved; on leaving the nursery, that checkpoint is finished before the stager closes.
At the end the last checkpoint is read back with ``torch.load`` into a fresh model and
optimizer, and their whole state (parameters, buffers, AdamW's ``exp_avg``,
``exp_avg_sq`` and ``step``, ``param_groups``) and the step counter are compared bit for
bit with the trained ones.

Run: ``python examples/trio_training.py --steps 200 --every 50 --out /tmp/ckpt``
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import torch
import trio
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


async def take_slot(slot: trio.Semaphore, *, wait: bool) -> bool:
    """Take the checkpoint slot; without ``wait``, False if a checkpoint is in flight
    (that checkpoint is skipped)."""
    if wait:
        await slot.acquire()
        return True
    try:
        slot.acquire_nowait()
    except trio.WouldBlock:
        return False
    return True


async def train(steps: int, every: int, width: int, out: Path) -> int:
    torch.manual_seed(0)
    model = make_model(width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, width), torch.randn(64, 1)
    out.mkdir(parents=True, exist_ok=True)
    saves = 0
    in_flight = trio.Semaphore(1)  # at most one checkpoint at a time

    async def checkpoint(staging: Awaitable[Lease[dict[str, Any]]], path: Path) -> None:
        # The lease keeps later stages out of these buffers until the file is written.
        try:
            async with await staging as staged:
                await trio.to_thread.run_sync(write_atomically, staged, path)
        finally:
            in_flight.release()

    async with Stager() as stager, trio.open_nursery() as nursery:
        for step in range(1, steps + 1):
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            await stager.fence()  # the stage in flight has read the parameters
            optimizer.step()
            due = step % every == 0 or step == steps
            if due and await take_slot(in_flight, wait=step == steps):  # the last step waits
                staging = stager.lease(state_of(model, optimizer, step))
                nursery.start_soon(checkpoint, staging, out / f"step{step}.pt")
                saves += 1
            await trio.lowlevel.checkpoint()  # let the checkpoint task run
    print(await trio.to_thread.run_sync(verify_last, out / f"step{steps}.pt", model, optimizer, steps, width))
    return saves


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--out", type=Path, default=Path("checkpoints"))
    args = p.parse_args()
    t0 = time.perf_counter()
    saves = trio.run(train, args.steps, args.every, args.width, args.out)
    print(f"trained {args.steps} steps, {saves} checkpoints in {time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    main()
