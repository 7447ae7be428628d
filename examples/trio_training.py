"""The asyncio training example under trio: checkpoints overlap training.

Every ``--every`` steps the loop calls ``stager.lease(state)`` (the snapshot point)
and hands the awaitable to a task in a nursery that finishes the stage and writes the
result with ``trio.to_thread.run_sync``; at most one checkpoint is in flight. Before
``optimizer.step()`` the loop awaits ``stager.fence()``. The last step is always
saved; on leaving the nursery, that checkpoint is finished before the stager closes.

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

from async_stager import Lease, Stager


def write_atomically(staged: dict[str, Any], path: Path) -> None:
    """Worker thread: torch.save to a temporary name, fsync, then rename into place."""
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        torch.save(staged, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))
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
                state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step}
                nursery.start_soon(checkpoint, stager.lease(state), out / f"step{step}.pt")
                saves += 1
            await trio.lowlevel.checkpoint()  # let the checkpoint task run
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
