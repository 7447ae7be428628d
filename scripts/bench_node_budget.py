"""One node budget shared by 4 ranks vs per-process budgets that sum to it (issue 27).

    python scripts/bench_node_budget.py [--state-mib 32] [--budget-mib 64] [--steps 3]

The same 4-rank gloo job on the CPU (tests/checkpoint/node_budget_child.py: each rank
saves its state every step with a Checkpointer, after an unequal "training" delay in
the unequal runs) in four runs: equal and unequal states, each with
``node_budget_bytes=B`` (one ledger for the node) and with ``host_budget_bytes=B/4``
per process. A sampler in this process reads the ledger and the ranks' RSS all along.
Prints one table (markdown): wall seconds of the job's save loop (the slowest rank),
the peak ledger bytes and the peak node-wide RSS growth against the budget, the path
each rank's saves took and each rank's node wait (seconds, all its saves). The
children run with ``MALLOC_MMAP_THRESHOLD_`` fixed so that freed rings leave RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CHILD = ROOT / "tests" / "checkpoint" / "node_budget_child.py"
MiB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def statm_rss(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return None


def run(cfg: dict[str, Any], budget: int) -> dict[str, Any]:
    """One job; returns its figures."""
    sys.path.insert(0, str(ROOT))
    from async_stager._core.memory.ledger import NodeLedger

    out = Path(cfg["out"])
    out.mkdir(parents=True)
    ledger = NodeLedger.open(budget, path=cfg["ledger"]) if not cfg.get("host_budget_bytes") else None
    env = dict(os.environ, PYTHONPATH=str(ROOT), MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, str(CHILD), json.dumps({**cfg, "rank": r})],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(cfg["world"])
    ]
    peak = {"ledger": 0, "rss": 0}
    stop = threading.Event()

    def sample() -> None:
        base: dict[int, int] = {}
        while not stop.is_set():
            if ledger is not None:
                u = ledger.usage()
                peak["ledger"] = max(peak["ledger"], u.reserved, u.peak)
            growth = 0
            for r, p in enumerate(procs):
                if (out / f"done-{r}").exists():
                    continue
                if r not in base:
                    ready = out / f"ready-{r}"
                    if ready.exists() and ready.read_text():
                        base[r] = int(ready.read_text())
                    continue
                now = statm_rss(p.pid)
                if now is not None:
                    growth += max(0, now - base[r])
            peak["rss"] = max(peak["rss"], growth)
            time.sleep(0.002)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    texts = [p.communicate(timeout=600)[0] for p in procs]
    stop.set()
    t.join()
    if ledger is not None:
        ledger.close()
    for p, text in zip(procs, texts):
        if p.returncode != 0:
            raise SystemExit(f"a rank failed:\n{text[-3000:]}")
    reports = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(cfg["world"])]
    return {
        "wall": max(rep["wall"] for rep in reports),
        "ledger": peak["ledger"],
        "rss": peak["rss"],
        "waits": [sum(s["node_wait"] for s in rep["saves"]) for rep in reports],
        "blocked": [sum(s["blocked"] for s in rep["saves"]) for rep in reports],
        "paths": [
            "/".join(sorted({str(s["admission"] or "budgeted") for s in rep["saves"]})) for rep in reports
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--state-mib", type=int, default=32, help="each rank's state (equal runs), MiB")
    ap.add_argument("--budget-mib", type=int, default=64, help="the node budget, MiB")
    ap.add_argument("--tensor-mib", type=int, default=1, help="each tensor, MiB")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    budget = args.budget_mib * MiB
    s = args.state_mib
    cases = {
        "equal": ([s] * 4, [0.0] * 4),
        # The same total, unequal: one rank holds most of it, and saves come at
        # unequal times (a "training" delay per rank before each save).
        "unequal": ([s // 4, s // 2, s, 4 * s - s // 4 - s // 2 - s], [0.0, 0.05, 0.1, 0.2]),
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (sizes, delays) in cases.items():
            for mode in ("node", "per-process"):
                d = Path(tmp) / f"{name}-{mode}"
                cfg: dict[str, Any] = {
                    "mode": "save",
                    "world": 4,
                    "port": free_port(),
                    "ckpt": str(d / "ckpt"),
                    "ledger": str(d / "ledger"),
                    "out": str(d / "out"),
                    "layout": "plain",
                    "tensor_mib": args.tensor_mib,
                    "steps": args.steps,
                    "sizes_mib": sizes,
                    "delays": delays,
                    "budget": budget,
                    "restore": False,
                }
                if mode == "per-process":
                    cfg["host_budget_bytes"] = budget // 4
                r = run(cfg, budget)
                rows.append((name, mode, sizes, r))
                print(f"{name} {mode}: {r}", file=sys.stderr, flush=True)
    print(
        f"4 ranks, gloo, CPU; node budget {args.budget_mib} MiB (per-process: {args.budget_mib / 4:g} MiB "
        f"each); {args.steps} saves; tensors of {args.tensor_mib} MiB\n"
    )
    print(
        "| states (MiB) | budget | wall s | peak ledger MiB | peak RSS growth MiB | paths per rank "
        "| node wait s per rank | save() blocked s per rank |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, mode, sizes, r in rows:
        ledger = f"{r['ledger'] / MiB:.1f}" if mode == "node" else "n/a"
        print(
            f"| {name} {sizes} | {mode} | {r['wall']:.2f} | {ledger} | {r['rss'] / MiB:.1f} | "
            f"{', '.join(r['paths'])} | {', '.join(f'{w:.2f}' for w in r['waits'])} | "
            f"{', '.join(f'{b:.2f}' for b in r['blocked'])} |"
        )


if __name__ == "__main__":
    main()
