"""Children of the S3 Checkpointer's process tests (test_checkpointer_s3_procs.py).

``ranks URL RANK WORLD PORT``: one rank of a gloo job; each rank saves its own tensors
(so every rank uploads a data file of its own) for steps 1..3 with keep=2, then
restores step 3 (the newest) and step 2 and checks them; prints ``OK``. The parent
gives each rank its scratch folder (``ASYNC_STAGER_SCRATCH``): one per rank is two
nodes.

``denied URL RANK WORLD PORT``: as ``ranks``, but the parent's proxy denies rank 1's
upload in step 2: the save fails on both ranks, step 3 commits and restores.

``kill URL PHASE``: saves steps 1, 2, ... (keep=2) and SIGKILLs itself at ``PHASE`` of
step 4's save: ``upload`` (a data file's upload in flight), ``record`` (every file
stored, the commit record not yet written), ``committed`` (right after the commit
record), ``retention`` (a step marked retired, its record not yet deleted).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

import anyio
import torch

from async_stager import Checkpointer, CheckpointError
from async_stager._checkpoint import store_place
from async_stager._store import store as store_module


def state(step: int, rank: int = 0) -> dict[str, Any]:
    return {f"w{rank}": torch.full((512, 512), float(step + 10 * rank)), "step": step}


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _rank_of_job(rank: int, world: int, port: int, main: Any) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        anyio.run(main)
    finally:
        dist.destroy_process_group()
    print("OK", flush=True)


def ranks(url: str, rank: int, world: int, port: int) -> None:
    async def main() -> None:
        async with Checkpointer(url, keep=2) as ckpt:
            for step in (1, 2, 3):
                await ckpt.save(state(step, rank), step=step)
            await ckpt.wait()
            assert ckpt.steps() == [2, 3], ckpt.steps()
            for step in (3, 2):
                got = state(0, rank)
                assert await ckpt.restore(got, step=None if step == 3 else step) == step
                assert torch.equal(got[f"w{rank}"], state(step, rank)[f"w{rank}"]), step
                assert got["step"] == step

    _rank_of_job(rank, world, port, main)


def denied(url: str, rank: int, world: int, port: int) -> None:
    """Step 2's upload of rank 1's file is denied (the parent's proxy): step 2 fails on
    both ranks, naming rank 1; step 3 commits; restore gives step 3."""

    async def main() -> None:
        async with Checkpointer(url, keep=2) as ckpt:
            await ckpt.save(state(1, rank), step=1)
            await ckpt.wait()
            await ckpt.save(state(2, rank), step=2)
            try:
                await ckpt.wait()
            except CheckpointError as exc:
                assert "rank 1 could not store its files" in str(exc) and "denied" in str(exc), exc
            else:
                raise AssertionError("step 2 committed")
            await ckpt.save(state(3, rank), step=3)
            await ckpt.wait()
            assert ckpt.steps() == [1, 3], ckpt.steps()
            got = state(0, rank)
            assert await ckpt.restore(got) == 3
            assert torch.equal(got[f"w{rank}"], state(3, rank)[f"w{rank}"])

    _rank_of_job(rank, world, port, main)


def kill(url: str, phase: str) -> None:
    armed = threading.Event()
    blocking = store_module.BlockingStore
    put_many, put_record, delete = blocking.put_many, blocking.put_record, blocking.delete

    def put_many_hook(self: Any, items: Any, **kw: Any) -> Any:
        if armed.is_set() and phase == "upload" and any(".distcp" in k for k, _ in items):
            threading.Timer(0.02, _die).start()
        return put_many(self, items, **kw)

    def put_record_hook(self: Any, key: str, data: Any, **kw: Any) -> Any:
        if armed.is_set() and key.endswith("/COMMIT") and phase == "record":
            _die()
        out = put_record(self, key, data, **kw)
        if armed.is_set() and key.endswith("/COMMIT") and phase == "committed":
            _die()
        return out

    def delete_hook(self: Any, keys: Any) -> Any:
        if armed.is_set() and phase == "retention" and str(keys).endswith("/COMMIT"):
            _die()
        return delete(self, keys)

    blocking.put_many = put_many_hook  # type: ignore[method-assign]
    blocking.put_record = put_record_hook  # type: ignore[method-assign]
    blocking.delete = delete_hook  # type: ignore[method-assign]
    store_place.RETIRE_GRACE = 0.0  # retired steps deleted at the next commit

    async def main() -> None:
        async with Checkpointer(url, keep=2) as ckpt:
            for step in range(1, 6):
                if step == 4:
                    await ckpt.wait()
                    armed.set()
                await ckpt.save(state(step), step=step)
            await ckpt.wait()

    anyio.run(main)
    print("NOT KILLED", flush=True)


if __name__ == "__main__":
    if sys.argv[1] in ("ranks", "denied"):
        job = ranks if sys.argv[1] == "ranks" else denied
        job(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        kill(sys.argv[2], sys.argv[3])
