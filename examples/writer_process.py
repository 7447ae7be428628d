"""Checkpoint writes in a separate writer process, with no copy in the trainer.

The trainer stages into shared memory (``Stager(share_memory=True)``: memfd arenas,
one descriptor per arena), holds the result with ``stager.snapshot()``, and sends a
``SharedHandle`` (``export_shared``: plain data, a few bytes per tensor) to the writer.
The writer maps the arenas (``attach_shared``: one mmap per arena), writes the tensors
with ``torch.save`` and replies; only then does the trainer release the lease. Later
stages go to another buffer set meanwhile, so training never waits for the disk and
the writer never sees a torn checkpoint.

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

from async_stager import SharedHandle, Stager, attach_shared, export_shared


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
    model = nn.Sequential(nn.Linear(width, width), nn.Linear(width, width))
    optimizer = torch.optim.AdamW(model.parameters())
    try:
        async with Stager(share_memory=True) as stager:
            for step in range(1, steps + 1):
                model(torch.randn(8, width)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
                sd = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step}
                async with stager.snapshot(sd) as staged:
                    handle = export_shared(staged, stager)
                    inbox.put((handle, str(out / f"step{step}.pt")))
                    # Training could go on here; this example just waits for the writer.
                    path = await asyncio.to_thread(outbox.get, True, 60)
                # The lease is released: the next stage may reuse these buffers.
                print(f"step {step}: {handle.tensors} tensors, {handle.nbytes} bytes -> {path}")
    finally:
        inbox.put(None)
        await asyncio.to_thread(writer.join, 30)
    back = torch.load(out / f"step{steps}.pt")
    assert all(torch.equal(a, b) for a, b in zip(back["model"].values(), model.state_dict().values()))
    print("last checkpoint read back: bit-exact")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--out", type=Path, default=Path("checkpoints"))
    args = p.parse_args()
    asyncio.run(train(args.steps, args.width, args.out))


if __name__ == "__main__":
    main()
