"""One rank of the 2-rank job that test_job_kills.py SIGKILLs (run as a script).

``python job_kill_child.py DIR JOB BASE RANK WORLD PORT MODE KILL_AFTER`` joins a gloo
group, restores through ``Checkpointer(DIR, agent=...)`` (memory snapshots every step,
nothing on disk), checks the restored state bit for bit against a run of the same
steps never interrupted (``replay``), prints ``RESTORED step where`` (``where``: memory,
disk or none), then trains and saves a step at a time, printing ``SAVED step`` once a
save returned True, until it is killed. ``MODE``: ``lockstep`` (an all-reduce every
step, as data-parallel training does) or ``drift`` (no collective; rank 1 is slower, so
rank 0 runs ahead as far as the memory tier lets it). ``KILL_AFTER`` > 0: right after
the ``KILL_AFTER``-th save past the restored step returned, while its memory snapshot
is still being committed, this rank SIGKILLs itself (at a random point of the commit).
"""

from __future__ import annotations

import datetime
import os
import random
import signal
import sys
import warnings
from typing import Any

import anyio
import torch

N = 1 << 16


def initial(rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(rank)
    return {
        "w": torch.randn(N, generator=g),
        "m": {"acc": torch.zeros(N // 4, dtype=torch.float64), "steps": torch.zeros(3, dtype=torch.int64)},
        "progress": {"step": 0},
    }


def advance(state: dict[str, Any], step: int, rank: int) -> None:
    """One training step: the next state from the previous one (so a resume from a
    wrong or torn state never catches up)."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    state["w"].mul_(0.999).add_(torch.randn(N, generator=g), alpha=0.01)
    state["m"]["acc"].add_(state["w"][: N // 4].double().sign())
    state["m"]["steps"].add_(torch.tensor([1, step, rank]))
    state["progress"]["step"] = step


def replay(step: int, rank: int) -> dict[str, Any]:
    state = initial(rank)
    for k in range(1, step + 1):
        advance(state, k, rank)
    return state


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        torch.equal(a["w"], b["w"])
        and torch.equal(a["m"]["acc"], b["m"]["acc"])
        and torch.equal(a["m"]["steps"], b["m"]["steps"])
        and a["progress"] == b["progress"]
    )


def say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


async def main(directory: str, job: str, base: str, rank: int, mode: str, kill_after: int) -> None:
    import torch.distributed as dist

    from async_stager import Checkpointer
    from async_stager._tier.client import AgentClient

    state = initial(rank)
    client = AgentClient(job, base=base, timeout=30)
    async with Checkpointer(directory, agent=client, memory_every=1, persist_every=10**9) as ckpt:
        got = await ckpt.restore(state)
        step = got or 0
        stats = ckpt.memory
        assert stats is not None
        where = "none" if got is None else ("memory" if stats.restored == got else "disk")
        if not same(state, replay(step, rank)):
            say(f"MISMATCH {got}")
            os._exit(3)
        say(f"RESTORED {got} {where}")
        kill_at = step + kill_after if kill_after > 0 else -1
        rng = random.Random(os.getpid())
        while True:
            step += 1
            advance(state, step, rank)
            if mode == "lockstep":
                dist.all_reduce(torch.ones(1))
            else:
                await anyio.sleep(0.001 if rank == 0 else 0.02)
            if await ckpt.save(state, step=step):
                say(f"SAVED {step}")
            if step == kill_at:
                # Mid-commit: BEGIN, the hash, the COMMIT and the agent's check are in flight.
                for _ in range(rng.randrange(6)):
                    if not ckpt.in_flight():
                        break
                    await anyio.sleep(0.002)
                say(f"KILLED {step} {[p.phase for p in ckpt.in_flight()]}")
                os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    directory, job, base, rank, world, port, mode, kill_after = sys.argv[1:9]
    torch.set_num_threads(1)
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group(
        "gloo", rank=int(rank), world_size=int(world), timeout=datetime.timedelta(seconds=30)
    )
    anyio.run(main, directory, job, base, int(rank), mode, int(kill_after))
