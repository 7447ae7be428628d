"""One rank of a job whose "nodes" each have their own agent (run as a script).

``python replica_child.py DIR JOB BASE STEPS MODE [RANK WORLD PORT]``: joins a gloo
group (RANK, WORLD and PORT given, or torchrun's environment), restores through
``Checkpointer(DIR, agent=AgentClient(JOB, base=BASE), memory_every=1,
persist_every=PERSIST, replicate=True)`` (BASE: this node's agent's runtime folder),
checks the restored state bit for bit against an uninterrupted run (``replay``) and
prints ``RESTORED step where`` (``memory``: its own agent, ``peer``: the replica on the
other node, ``disk``, ``none``). Then trains up to STEPS, saving every step, printing
``SAVED step`` and, once its peer verified the replica, ``REPLICATED step``; then
``DONE`` with its stats, and waits to be killed. MODE: ``sync`` (each step waits until
its replica is verified or refused: a deterministic kill point), ``mid`` (replicas
paced to ``RATE`` bytes per second; prints ``REPLICATING step`` while one is sent),
``free`` (nothing waits for replication). Environment: ``PERSIST`` (default 10**9),
``RATE``, ``BIG`` (a rank whose state has 16 MiB more: for the memory bound), ``EXIT``
(after ``DONE``, close the Checkpointer, print ``CLOSED`` and exit).
"""

from __future__ import annotations

import datetime
import os
import sys
import time
import warnings
from typing import Any

import anyio
import torch

from tests.tier.job_kill_child import N, advance, initial, replay, same


def say(text: str) -> None:
    # Under torchrun the ranks of a node share its launcher's stdout: each line says whose.
    prefix = f"R{os.environ['RANK']} " if "LOCAL_RANK" in os.environ else ""
    sys.stdout.write(prefix + text + "\n")
    sys.stdout.flush()


def state_of(rank: int) -> dict[str, object]:
    state = initial(rank)
    if os.environ.get("BIG") == str(rank):
        state["big"] = torch.arange(64 * N, dtype=torch.float32)
    return state


def failed(ckpt: Any) -> int:
    s = ckpt.memory
    return int(s.replica_skipped + s.replica_failures)


async def main(directory: str, job: str, base: str, steps: int, mode: str, rank: int) -> None:
    import torch.distributed as dist

    from async_stager import AgentClient, Checkpointer

    # Each rank's tensors under a key of its own: DCP takes tensors of one name on
    # several ranks for one replicated tensor, and writes it once.
    if os.environ.get("DUMP"):
        import asyncio
        import threading as _th

        loop = asyncio.get_running_loop()

        def dump() -> None:
            for task in asyncio.all_tasks(loop):
                task.print_stack(file=sys.stderr)

        _th.Timer(float(os.environ["DUMP"]) - 5, lambda: loop.call_soon_threadsafe(dump)).start()
    inner = state_of(rank)
    state = {f"rank{rank}": inner}
    rate = float(os.environ["RATE"]) if os.environ.get("RATE") else None
    client = AgentClient(job, base=base, timeout=30)
    persist = int(os.environ.get("PERSIST", str(10**9)))
    async with Checkpointer(
        directory,
        agent=client,
        memory_every=1,
        persist_every=persist,
        replicate=os.environ.get("REPLICATE", "1") == "1",
        replica_rate=rate,
    ) as ckpt:
        got = await ckpt.restore(state)
        step = got or 0
        stats = ckpt.memory
        assert stats is not None
        where = "none" if got is None else "disk"
        if got is not None and stats.restored == got:
            where = "peer" if stats.restored_from_peer else "memory"
        expected = replay(step, rank)
        if not same(inner, expected):
            say(f"MISMATCH {got}")
            os._exit(3)
        say(f"RESTORED {got} {where}")
        while step < steps:
            before_failed = failed(ckpt)
            step += 1
            advance(inner, step, rank)
            dist.all_reduce(torch.ones(1))
            if await ckpt.save(state, step=step):
                say(f"SAVED {step}")
            if mode == "sync":
                # Until this step's replica is verified, or refused (counted), or none
                # comes (the job's common step did not move: a rank's agent is away).
                await ckpt.wait()
                end = time.monotonic() + (60 if before_failed == failed(ckpt) else 0)
                while time.monotonic() < end:
                    s = ckpt.memory
                    assert s is not None
                    if s.replica_step == step or failed(ckpt) > before_failed:
                        break
                    if not ckpt.in_flight() and time.monotonic() > end - 57:
                        break  # nothing being sent three seconds on: none was decided
                    await anyio.sleep(0.005)
            elif mode == "mid":
                for _ in range(2000):
                    shown = [p for p in ckpt.in_flight() if p.phase == "memory-replicating"]
                    if shown:
                        say(f"REPLICATING {shown[0].step} {ckpt.status_line()!r}")
                        break
                    await anyio.sleep(0.005)
            s = ckpt.memory
            assert s is not None
            if s.replica_step is not None:
                say(f"REPLICATED {s.replica_step}")
            dist.all_reduce(torch.ones(1))  # the next step starts together
        await ckpt.wait()
        s = ckpt.memory
        assert s is not None
        say(
            f"DONE replicated={s.replicated} step={s.replica_step} skipped={s.replica_skipped} "
            f"failures={s.replica_failures} peer={s.replica_peer} line={ckpt.status_line()!r}"
        )
        while not os.environ.get("EXIT"):
            await anyio.sleep(1)
    say("CLOSED")


if __name__ == "__main__":
    if os.environ.get("DUMP"):  # a hang's stacks on stderr, after DUMP seconds
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["DUMP"]), exit=True)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    directory, job, base, steps, mode = sys.argv[1:6]
    torch.set_num_threads(1)
    import torch.distributed as dist

    if len(sys.argv) > 6:
        rank, world, port = sys.argv[6:9]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        dist.init_process_group(
            "gloo", rank=int(rank), world_size=int(world), timeout=datetime.timedelta(seconds=60)
        )
    else:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    anyio.run(main, directory, job, base, int(steps), mode, dist.get_rank())
    dist.destroy_process_group()
