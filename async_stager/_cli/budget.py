"""``python -m async_stager bench-budget``: a DCP save within a host-memory budget,
against its two references, in one run (docs/benchmarks.md).

For a CPU state of ``--state-mib`` MiB (float32 tensors of ``--tensor-mib`` MiB) written
to ``--dir``, one row per budget (``unlimited``: the ordinary stage-then-save) with the
total time, the time until the fence may return, the copier's blocked seconds, the
writer's seconds waiting for copies, the
ring's peak bytes and the process's peak RSS growth (sampled every 0.5 ms), and two
references measured in the same run: copy alone (every tensor into fresh host memory)
and write alone (DCP writing the source tensors themselves, no staging); the copy
reference copies into memory touched beforehand, as the pipeline's reused ring is.
Each round measures the references, then every budget; the medians of ``--repeat``
rounds are reported, and each run's time is compared with its own round's bound. Every
checkpoint is loaded back with plain ``dcp.load`` and compared bit for bit.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import tempfile
import textwrap
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import anyio
import torch

from async_stager._core.interp import THREAD_PREFIX

from .args import Checked, int_at_least, output_file
from .report import BenchError

__all__ = ["BudgetRow", "add_budget_parser", "run_budget_bench"]

MIB = 1 << 20


@dataclass(frozen=True)
class BudgetRow:
    """One measured save: seconds, and bytes of host memory."""

    label: str
    budget_bytes: int | None
    total_seconds: float
    fence_seconds: float
    blocked_seconds: float
    writer_wait_seconds: float
    peak_ring_bytes: int | None
    rss_growth_bytes: int
    bit_exact: bool


#: The printed lines are at most this wide.
WIDTH = 100


def _budgets(flag: str, text: str, namespace: argparse.Namespace) -> str:
    """``--budgets``: comma-separated MiB (a number > 0) or ``unlimited``."""
    parts = [p.strip() for p in text.split(",")]
    if not parts or any(not p for p in parts):
        raise ValueError(f"{flag} {text!r}: give budgets in MiB or 'unlimited', separated by commas")
    for part in parts:
        if part == "unlimited":
            continue
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"{flag}: {part!r} is not a number of MiB or 'unlimited'") from None
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{flag}: {part!r} must be a number of MiB > 0, or 'unlimited'")
    return ",".join(parts)


def _folder(flag: str, text: str, namespace: argparse.Namespace) -> str:
    """``--dir``: a folder that exists or can be created (not a file)."""
    if not text:
        raise ValueError(f"{flag}: an empty folder name")
    if os.path.exists(text) and not os.path.isdir(text):
        raise ValueError(f"{flag} {text!r} is a file, not a folder")
    return text


def add_budget_parser(sub: Any) -> None:
    """Register ``bench-budget`` and its flags; each is checked while parsing (a bad
    one is a usage error, exit status 2, before anything runs)."""
    p = sub.add_parser(
        "bench-budget",
        help="a DCP save within a host-memory budget, against copy alone and write alone",
        description=(__doc__ or "").split("\n\n")[1].replace("\n", " "),
    )
    p.add_argument(
        "--state-mib",
        action=Checked,
        convert=int_at_least(1),
        default=1024,
        metavar="N",
        help="state size in MiB, rounded down to a multiple of --tensor-mib (default 1024)",
    )
    p.add_argument(
        "--tensor-mib",
        action=Checked,
        convert=int_at_least(1),
        default=16,
        metavar="N",
        help="size of each tensor in MiB (default 16)",
    )
    p.add_argument(
        "--budgets",
        action=Checked,
        convert=_budgets,
        default="64,256,unlimited",
        metavar="A,B",
        help="comma-separated budgets in MiB, or 'unlimited'; each at least --tensor-mib "
        "(default 64,256,unlimited)",
    )
    p.add_argument(
        "--dir",
        action=Checked,
        convert=_folder,
        default=None,
        help="where to write (default: a temporary folder, removed after)",
    )
    p.add_argument(
        "--repeat",
        action=Checked,
        convert=int_at_least(1),
        default=3,
        metavar="N",
        help="rounds (default 3); medians are reported",
    )
    p.add_argument(
        "--json",
        action=Checked,
        convert=output_file(),
        default=None,
        metavar="FILE",
        help="also write every run as JSON to this file",
    )


def _parse_budgets(ns: argparse.Namespace) -> list[int | None]:
    """The budgets in bytes (None: unlimited); BenchError for one that cannot hold a
    tensor (checked before anything runs: the save would refuse it mid-run)."""
    budgets: list[int | None] = []
    for part in str(ns.budgets).split(","):
        part = part.strip()
        budgets.append(None if part == "unlimited" else int(float(part) * MIB))
    if ns.tensor_mib > ns.state_mib:
        raise BenchError(f"--tensor-mib {ns.tensor_mib} is more than --state-mib {ns.state_mib}")
    small = [b for b in budgets if b is not None and b < ns.tensor_mib * MIB]
    if small:
        raise BenchError(
            f"--budgets: {', '.join(f'{b / MIB:g}' for b in small)} MiB cannot hold one tensor of "
            f"--tensor-mib {ns.tensor_mib} MiB"
        )
    return budgets


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextmanager
def _peak_rss() -> Iterator[list[int]]:
    """Yields a one-item list that holds, afterwards, the peak RSS growth in bytes."""
    out = [0]
    base = _rss()
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            out[0] = max(out[0], _rss() - base)
            time.sleep(0.0005)

    t = threading.Thread(target=sample, name=f"{THREAD_PREFIX}rss-sample", daemon=True)
    t.start()
    try:
        yield out
    finally:
        stop.set()
        t.join()
        out[0] = max(out[0], _rss() - base)


def _state(state_mib: int, tensor_mib: int) -> dict[str, torch.Tensor]:
    n = max(1, state_mib // tensor_mib)
    numel = tensor_mib * MIB // 4
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(numel, generator=g) for i in range(n)}


def _bit_exact(path: str, sd: dict[str, torch.Tensor]) -> bool:
    import torch.distributed.checkpoint as dcp

    out = {k: torch.empty_like(v) for k, v in sd.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, checkpoint_id=path, no_dist=True)
    return all(torch.equal(out[k].view(torch.int32), v.view(torch.int32)) for k, v in sd.items())


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _copy_alone(sd: dict[str, torch.Tensor]) -> float:
    # Pre-touched: the pipeline's ring is reused, so page faults are not part of its copies.
    dst = {k: torch.zeros_like(v) for k, v in sd.items()}
    t0 = time.perf_counter()
    for k, v in sd.items():
        dst[k].copy_(v)
    return time.perf_counter() - t0


def _write_alone(sd: dict[str, torch.Tensor], path: str) -> float:
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(path, thread_count=1, per_thread_copy_ahead=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _timed(lambda: dcp.save(sd, storage_writer=writer, no_dist=True))


def _save(sd: dict[str, torch.Tensor], path: str, budget: int | None) -> BudgetRow:
    from async_stager._core.aio.stager import Stager
    from async_stager._dcp import save as adcp

    stats: list[Any] = []
    fence = [0.0]

    async def run() -> None:
        async with Stager(pin_memory=False) as stager, anyio.create_task_group() as tg:
            kw: dict[str, Any] = (
                {} if budget is None else {"host_budget_bytes": budget, "on_budget_stats": stats.append}
            )
            t0 = time.perf_counter()
            coro = adcp.save(sd, stager=stager, checkpoint_id=path, no_dist=True, **kw)

            async def go() -> None:
                await coro

            tg.start_soon(go)
            await stager.fence()
            fence[0] = time.perf_counter() - t0

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with _peak_rss() as growth:
            total = _timed(lambda: anyio.run(run))
    s = stats[0] if stats else None
    return BudgetRow(
        label="unlimited" if budget is None else f"{budget / MIB:g} MiB",
        budget_bytes=budget,
        total_seconds=total,
        fence_seconds=fence[0],
        blocked_seconds=s.blocked_seconds if s is not None else 0.0,
        writer_wait_seconds=s.writer_wait_seconds if s is not None else 0.0,
        peak_ring_bytes=s.peak_bytes if s is not None else None,
        rss_growth_bytes=growth[0],
        bit_exact=_bit_exact(path, sd),
    )


def run_budget_bench(ns: argparse.Namespace, out: Any) -> int:
    """Run the parsed ``bench-budget`` command: the rows on ``out``, every line at most
    WIDTH columns; 0 if every checkpoint loaded back bit for bit, else 1. Raises
    BenchError (before anything runs) for flags that cannot run together."""
    budgets = _parse_budgets(ns)
    sd = _state(ns.state_mib, ns.tensor_mib)
    nbytes = sum(v.numel() * v.element_size() for v in sd.values())
    root = ns.dir or tempfile.mkdtemp(prefix="async-stager-budget-")
    os.makedirs(root, exist_ok=True)
    try:
        refs: list[tuple[float, float]] = []

        def references() -> None:
            path = os.path.join(root, "write-alone")
            refs.append((_copy_alone(sd), _write_alone(sd, path)))
            shutil.rmtree(path, ignore_errors=True)

        runs: list[list[BudgetRow]] = [[] for _ in budgets]
        bounds: list[float] = []
        for _ in range(ns.repeat):  # one round: the references, then every budget
            references()
            bounds.append(max(refs[-1]))
            for i, b in enumerate(budgets):
                path = os.path.join(root, f"save{i}")
                runs[i].append(_save(sd, path, b))
                shutil.rmtree(path, ignore_errors=True)
        copy_s = statistics.median(c for c, _ in refs)
        write_s = statistics.median(w for _, w in refs)
        # Per budget: the median run (by its time over its own round's bound).
        ratios = [
            statistics.median(r.total_seconds / bd for r, bd in zip(rs, bounds, strict=True)) for rs in runs
        ]
        rows = [sorted(rs, key=lambda r: r.total_seconds)[len(rs) // 2] for rs in runs]
    finally:
        if ns.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    bound = max(copy_s, write_s)
    out.write(f"{ns.repeat} round(s); medians; /bound: the median of each run over its own round's bound\n")
    for text in (
        f"state: {len(sd)} tensors, {nbytes / MIB:.0f} MiB on the CPU",
        f"copy alone {copy_s:.3f} s, write alone {write_s:.3f} s (bound: the slower, {bound:.3f} s)",
    ):
        for line in textwrap.wrap(text, WIDTH, subsequent_indent="  "):
            out.write(line + "\n")
    out.write(
        f"{'budget':>10} {'total s':>8} {'/bound':>7} {'fence s':>8} {'blocked s':>9} {'wr wait':>7} "
        f"{'ring MiB':>9} {'RSS+ MiB':>9} {'exact':>6}\n"
    )
    for r, ratio in zip(rows, ratios, strict=True):
        ring = f"{r.peak_ring_bytes / MIB:.1f}" if r.peak_ring_bytes is not None else "-"
        out.write(
            f"{r.label:>10} {r.total_seconds:8.3f} {ratio:7.2f} {r.fence_seconds:8.3f} "
            f"{r.blocked_seconds:9.3f} {r.writer_wait_seconds:7.3f} {ring:>9} "
            f"{r.rss_growth_bytes / MIB:9.1f} {r.bit_exact!s:>6}\n"
        )
    if ns.json:
        doc = {
            "copy_alone_s": [c for c, _ in refs],
            "write_alone_s": [w for _, w in refs],
            "runs": [[asdict(r) for r in rs] for rs in runs],
        }
        try:
            with open(ns.json, "w", encoding="utf-8") as f:
                json.dump(doc, f, indent=2)
        except OSError as exc:  # it went away during the run
            raise BenchError(f"--json {ns.json!r}: {exc.strerror or exc}") from exc
    return 0 if all(r.bit_exact for rs in runs for r in rs) else 1
