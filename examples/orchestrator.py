"""An asyncio orchestration service: train, checkpoint periodically, and on SIGTERM
take a final checkpoint within a deadline and exit cleanly.

Standard library only, besides torch and async_stager. The pieces:

- the trainer task runs steps and yields to the loop between them (``await
  asyncio.sleep(0)``), so every other task sees the model at a step boundary; it awaits
  ``stager.fence()`` before ``optimizer.step()`` so a stage in flight has read the
  parameters before they change;
- the saver task starts a checkpoint every ``--interval`` seconds, at most one in
  flight: if the previous one is still being written, that tick is skipped;
- a checkpoint is ``stager.lease(state)`` (the snapshot point is the call), handed to a
  task that finishes it, then ``torch.save`` in a worker thread to a temporary name, fsync, rename: a reader never
  sees a torn file;
- SIGTERM (or SIGINT) sets an event; the service stops the trainer at a step boundary,
  stops the saver, waits for the checkpoint in flight, and writes ``final.pt`` within
  ``--deadline`` seconds (a preemption notice's grace period, minus a margin). It exits
  0 when the final checkpoint is on disk, 1 when the deadline passed.

Run: ``python examples/orchestrator.py --out /tmp/ckpt`` and stop it with Ctrl-C or
``kill -TERM <pid>``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from async_stager import Stager


def write_atomically(staged: dict[str, Any], path: Path) -> None:
    """Worker thread: write to a temporary name, fsync, rename into place, fsync the
    directory (the rename itself is then durable)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(staged, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


class Service:
    def __init__(self, out: Path, interval: float, width: int, max_steps: int) -> None:
        torch.manual_seed(0)
        self.out = out
        self.interval = interval
        self.max_steps = max_steps
        self.model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.x, self.y = torch.randn(32, width), torch.randn(32, 1)
        self.step = 0
        self.stop = asyncio.Event()
        self.in_flight: asyncio.Task[None] | None = None

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict(), "step": self.step}

    async def trainer(self, stager: Stager) -> None:
        while not self.stop.is_set() and self.step < self.max_steps:
            loss = nn.functional.mse_loss(self.model(self.x), self.y)
            self.optimizer.zero_grad()
            loss.backward()
            await stager.fence()
            self.optimizer.step()
            self.step += 1
            await asyncio.sleep(0)  # a step boundary: other tasks run here

    def checkpoint(self, stager: Stager, name: str) -> asyncio.Task[None]:
        """Start a checkpoint: the snapshot point is this call (a step boundary); the
        returned task finishes the stage and writes it."""
        step = self.step
        staging = stager.lease(self.state())
        path = self.out / name

        async def finish() -> None:
            # The lease keeps later stages out of these buffers until the file is durable.
            async with await staging as staged:
                await asyncio.to_thread(write_atomically, staged, path)
            print(f"saved step {step} {path}", flush=True)

        return asyncio.create_task(finish())

    async def saver(self, stager: Stager) -> None:
        while True:
            await asyncio.sleep(self.interval)
            if self.in_flight is not None and not self.in_flight.done():
                continue  # at most one save in flight: skip this tick
            if self.in_flight is not None:
                self.in_flight.result()  # surface a failed save
            self.in_flight = self.checkpoint(stager, f"step{self.step}.pt")

    async def run(self, deadline: float) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop.set)
        self.out.mkdir(parents=True, exist_ok=True)
        async with Stager() as stager:
            await stager.reserve(self.state())  # host buffers now, not at the first save
            trainer = asyncio.create_task(self.trainer(stager))
            saver = asyncio.create_task(self.saver(stager))
            print(f"ready pid {os.getpid()}", flush=True)
            await asyncio.wait(
                [trainer, asyncio.create_task(self.stop.wait())], return_when="FIRST_COMPLETED"
            )
            self.stop.set()
            t0 = time.monotonic()
            saver.cancel()
            await asyncio.gather(trainer, saver, return_exceptions=True)
            trainer.result()  # a trainer error is a crash, not a clean exit

            async def final() -> None:
                if self.in_flight is not None:
                    await self.in_flight  # the final checkpoint comes after it
                await self.checkpoint(stager, "final.pt")

            try:
                await asyncio.wait_for(final(), timeout=deadline)
            except asyncio.TimeoutError:
                print(f"final checkpoint missed the {deadline:.1f} s deadline", file=sys.stderr, flush=True)
                return 1
            print(f"final step {self.step} in {time.monotonic() - t0:.3f} s", flush=True)
        return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("checkpoints"))
    p.add_argument("--interval", type=float, default=1.0, help="seconds between checkpoints")
    p.add_argument("--deadline", type=float, default=25.0, help="seconds for the final checkpoint")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--max-steps", type=int, default=10**9)
    args = p.parse_args()
    service = Service(args.out, args.interval, args.width, args.max_steps)
    sys.exit(asyncio.run(service.run(args.deadline)))


if __name__ == "__main__":
    main()
