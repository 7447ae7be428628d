"""Replication's cost and worth on this machine: two "nodes" (each its own agent and rank).

``PYTHONPATH=. python scripts/bench_replication.py --mib 256 --steps 30``:
1. step time, memory save every step, replication off then on (one process per node,
   a training step of fixed compute and an all-reduce, the median over ``--steps``);
2. a node's loss to training again: node B (its rank and its agent) SIGKILLed, the job's
   ranks killed and restarted with a fresh agent on node B: seconds from the kill until
   both ranks restored (process start, torch import, gloo rendezvous included), from the
   peer's replica; then the same with both agents fresh: from disk.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def child(
    folder: str, job: str, base: str, rank: int, port: int, mib: int, steps: int, replicate: int, share: float
) -> None:
    # The node-loss runs (6 steps) persist every 4th step: memory then holds a newer one.
    persist = 4 if steps == 6 else steps
    import faulthandler

    faulthandler.dump_traceback_later(1200, exit=True)  # a hang says where
    import anyio
    import torch
    import torch.distributed as dist

    from async_stager import AgentClient, Checkpointer

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=300))
    g = torch.Generator().manual_seed(rank)
    state = {
        f"r{rank}.t{i}": torch.randn(4 << 20, generator=g) for i in range(mib // 16)
    }  # keys per rank (DCP)
    a = torch.randn(384, 384)

    async def main() -> None:
        client = AgentClient(job, base=base, timeout=60)
        async with Checkpointer(
            folder,
            agent=client,
            memory_every=1,
            persist_every=persist,
            replicate=bool(replicate),
            replica_share=share,
        ) as ckpt:
            t_restore = time.perf_counter()
            got = await ckpt.restore(state)
            t_restore = time.perf_counter() - t_restore
            m = ckpt.memory
            assert m is not None
            where = "peer" if m.restored_from_peer else ("memory" if m.restored == got else "disk")
            print(f"RESTORED {got} {where} {time.time():.3f} {t_restore:.3f}", flush=True)
            times = []
            for step in range((got or 0) + 1, steps + 1):
                t0 = time.perf_counter()
                for _ in range(25):
                    a.matmul(a)
                dist.all_reduce(torch.ones(1))
                await ckpt.save(state, step=step)
                times.append(time.perf_counter() - t0)
                if persist < steps:  # the node-loss run: each step's replica verified first
                    await ckpt.wait()
                    end = time.monotonic() + 120
                    while (
                        ckpt.memory is None or ckpt.memory.replica_step != step
                    ) and time.monotonic() < end:
                        await anyio.sleep(0.01)
                    dist.all_reduce(torch.ones(1))
            await ckpt.wait()
            m = ckpt.memory
            assert m is not None
            med = statistics.median(times[3:]) if len(times) > 4 else float("nan")
            print(
                f"STEPS median={med:.4f} replicated={m.replicated} replica_step={m.replica_step} "
                f"link={m.replica_link_bytes_per_second / 1e6:.0f}MB/s replica_s={m.replica_seconds:.2f}",
                flush=True,
            )
            print("DONE", flush=True)
            await anyio.sleep(3600)

    anyio.run(main)


#: The agents' bound (set from --mib: a rank's snapshots and its peer's replicas fit).
MAX_BYTES = "4GiB"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _agent(job: str, base: str) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, "-m", "async_stager", "agent", "--job", job, "--dir", base, "--max-bytes", MAX_BYTES],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
    )  # fmt: skip
    assert p.stdout is not None and "listening" in p.stdout.readline()
    return p


def _ranks(
    folder: str, bases: list[str], mib: int, steps: int, replicate: int, share: float = 0.5
) -> list[subprocess.Popen[str]]:
    port = _port()
    return [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--child",
                folder,
                "bench",
                bases[r],
                str(r),
                str(port),
                str(mib),
                str(steps),
                str(replicate),
                str(share),
            ],
            stdout=subprocess.PIPE,
            stderr=open(f"{folder}.rank{r}.err", "a"),
            text=True,
            start_new_session=True,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
        )
        for r in range(2)
    ]


def _until(p: subprocess.Popen[str], word: str) -> str:
    assert p.stdout is not None
    for line in p.stdout:
        if line.startswith(word):
            return line.strip()
    raise RuntimeError(f"exited before {word}")


def _kill(*ps: subprocess.Popen[str]) -> None:
    for p in ps:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--shares", type=float, nargs="+", default=[0.5])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--skip-steps", action="store_true")
    args = ap.parse_args()
    global MAX_BYTES
    MAX_BYTES = f"{args.mib * 12}MiB"
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        print(f"(the ranks' stderr: {tmp}/*.err)", flush=True)
        bases = [tempfile.mkdtemp(dir="/tmp", prefix="abr-") for _ in range(2)]
        agents = [_agent("bench", b) for b in bases]
        ranks: list[subprocess.Popen[str]] = []
        try:
            # Interleaved rounds: off, then on at each share, again (the load moves).
            for i in range(0 if args.skip_steps else args.rounds):
                for replicate, share in [(0, 0.5)] + [(1, x) for x in args.shares]:
                    folder = os.path.join(tmp, f"steps{i}-{replicate}-{share}")
                    ranks = _ranks(folder, bases, args.mib, args.steps, replicate, share)
                    lines = [_until(p, "STEPS") for p in ranks]
                    print(f"round {i} replicate={replicate} share={share}: {lines}", flush=True)
                    _kill(*ranks)
                    # Fresh agents for each run: a run's snapshots (another folder each)
                    # would stay in them and fill their bound.
                    _kill(*agents)
                    agents[:] = [_agent("bench", b) for b in bases]
            # The node loss: a run that replicates, then node B lost whole.
            folder = os.path.join(tmp, "loss")
            ranks = _ranks(folder, bases, args.mib, 6, 1)
            print("before the loss:", [_until(p, "STEPS") for p in ranks], flush=True)
            for how in ("peer", "disk"):
                t0 = time.time()
                _kill(ranks[1], agents[1])
                _kill(ranks[0])
                if how == "disk":
                    _kill(agents[0])
                    agents[0] = _agent("bench", bases[0])
                agents[1] = _agent("bench", bases[1])
                ranks = _ranks(folder, bases, args.mib, 6, 1)
                got = [_until(p, "RESTORED").split() for p in ranks]
                back = max(float(g[3]) for g in got) - t0
                print(
                    f"node lost, restored from {how}: {[g[1:3] for g in got]}, restore() {[g[4] for g in got]} s, "
                    f"training again {back:.2f} s after the kill",
                    flush=True,
                )
                _until(ranks[0], "DONE")
                _until(ranks[1], "DONE")
        finally:
            _kill(*ranks, *agents)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        a = sys.argv[2:]
        child(a[0], a[1], a[2], int(a[3]), int(a[4]), int(a[5]), int(a[6]), int(a[7]), float(a[8]))
    else:
        main()
