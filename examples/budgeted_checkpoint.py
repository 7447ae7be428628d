"""Checkpoints bigger than the host memory you can spare: a budgeted Checkpointer.

The model's state (``--width``-wide layers with AdamW: about ``12 * width**2 * layers``
bytes) is saved every ``--every`` steps through ``Checkpointer(host_budget_bytes=N)``:
each save stages and writes in pieces through a ring of at most N bytes of host memory
instead of a full host copy. ``await ckpt.save(...)`` returns once the last piece is
copied (the sources may change after it), and the write goes on in the background.
At the end the newest checkpoint is restored (``Checkpointer.restore``, which verifies it
against the checksums taken as each piece landed) into a fresh model and a fresh AdamW
with no state, and their whole state (parameters, buffers, ``exp_avg``, ``exp_avg_sq``
and ``step``, ``param_groups``) and the step counter are compared bit for bit with the
trained ones.

Run: ``python examples/budgeted_checkpoint.py --out /tmp/ckpt --budget-mib 8``
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

import torch
from torch import nn

from async_stager import Checkpointer, state_differences


def make(width: int, layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def optimizer_keys(optimizer: torch.optim.Optimizer) -> str:
    """The names in an optimizer's per-parameter state (AdamW: exp_avg, exp_avg_sq, step)."""
    return ", ".join(sorted({k for s in optimizer.state_dict()["state"].values() for k in s}))


def whole_state(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}


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
                await ckpt.save({"model": model, "optim": opt, "step": step}, step=step)
        await ckpt.wait()
        stats = ckpt.last
        assert stats is not None and stats.budget is not None
        print(
            f"step {stats.step}: {stats.bytes / 2**20:.1f} MiB written through a ring of "
            f"{budget / 2**20:.0f} MiB (peak {stats.budget.peak_bytes / 2**20:.1f} MiB), "
            f"save blocked {stats.stage_seconds * 1e3:.0f} ms"
        )
    fresh, fresh_opt = make(args.width, args.layers)  # an AdamW with no state: restore gives it all
    state: dict[str, Any] = {"model": fresh, "optim": fresh_opt, "step": 0}
    async with Checkpointer(args.out) as ckpt:
        restored = await ckpt.restore(state)
    bad = state_differences(whole_state(model, opt, args.steps), whole_state(fresh, fresh_opt, state["step"]))
    if restored != args.steps or bad:
        raise SystemExit(f"restored step {restored} differs from the trained state: {', '.join(bad[:8])}")
    print(
        f"restored step {restored}: model, optimizer ({optimizer_keys(opt)}, param_groups)"
        " and step counter bit-exact"
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--budget-mib", type=int, default=8)
    asyncio.run(main(p.parse_args()))
