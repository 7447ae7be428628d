"""Incremental saves against full ones, for docs/benchmarks.md (issue 43), one run,
side by side.

``python scripts/bench_incremental.py [--base-mib 1024] [--saves 100] [--full-saves 100]``

Two states, each saved every step by ``Checkpointer(keep=2)`` with
``incremental=False`` (full) and ``incremental=True``, one after the other in one run:

- ``lora``: a frozen base (``--base-mib``, float32 tensors of 64 MiB) and a 10 MiB
  adapter with its AdamW state (``exp_avg``, ``exp_avg_sq``: 30 MiB change per step);
- ``dlrm``: an embedding table (``--table-mib``, 64 float32 columns) of which 1% of the
  rows (uniformly drawn) change per step, and a small dense MLP that changes too.

Per mode: bytes written per save (the files each step wrote itself: data, metadata,
manifest, record; not the links to earlier data), the changed bytes, write time per
save (the background write and commit: ``SaveStats.write_seconds + commit_seconds``),
time blocked per save (the wall time of ``await ckpt.save()``, each save after the
previous committed), the disk used after the saves (each file once: links are one
file), and the restore time of the newest step (a new Checkpointer, checksums
verified, page cache warm; the two folders restored in turn, five rounds, the best
of each). Medians over the saves after the first. Prints a table;
``--json FILE`` writes every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

MiB = 1 << 20


def lora_state(base_mib: int) -> tuple[dict[str, Any], int]:
    g = torch.Generator().manual_seed(0)
    base = {}
    left, i = base_mib * MiB // 4, 0
    while left > 0:
        n = min(left, 16 * MiB)  # 64 MiB tensors
        base[f"layer{i}.weight"] = torch.randn(n, generator=g)
        left -= n
        i += 1
    n = 10 * MiB // 4
    adapter = torch.randn(n, generator=g)
    state = {
        "model": {"base": base, "lora": adapter},
        "optim": {"exp_avg": torch.zeros(n), "exp_avg_sq": torch.zeros(n), "step": 0},
    }
    return state, 3 * n * 4


def lora_step(state: dict[str, Any], step: int) -> None:
    """An AdamW step on the adapter alone (the base is frozen)."""
    g = torch.Generator().manual_seed(step)
    opt = state["optim"]
    grad = torch.randn(state["model"]["lora"].numel(), generator=g) * 1e-3
    opt["exp_avg"].mul_(0.9).add_(grad, alpha=0.1)
    opt["exp_avg_sq"].mul_(0.999).addcmul_(grad, grad, value=0.001)
    state["model"]["lora"].sub_(opt["exp_avg"] / (opt["exp_avg_sq"].sqrt() + 1e-8), alpha=1e-4)
    opt["step"] = step


def dlrm_state(table_mib: int) -> tuple[dict[str, Any], int]:
    g = torch.Generator().manual_seed(0)
    rows = table_mib * MiB // (64 * 4)
    state = {
        "model": {
            "embedding": torch.randn(rows, 64, generator=g),
            "mlp.0": torch.randn(512, 64, generator=g),
            "mlp.1": torch.randn(1, 512, generator=g),
        },
        "step": 0,
    }
    return state, 0


def dlrm_step(state: dict[str, Any], step: int) -> int:
    """1% of the table's rows and the dense MLP change; returns the changed bytes."""
    g = torch.Generator().manual_seed(step)
    table = state["model"]["embedding"]
    rows = max(1, int(table.shape[0]) // 100)
    idx = torch.randperm(table.shape[0], generator=g)[:rows]
    table[idx] += 0.01
    dense = 0
    for k in ("mlp.0", "mlp.1"):
        state["model"][k].add_(1e-3)
        dense += int(state["model"][k].numel()) * 4
    state["step"] = step
    return rows * 64 * 4 + dense


def written_bytes(folder: Path) -> int:
    """What a step wrote itself: every file but its links to earlier data."""
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file() and not p.name.startswith("ref-"))


def metadata_bytes(folder: Path) -> int:
    """A step's files that are not tensor data: DCP's .metadata, the manifest, keys, COMMIT."""
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file() and not p.name.endswith(".distcp"))


def disk_bytes(root: Path) -> int:
    seen: dict[tuple[int, int], int] = {}
    for p in root.rglob("*"):
        if p.is_file():
            s = p.stat()
            seen[(s.st_dev, s.st_ino)] = s.st_blocks * 512
    return sum(seen.values())


async def run_mode(
    kind: str, incremental: bool, saves: int, size_mib: int, root: Path
) -> tuple[dict[str, Any], dict[str, Any]]:
    from async_stager import Checkpointer, SaveStats

    if kind == "lora":
        state, changed = lora_state(size_mib)
    else:
        state, changed = dlrm_state(size_mib)
    folder = root / f"{kind}-{'incremental' if incremental else 'full'}"
    shutil.rmtree(folder, ignore_errors=True)
    stats: list[SaveStats] = []
    blocked: list[float] = []
    written: list[int] = []
    meta: list[int] = []
    changes: list[int] = []
    state_bytes = sum(t.numel() * t.element_size() for t in _tensors(state))
    async with Checkpointer(folder, keep=2, incremental=incremental, on_saved=stats.append) as ckpt:
        for step in range(1, saves + 1):
            if kind == "lora":
                lora_step(state, step)
                changes.append(changed)
            else:
                changes.append(dlrm_step(state, step))
            t0 = time.perf_counter()
            await ckpt.save(state, step=step)
            blocked.append(time.perf_counter() - t0)
            await ckpt.wait()
            written.append(written_bytes(folder / f"step-{step:08d}"))
            meta.append(metadata_bytes(folder / f"step-{step:08d}"))
    disk = disk_bytes(folder)
    later = slice(1, None)
    out = {
        "kind": kind,
        "mode": "incremental" if incremental else "full",
        "saves": saves,
        "state_bytes": state_bytes,
        "changed_bytes_per_save": statistics.median(changes[later]),
        "written_bytes_per_save": statistics.median(written[later]),
        "metadata_bytes_per_save": statistics.median(meta[later]),
        "first_save_written_bytes": written[0],
        "write_seconds_per_save": statistics.median(s.write_seconds + s.commit_seconds for s in stats[later]),
        "blocked_seconds_per_save": statistics.median(blocked[later]),
        "reused_bytes_per_save": statistics.median(s.reused_bytes for s in stats[later]),
        "disk_bytes_after": disk,
        "folder": str(folder),
    }
    return out, state


async def restore_times(
    folders: list[str], state: dict[str, Any], saves: list[int], rounds: int
) -> list[float]:
    """Each folder's newest step restored by a new Checkpointer (checksums verified),
    the folders interleaved (a shared machine's load falls on each alike), ``rounds``
    times, in a rotating order; the best time of each. Checks the values."""
    from async_stager import Checkpointer

    best = [float("inf")] * len(folders)
    for r in range(rounds):
        order = list(range(len(folders)))
        order = order[r % len(order) :] + order[: r % len(order)]
        for i in order:
            zeroed = _zeros_like(state)
            t0 = time.perf_counter()
            async with Checkpointer(folders[i], keep=2) as ckpt:
                got = await ckpt.restore(zeroed, fallback=False)
            best[i] = min(best[i], time.perf_counter() - t0)
            assert got == saves[i], got
            assert all(torch.equal(a, b) for a, b in zip(_tensors(zeroed), _tensors(state))), (
                "restored values differ"
            )
    return best


def _tensors(sd: Any) -> list[torch.Tensor]:
    if isinstance(sd, torch.Tensor):
        return [sd]
    if isinstance(sd, dict):
        return [t for v in sd.values() for t in _tensors(v)]
    return []


def _zeros_like(sd: Any) -> Any:
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    if isinstance(sd, dict):
        return {k: _zeros_like(v) for k, v in sd.items()}
    return sd


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| state | mode | saves | changed / save | written / save | written / (changed + metadata) "
        "| write / save | blocked / save | disk after | restore newest |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = r.get("written_over_changed", float("nan"))
        lines.append(
            f"| {r['kind']} | {r['mode']} | {r['saves']} | {r['changed_bytes_per_save'] / MiB:.1f} MiB "
            f"| {r['written_bytes_per_save'] / MiB:.1f} MiB | {ratio:.2f} "
            f"| {r['write_seconds_per_save'] * 1e3:.0f} ms | {r['blocked_seconds_per_save'] * 1e3:.0f} ms "
            f"| {r['disk_bytes_after'] / MiB:.0f} MiB | {r['restore_seconds'] * 1e3:.0f} ms |"
        )
    return "\n".join(lines)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-mib", type=int, default=1024, help="the LoRA state's frozen base")
    ap.add_argument("--table-mib", type=int, default=256, help="the DLRM state's embedding table")
    ap.add_argument("--saves", type=int, default=100, help="saves of each incremental run")
    ap.add_argument("--full-saves", type=int, default=100, help="saves of each full run")
    ap.add_argument("--states", default="lora,dlrm")
    ap.add_argument("--dir", default=None, help="where the folders go (default: a temporary one)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-incremental-"))
    rows = []
    for kind in args.states.split(","):
        size = args.base_mib if kind == "lora" else args.table_mib
        pair = []
        for incremental in (False, True):
            saves = args.saves if incremental else args.full_saves
            r, state = await run_mode(kind, incremental, saves, size, root)
            pair.append(r)
            print(json.dumps(r), flush=True)
        # Both runs end in the same state when they made as many saves.
        if pair[0]["saves"] == pair[1]["saves"]:
            times = await restore_times([r["folder"] for r in pair], state, [r["saves"] for r in pair], 5)
            for r, t in zip(pair, times):
                r["restore_seconds"] = t
                shutil.rmtree(r["folder"], ignore_errors=True)
            print(f"{kind}: restore full {times[0]:.3f} s, incremental {times[1]:.3f} s", flush=True)
        rows += pair
    for r in rows:
        full = next(x for x in rows if x["kind"] == r["kind"] and x["mode"] == "full")
        # The target's measure: written against the changed bytes plus the metadata.
        r["written_over_changed"] = r["written_bytes_per_save"] / max(
            1, r["changed_bytes_per_save"] + r["metadata_bytes_per_save"]
        )
        r["blocked_over_full"] = r["blocked_seconds_per_save"] / full["blocked_seconds_per_save"]
        r["restore_over_full"] = r["restore_seconds"] / full["restore_seconds"]
        r["written_over_full"] = r["written_bytes_per_save"] / full["written_bytes_per_save"]
    print(f"{os.cpu_count()} cores, torch {torch.__version__}")
    print(table(rows))
    for r in rows:
        if r["mode"] == "incremental":
            print(
                f"{r['kind']}: written/full {r['written_over_full']:.3f}, blocked/full "
                f"{r['blocked_over_full']:.2f}, restore/full {r['restore_over_full']:.2f}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    asyncio.run(main())
