"""Child processes of test_checkpointer_paths: a trainer and an evaluation job on one
folder.

``writer DIR FORMAT new|same STOPFILE [NODE_BUDGET LEDGER]``: saves with keep=1 until
STOPFILE exists (at least a few commits): new steps, or one step over and over; each
save's tensors hold its number; with a node budget shared through the ledger folder
LEDGER. Prints ``{"commits": n}``.

``reader-any DIR SECONDS``: restores into an empty state again and again for SECONDS
(the model test's states: ``w[0]``, ``x.nested.t`` and ``seq`` hold the save's number).
Prints ``{"restores": n, "errors": [...]}``.

``reader DIR FORMAT SECONDS``: restores the newest step again and again for SECONDS,
checking that the values are whole (every tensor holds the save's number, the number
saved beside it). Prints ``{"restores": n, "errors": [...]}``.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import anyio
import torch

from async_stager import Checkpointer

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

#: Tensors of 1 MiB each: a restore long enough to overlap several commits.
N, SIZE = 6, 2**18


def state(n: int) -> dict[str, Any]:
    return {"n": n, **{f"w{i}": torch.full((SIZE,), float(n)) for i in range(N)}}


async def writer(folder: Path, fmt: Any, steps: str, stop: Path, node: list[str]) -> None:
    commits = 0
    opts: dict[str, Any] = {"node_budget_bytes": int(node[0]), "node_budget_path": node[1]} if node else {}
    async with Checkpointer(folder, format=fmt, keep=1, **opts) as ckpt:
        n = 0
        while not stop.exists() or commits < 5:
            n += 1
            await ckpt.save(state(n), step=n if steps == "new" else 7)
            await ckpt.wait()
            commits += 1
    print(json.dumps({"commits": commits}), flush=True)


async def reader(folder: Path, fmt: Any, seconds: float) -> None:
    restores, errors = 0, []
    deadline = time.monotonic() + seconds
    async with Checkpointer(folder, format=fmt) as ckpt:
        while time.monotonic() < deadline or restores < 5:
            out = state(-1)
            try:
                step = await ckpt.restore(out)
            except Exception as exc:  # noqa: BLE001 - counted and reported
                errors.append(f"{type(exc).__name__}: {exc}")
                continue
            finally:
                restores += 1
            n = out["n"]
            bad = [k for k in out if k != "n" and not torch.equal(out[k], torch.full((SIZE,), float(n)))]
            if step is None or bad:
                errors.append(f"step {step} (save {n}): torn values in {bad}")
    print(json.dumps({"restores": restores, "errors": errors}), flush=True)


async def reader_any(folder: Path, seconds: float) -> None:
    restores, errors = 0, []
    deadline = time.monotonic() + seconds
    async with Checkpointer(folder) as ckpt:
        while time.monotonic() < deadline or restores < 2:
            out: dict[str, Any] = {}
            restores += 1
            try:
                step = await ckpt.restore(out)
            except Exception as exc:  # noqa: BLE001 - counted and reported
                errors.append(f"{type(exc).__name__}: {exc}")
                continue
            if step is None:
                errors.append("no step restored")
                continue
            n = out["seq"]
            whole = float(out["w"][0]) == n and bool((out["x"]["nested"]["t"] == n).all())
            if not whole:
                errors.append(f"step {step} (save {n}): torn values")
    print(json.dumps({"restores": restores, "errors": errors}), flush=True)


def main() -> None:
    mode, folder = sys.argv[1], Path(sys.argv[2])
    if mode == "writer":
        anyio.run(writer, folder, sys.argv[3], sys.argv[4], Path(sys.argv[5]), sys.argv[6:8])
    elif mode == "reader-any":
        anyio.run(reader_any, folder, float(sys.argv[3]))
    else:
        anyio.run(reader, folder, sys.argv[3], float(sys.argv[4]))


if __name__ == "__main__":
    main()
