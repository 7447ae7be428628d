"""Checkpoint writes in a separate writer process, with no copy in the trainer.

The trainer stages into shared memory (``Stager(share_memory=True)``: memfd arenas,
one descriptor per arena), holds the result with ``stager.snapshot()``, and sends a
``SharedHandle`` (``export_shared``: plain data, a few bytes per tensor) to the writer.
The writer maps the arenas (``attach_shared``: one mmap per arena), writes the tensors
with ``torch.save`` and replies; only then does the trainer release the lease. Later
stages go to another buffer set meanwhile, so training never waits for the disk and
the writer never sees a torn checkpoint. At the end the last checkpoint is read back
with ``torch.load`` into a fresh model and optimizer, and their whole state (parameters,
buffers, AdamW's ``exp_avg``, ``exp_avg_sq`` and ``step``, ``param_groups``) and the step
counter are compared bit for bit with the trained ones.

Run: ``python examples/writer_process.py --steps 3 --out /tmp/ckpt``
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from async_stager import SharedHandle, Stager, attach_shared, export_shared, state_differences


def make_model(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, width), nn.Linear(width, width))


def state_of(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step}


def optimizer_keys(optimizer: torch.optim.Optimizer) -> str:
    """The names in an optimizer's per-parameter state (AdamW: exp_avg, exp_avg_sq, step)."""
    return ", ".join(sorted({k for s in optimizer.state_dict()["state"].values() for k in s}))


def verify_last(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, step: int, width: int) -> str:
    """Load the checkpoint at ``path`` into a fresh model and optimizer and compare
    their whole state with the trained ones; SystemExit naming what differs."""
    back = torch.load(path, weights_only=True)
    fresh = make_model(width)
    fresh_opt = torch.optim.AdamW(fresh.parameters())  # no state yet: load gives it all
    fresh.load_state_dict(back["model"])
    fresh_opt.load_state_dict(back["optim"])
    bad = state_differences(state_of(model, optimizer, step), state_of(fresh, fresh_opt, back["step"]))
    if bad:
        raise SystemExit(f"{path} does not restore the trained state: {', '.join(bad[:8])}")
    return (
        f"restored step {back['step']}: model, optimizer ({optimizer_keys(optimizer)}, param_groups)"
        " and step counter bit-exact"
    )


def writer_main(inbox: Any, outbox: Any) -> None:
    """The writer process: attach each handle, write it, say done."""
    while True:
        msg = inbox.get()
        if msg is None:
            return
        handle, path = msg
        assert isinstance(handle, SharedHandle)
        with attach_shared(handle) as attached:
            tmp = Path(path + ".tmp")
            with open(tmp, "wb") as f:
                torch.save(attached.state_dict, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        outbox.put(path)


async def train(steps: int, width: int, out: Path) -> None:
    ctx = mp.get_context("spawn")  # never fork a process that holds CUDA or threads
    inbox, outbox = ctx.Queue(), ctx.Queue()
    writer = ctx.Process(target=writer_main, args=(inbox, outbox), daemon=True)
    writer.start()
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = make_model(width)
    optimizer = torch.optim.AdamW(model.parameters())
    try:
        async with Stager(share_memory=True) as stager:
            for step in range(1, steps + 1):
                model(torch.randn(8, width)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
                async with stager.snapshot(state_of(model, optimizer, step)) as staged:
                    handle = export_shared(staged, stager)
                    inbox.put((handle, str(out / f"step{step}.pt")))
                    # Training could go on here; this example just waits for the writer.
                    path = await asyncio.to_thread(outbox.get, True, 60)
                # The lease is released: the next stage may reuse these buffers.
                print(f"step {step}: {handle.tensors} tensors, {handle.nbytes} bytes -> {path}")
    finally:
        inbox.put(None)
        await asyncio.to_thread(writer.join, 30)
    print(await asyncio.to_thread(verify_last, out / f"step{steps}.pt", model, optimizer, steps, width))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--out", type=Path, default=Path("checkpoints"))
    args = p.parse_args()
    asyncio.run(train(args.steps, args.width, args.out))


if __name__ == "__main__":
    main()
