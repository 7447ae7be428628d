"""An asyncio orchestration service: train, checkpoint periodically, and on SIGTERM
take a final checkpoint within a deadline and exit cleanly.

A timer task asks for a checkpoint every ``--interval`` seconds with
``Checkpointer.request_save()`` (as a request handler of a real service would); the
training loop takes the request at its step boundary with ``save_if_requested``.
The Checkpointer does the checkpointing: ``save`` returns once the state is staged, the
write (``torch.save`` to a temporary folder, fsync, atomic rename, ``latest``, keep the
newest 3) runs in the background, and with ``policy="skip"`` a tick that comes while a
write is still in flight is skipped. ``Shutdown`` turns SIGTERM/SIGINT into a flag the
trainer checks at step boundaries and writes the final checkpoint within ``--deadline``
seconds (a preemption notice's grace period, minus a margin): exit status 0 when it is
committed, 1 when the deadline passed.

The state is the model, an AdamW optimizer, its LR scheduler and the step counter; a
restart resumes all of them from the newest committed step. After the final checkpoint
is committed, the service restores it (``Checkpointer.restore``) into a fresh model,
optimizer and scheduler and compares their whole state (parameters, buffers, AdamW's
``exp_avg``, ``exp_avg_sq`` and ``step``, ``param_groups``, the scheduler's state) and
the step counter bit for bit with the trained ones (a difference: a message naming it,
and exit status 1).

Run: ``python examples/orchestrator.py --out /tmp/ckpt`` and stop it with Ctrl-C or
``kill -TERM <pid>``. A restart resumes from the newest committed step.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from async_stager import Checkpointer, SaveStats, Shutdown, state_differences


def optimizer_keys(optimizer: torch.optim.Optimizer) -> str:
    """The names in an optimizer's per-parameter state (AdamW: exp_avg, exp_avg_sq, step)."""
    return ", ".join(sorted({k for s in optimizer.state_dict()["state"].values() for k in s}))


def make(width: int) -> dict[str, Any]:
    """The state to checkpoint: Statefuls (restored in place) and the step counter."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.999)
    return {"model": model, "optim": optimizer, "sched": scheduler, "step": 0}


def whole_state(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in state.items()}


async def verify_restore(out: Path, state: dict[str, Any], width: int) -> str:
    """Restore the newest committed checkpoint into fresh objects (an optimizer with no
    state) and compare their whole state with ``state``'s; SystemExit naming what differs."""
    fresh = make(width)
    async with Checkpointer(out, format="torch") as ckpt:
        step = await ckpt.restore(fresh)
    bad = state_differences(whole_state(state), whole_state(fresh))
    if step != state["step"] or bad:
        raise SystemExit(f"restored step {step} differs from the trained state: {', '.join(bad[:8])}")
    return (
        f"restored step {step}: model, optimizer ({optimizer_keys(state['optim'])}, param_groups),"
        " LR scheduler and step counter bit-exact"
    )


async def serve(out: Path, interval: float, width: int, deadline: float) -> int:
    state = make(width)
    model, optimizer, scheduler = state["model"], state["optim"], state["sched"]
    x, y = torch.randn(32, width), torch.randn(32, 1)

    def saved(stats: SaveStats) -> None:
        print(f"saved step {stats.step} {stats.path}", flush=True)

    async with (
        Checkpointer(out, format="torch", policy="skip", on_saved=saved) as ckpt,
        Shutdown() as stop,
    ):
        step = await ckpt.restore(state) or 0
        print(f"ready pid {os.getpid()} at step {step}", flush=True)

        async def every_interval() -> None:
            # The service side (here a timer; a request handler works the same): it
            # asks for a save and never touches the training state.
            while True:
                await asyncio.sleep(interval)
                ckpt.request_save()

        timer = asyncio.create_task(every_interval())

        def forward_backward() -> None:
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()

        def update() -> None:
            optimizer.step()
            scheduler.step()

        while not stop.requested:
            # The step's compute runs in a worker thread: on the loop's thread it would
            # hold the loop for the whole step, and no request handler, timer or signal
            # would be served until it ended. The loop keeps only the step boundary.
            await asyncio.to_thread(forward_backward)
            # A save in flight has read the parameters before they change.
            await ckpt.fence()
            await asyncio.to_thread(update)
            step += 1
            state["step"] = step
            # The step boundary: a requested save is taken here (skipped while the last
            # one is writing).
            await ckpt.save_if_requested(state, step=step)
        timer.cancel()
        code = await stop.final_checkpoint(ckpt, state, step=step, deadline=deadline)
        if code == 0:
            print(f"final step {step} in {stop.seconds:.3f} s", flush=True)
        else:
            print(f"final checkpoint missed the {deadline:.1f} s deadline", file=sys.stderr, flush=True)
    if code == 0:
        print(await verify_restore(out, state, width), flush=True)
    return code


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("checkpoints"))
    p.add_argument("--interval", type=float, default=1.0, help="seconds between checkpoints")
    p.add_argument("--deadline", type=float, default=25.0, help="seconds for the final checkpoint")
    p.add_argument("--width", type=int, default=64)
    args = p.parse_args()
    sys.exit(asyncio.run(serve(args.out, args.interval, args.width, args.deadline)))


if __name__ == "__main__":
    main()
