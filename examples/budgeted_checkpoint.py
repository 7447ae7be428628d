"""Checkpoints bigger than the host memory you can spare: a budgeted Checkpointer.

The model's state (``--width``-wide layers with AdamW: about ``12 * width**2 * layers``
bytes) is saved every ``--every`` steps through ``Checkpointer(host_budget_bytes=N)``:
each save stages and writes in pieces through a ring of at most N bytes of host memory
instead of a full host copy. ``await ckpt.save(...)`` returns once the last piece is
copied (the sources may change after it), and the write goes on in the background.
At the end the newest checkpoint is restored into a fresh model, verified against the
checksums taken as each piece landed, and compared with the trained one.

Run: ``python examples/budgeted_checkpoint.py --out /tmp/ckpt --budget-mib 8``
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import torch
from torch import nn

from async_stager import Checkpointer


def make(width: int, layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


async def main(args: argparse.Namespace) -> None:
    model, opt = make(args.width, args.layers)
    x = torch.randn(16, args.width)
    budget = args.budget_mib << 20
    async with Checkpointer(args.out, keep=2, host_budget_bytes=budget) as ckpt:
        for step in range(1, args.steps + 1):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if step % args.every == 0 or step == args.steps:
                await ckpt.save({"model": model, "optim": opt}, step=step)
        await ckpt.wait()
        stats = ckpt.last
        assert stats is not None and stats.budget is not None
        print(
            f"step {stats.step}: {stats.bytes / 2**20:.1f} MiB written through a ring of "
            f"{budget / 2**20:.0f} MiB (peak {stats.budget.peak_bytes / 2**20:.1f} MiB), "
            f"save blocked {stats.stage_seconds * 1e3:.0f} ms"
        )
    fresh, fresh_opt = make(args.width, args.layers)
    async with Checkpointer(args.out) as ckpt:
        step = await ckpt.restore({"model": fresh, "optim": fresh_opt})
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    print(f"restored step {step}: {'bit-exact' if same else 'DIFFERENT'}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--budget-mib", type=int, default=8)
    asyncio.run(main(p.parse_args()))
