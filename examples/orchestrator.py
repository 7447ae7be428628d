"""An asyncio orchestration service: train, checkpoint periodically, and on SIGTERM
take a final checkpoint within a deadline and exit cleanly.

The Checkpointer does the checkpointing: ``save`` returns once the state is staged, the
write (``torch.save`` to a temporary folder, fsync, atomic rename, ``latest``, keep the
newest 3) runs in the background, and with ``policy="skip"`` a tick that comes while a
write is still in flight is skipped. ``Shutdown`` turns SIGTERM/SIGINT into a flag the
trainer checks at step boundaries and writes the final checkpoint within ``--deadline``
seconds (a preemption notice's grace period, minus a margin): exit status 0 when it is
committed, 1 when the deadline passed.

Run: ``python examples/orchestrator.py --out /tmp/ckpt`` and stop it with Ctrl-C or
``kill -TERM <pid>``. A restart resumes from the newest committed step.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from async_stager import Checkpointer, SaveStats, Shutdown


async def serve(out: Path, interval: float, width: int, deadline: float) -> int:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, width), torch.randn(32, 1)
    state: dict[str, Any] = {"model": model, "optim": optimizer, "step": 0}

    def saved(stats: SaveStats) -> None:
        print(f"saved step {stats.step} {stats.path}", flush=True)

    async with (
        Checkpointer(out, format="torch", policy="skip", on_saved=saved) as ckpt,
        Shutdown() as stop,
    ):
        step = await ckpt.restore(state) or 0
        print(f"ready pid {os.getpid()} at step {step}", flush=True)
        next_save = time.monotonic() + interval
        while not stop.requested:
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            await ckpt.fence()  # a save in flight has read the parameters
            optimizer.step()
            step += 1
            state["step"] = step
            if time.monotonic() >= next_save:
                await ckpt.save(state, step=step)  # skipped while the last one is writing
                next_save = time.monotonic() + interval
            await asyncio.sleep(0)  # a step boundary: the signal is seen here
        code = await stop.final_checkpoint(ckpt, state, step=step, deadline=deadline)
        if code == 0:
            print(f"final step {step} in {stop.seconds:.3f} s", flush=True)
        else:
            print(f"final checkpoint missed the {deadline:.1f} s deadline", file=sys.stderr, flush=True)
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
