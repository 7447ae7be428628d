"""A rank dies mid-run; torchrun restarts the job; it resumes from memory, losing nothing.

``python examples/memory_tier.py --out /tmp/ckpt`` starts the node agent
(``python -m async_stager agent --job JOB``), then ``torchrun --nproc-per-node 2
--max-restarts 1`` on this file. Each rank trains a small model with AdamW (gradients
all-reduced over gloo, as DDP would) and saves through
``Checkpointer(out, agent=JOB, memory_every=1, persist_every=5)``: a snapshot handed to
the agent every step (it costs the stage only) and a checkpoint on disk every 5th.
At step ``--kill-at`` rank 1 SIGKILLs itself. torchrun restarts both ranks; each
restores from the agent's memory (``ckpt.memory.restored``) and trains on.

The agent never outlives this launcher: it is stopped on the way out, also when the
launcher is stopped by SIGTERM (as a scheduler stops a job), and it is started with
``--parent`` (this process's id), so it exits by itself if the launcher is killed.

At the end each rank checks two things bit for bit: the resumed run's final state
against a run of the same steps that was never interrupted, and a restore of the final
checkpoint into fresh objects against the trained state.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import uuid
from typing import Any

import torch
import torch.distributed as dist

from async_stager import Checkpointer

WIDTH = 64


def say(text: str) -> None:
    """One line to stdout in one write: the ranks share the pipe, and print() writes the
    text and its newline separately, so two ranks' lines could run together."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def make(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return {"model": model, "optim": optim, "step": {"n": 0}}


def train_step(state: dict[str, Any], rank: int) -> None:
    step = state["step"]["n"] + 1
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, WIDTH, generator=g)
    loss = state["model"](x).pow(2).mean()
    state["optim"].zero_grad()
    loss.backward()
    for p in state["model"].parameters():
        assert p.grad is not None
        dist.all_reduce(p.grad)  # the ranks stay in step, as under DDP
        p.grad.div_(dist.get_world_size())
    state["optim"].step()
    state["step"]["n"] = step


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a["step"] != b["step"]:
        return False
    for x, y in zip(a["model"].state_dict().values(), b["model"].state_dict().values()):
        if not torch.equal(x, y):
            return False
    sa, sb = a["optim"].state_dict(), b["optim"].state_dict()
    if sa["param_groups"] != sb["param_groups"]:
        return False
    for k, v in sa["state"].items():
        for name, t in v.items():
            if not torch.equal(t, sb["state"][k][name]):
                return False
    return True


async def rank_main(out: str, job: str, steps: int, kill_at: int) -> None:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # Keys of this attempt only: the launcher's store keeps the first attempt's (the
    # dead ranks' addresses), which a restarted gloo group would try to connect to.
    store, rank, world = next(dist.rendezvous("env://"))
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(f"attempt{attempt}", store), rank=rank, world_size=world
    )
    state = make()
    async with Checkpointer(out, agent=job, memory_every=1, persist_every=5) as ckpt:
        resumed = await ckpt.restore(state)
        stats = ckpt.memory
        assert stats is not None
        where = "memory" if resumed is not None and stats.restored == resumed else "disk"
        if resumed is not None:
            say(f"rank {rank} attempt {attempt}: resumed from step {resumed} ({where})")
        while state["step"]["n"] < steps:
            train_step(state, rank)
            n = state["step"]["n"]
            await ckpt.save(state, step=n)
            if n == kill_at and attempt == 0 and rank == 1:
                while ckpt.in_flight():  # its snapshot committed: the agent holds it
                    await asyncio.sleep(0.01)
                os.kill(os.getpid(), signal.SIGKILL)
        await ckpt.wait()
        # 1. Resuming lost nothing: the same as a run never interrupted.
        reference = make()
        for _ in range(steps):
            train_step(reference, rank)
        assert same(state, reference), "the resumed run differs from an uninterrupted one"
        # 2. The final checkpoint restores bit-exact into fresh objects.
        fresh = make(seed=1)
        got = await ckpt.restore(fresh)
        assert got == steps and same(fresh, state), got
        say(
            f"rank {rank}: restored step {steps}: model, optimizer (exp_avg, exp_avg_sq, step, "
            "param_groups) and step counter bit-exact; the resumed run matches an uninterrupted one"
        )
    dist.destroy_process_group()


def launch(args: argparse.Namespace) -> int:
    """Start the agent, run the job under torchrun, stop the agent: also when this
    launcher is stopped (SIGTERM, as a scheduler stops a job; Ctrl-C), and, through
    ``--parent``, when it is killed outright (the agent exits once this process has)."""
    job = f"example-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)  # unwinds through the finally blocks below

    signal.signal(signal.SIGTERM, stop)
    parent = ["--parent", str(os.getpid())]  # the agent exits once this launcher has
    agent = subprocess.Popen(
        [sys.executable, "-m", "async_stager", "agent", "--job", job, "--max-bytes", "256MiB", *parent],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert agent.stdout is not None
        print(agent.stdout.readline().strip(), flush=True)  # "... listening at ..."
        agent.stdout.close()
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1"]
        cmd += ["--master-port", str(port), "--monitor-interval", "0.1"]
        cmd += [__file__, "--rank-main"]
        cmd += ["--out", args.out, "--job", job, "--steps", str(args.steps), "--kill-at", str(args.kill_at)]
        run = subprocess.Popen(cmd, env=env)
        try:
            return run.wait(args.timeout)
        finally:
            if run.poll() is None:  # stopped early: torchrun stops its ranks on SIGTERM
                run.terminate()
                try:
                    run.wait(30)
                except subprocess.TimeoutExpired:
                    run.kill()
                    run.wait()
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(30)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--kill-at", type=int, default=7)
    p.add_argument("--job", default="")
    p.add_argument("--timeout", type=float, default=240)
    p.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_main:
        asyncio.run(rank_main(args.out, args.job, args.steps, args.kill_at))
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
