"""The memory tier's job-wide retention, measured: time per save and snapshots held.

``PYTHONPATH=. python scripts/bench_tier_ranks.py --mib 64 --steps 60 --step-ms 20``
starts a node agent and a 2-rank gloo job; each rank trains ``--steps`` steps (an
all-reduce and ``--step-ms`` of compute, then ``Checkpointer(agent=...).save`` of a
state of ``--mib`` MiB, a memory snapshot every step, nothing on disk). ``--skew-ms``
makes rank 1's steps that much longer (a slow rank). Prints, per rank, the time its
``save()`` blocked (median, 90th percentile, max) and, from a poller beside the job,
the most complete snapshots the agent held for one rank at once.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Any


def rank_main(args: argparse.Namespace) -> None:
    import anyio
    import torch
    import torch.distributed as dist

    from async_stager import Checkpointer
    from async_stager._tier.client import AgentClient

    dist.init_process_group("gloo", rank=args.rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    n = args.mib << 18
    state = {"w": torch.randn(n // 2), "m": {"v": torch.randn(n // 2)}, "step": 0}

    async def run() -> list[float]:
        times = []
        client = AgentClient(args.job, base=args.base, timeout=60)
        async with Checkpointer(args.dir, agent=client, memory_every=1, persist_every=10**9) as ckpt:
            for step in range(1, args.steps + 1):
                dist.all_reduce(torch.ones(1))
                t_end = time.monotonic() + (args.step_ms + (args.skew_ms if args.rank == 1 else 0)) / 1e3
                state["w"].add_(1.0)
                while time.monotonic() < t_end:
                    await anyio.sleep(0.001)
                state["step"] = step
                t0 = time.monotonic()
                await ckpt.save(state, step=step)
                times.append(time.monotonic() - t0)
            await ckpt.wait()
        return times

    times = anyio.run(run)
    print(json.dumps({"rank": args.rank, "save_s": times}), flush=True)
    dist.destroy_process_group()


def poll(job: str, base: str, stop: threading.Event, most: list[int]) -> None:
    import anyio

    from async_stager._tier.client import AgentClient

    async def run() -> None:
        async with AgentClient(job, base=base, timeout=30) as c:
            while not stop.is_set():
                st = await c.status()
                per: dict[int, int] = {}
                for s in st.snapshots:
                    if s.complete:
                        per[s.rank] = per.get(s.rank, 0) + 1
                if per:
                    most[0] = max(most[0], *per.values())
                most[1] = max(most[1], st.held_bytes)
                await anyio.sleep(0.003)

    anyio.run(run)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument("--skew-ms", type=float, default=0.0)
    p.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--job", default="", help=argparse.SUPPRESS)
    p.add_argument("--base", default="", help=argparse.SUPPRESS)
    p.add_argument("--dir", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank >= 0:
        rank_main(args)
        return
    job = f"bench-{uuid.uuid4().hex[:8]}"
    base = tempfile.mkdtemp(prefix="ast-", dir="/tmp")
    folder = tempfile.mkdtemp()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    agent = subprocess.Popen(
        [sys.executable, "-m", "async_stager", "agent", "--job", job, "--dir", base, "--max-bytes", "8GiB"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    assert agent.stdout is not None and "listening" in agent.stdout.readline()
    stop = threading.Event()
    most = [0, 0]
    poller = threading.Thread(target=poll, args=(job, base, stop, most), daemon=True)
    poller.start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    common = [*sys.argv[1:], "--job", job, "--base", base, "--dir", folder]
    ranks = [
        subprocess.Popen(
            [sys.executable, __file__, *common, "--rank", str(r)], stdout=subprocess.PIPE, text=True, env=env
        )
        for r in range(2)
    ]
    out: list[dict[str, Any]] = []
    try:
        for r in ranks:
            stdout, _ = r.communicate(timeout=1800)
            out.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        stop.set()
        poller.join(30)
        agent.send_signal(signal.SIGTERM)
        agent.wait(30)
    for o in out:
        t = sorted(o["save_s"][3:])  # after the first rounds (arenas made, pages touched)
        print(
            f"rank {o['rank']}: save() blocked median {statistics.median(t) * 1e3:.1f} ms, "
            f"p90 {t[int(0.9 * (len(t) - 1))] * 1e3:.1f} ms, max {t[-1] * 1e3:.1f} ms"
        )
    print(
        f"most complete snapshots of one rank held at once: {most[0]}; most bytes held: {most[1] / 2**20:.0f} MiB"
    )


if __name__ == "__main__":
    main()
