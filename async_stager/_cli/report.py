"""Benchmark results: frozen records, the text table, JSON and the chart.

Units: seconds, bytes, GB/s (10^9 bytes per second), milliseconds for loop lag,
microseconds for per-tensor cost. Ratios are chosen so that bigger is better for us:
``vs_dcp`` is DCP's seconds over ours (3.0: we are three times faster), ``of_bound`` is
the bound's seconds over ours (1.0: as fast as one copy of one contiguous buffer).

Both ratios are paired: each is taken within one round (DCP's stage and ours in the
same round; for the bound, the median of the round's bound copies, one before the first
stage and one after each), and the median over the rounds is reported. A shared
machine's memory bandwidth drifts by tens of percent within seconds; pairing cancels
the drift that a ratio of two medians over the whole run would keep.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BenchError",
    "BenchReport",
    "BoundResult",
    "LIMIT_ROW",
    "LagStats",
    "StagerResult",
    "WorkloadResult",
    "format_table",
    "lag_stats",
    "of_limit",
    "require_matplotlib",
    "to_json",
    "write_plot",
]

SCHEMA_VERSION = 2


class BenchError(Exception):
    """A benchmark that cannot run as asked (bad flag, missing optional dependency)."""


@dataclass(frozen=True)
class LagStats:
    """Lateness (ms) of a 1 ms asyncio ticker: how long past its due time each tick ran."""

    p50_ms: float
    p99_ms: float
    max_ms: float
    samples: int


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation between closest ranks."""
    if not sorted_values:
        return 0.0
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def lag_stats(lateness_seconds: Sequence[float]) -> LagStats:
    """Summarize tick lateness samples (seconds) as p50/p99/max in milliseconds."""
    s = sorted(max(0.0, x) * 1e3 for x in lateness_seconds)
    return LagStats(
        p50_ms=_percentile(s, 0.50),
        p99_ms=_percentile(s, 0.99),
        max_ms=s[-1] if s else 0.0,
        samples=len(s),
    )


@dataclass(frozen=True)
class BoundResult:
    """One ``dst.copy_(src)`` of one contiguous buffer of the workload's bytes
    (on a GPU: device to pinned host). ``seconds`` is the median of ``runs``, timed
    like the stagers (in a worker thread, the ticker running; ``lag`` is the ticker's
    lateness meanwhile); ``sync_seconds`` is the median of the same copy on the
    calling thread with nothing else running (one per round)."""

    seconds: float
    gbps: float
    runs: tuple[float, ...]
    sync_seconds: float
    lag: LagStats


@dataclass(frozen=True)
class StagerResult:
    """One stager on one workload.

    ``cold_seconds``: the first stage (allocates host memory); ``seconds``: median of the
    cached stages in ``runs``; ``gbps``: bytes over ``seconds``; ``vs_dcp`` and
    ``of_bound``: medians over the rounds of DCP's or the bound's seconds over ours in
    that round (see the module docstring); ``us_per_tensor``: ``seconds`` over the tensor count;
    ``lag``: ticker lateness during the cached stages; ``cold_lag``: during the first;
    ``host_bytes``: host memory held after staging (None if the stager does not say);
    ``fds``: file descriptors opened by the stager and still held after staging;
    ``error``: why it failed (then the numbers are zero).
    """

    name: str
    cold_seconds: float
    seconds: float
    runs: tuple[float, ...]
    gbps: float
    vs_dcp: float | None
    of_bound: float | None
    us_per_tensor: float
    lag: LagStats
    cold_lag: LagStats
    host_bytes: int | None
    fds: int
    error: str | None = None


@dataclass(frozen=True)
class WorkloadResult:
    """All stagers and the bound on one workload (same state dict, same run)."""

    name: str
    description: str
    device: str
    tensors: int
    bytes: int
    bound: BoundResult
    stagers: tuple[StagerResult, ...]


@dataclass(frozen=True)
class BenchReport:
    """A whole benchmark run: the machine, the options, the idle loop lag, the results."""

    machine: dict[str, Any]
    options: dict[str, Any]
    idle_lag: LagStats
    workloads: tuple[WorkloadResult, ...]
    seconds: float
    schema_version: int = SCHEMA_VERSION


def median(values: Sequence[float]) -> float:
    """The median (0.0 for no values)."""
    return float(statistics.median(values)) if values else 0.0


def to_json(report: BenchReport) -> str:
    """The report as indented JSON (every dataclass as an object)."""
    return json.dumps(dataclasses.asdict(report), indent=2, sort_keys=False)


#: The default table's lines fit a terminal this wide (``--wide``: one wider table).
WIDTH = 80


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _fit(value: float, decimals: int, width: int) -> str:
    """``value`` with ``decimals`` decimals, fewer where that would be wider than
    ``width`` (a slow machine's 12345.67 ms becomes 12345.7, then 12346)."""
    for d in range(decimals, -1, -1):
        text = f"{value:.{d}f}"
        if len(text) <= width:
            return text
    return text


def _lag_pair(lag: LagStats) -> str:
    """p99 and max (ms), both with the same decimals: two below 100 ms, one below
    1000, none above (``0.57/4.80``, ``98.6/118.6``)."""
    top = max(lag.p99_ms, lag.max_ms)
    d = 2 if top < 100 else 1 if top < 1000 else 0
    return f"{lag.p99_ms:.{d}f}/{lag.max_ms:.{d}f}"


def _lag_triple(lag: LagStats) -> str:
    """p50 (two decimals), then p99 and max as ``_lag_pair`` shows them."""
    return f"{_fit(lag.p50_ms, 2, 5)}/{_lag_pair(lag)}"


def _table(columns: Sequence[tuple[str, str]], rows: Sequence[Sequence[str]]) -> list[str]:
    """A fixed-width table with Markdown-compatible pipes; ``columns`` are
    (header, ``<`` or ``>``) pairs."""
    headers = [c for c, _ in columns]
    widths = [max(len(headers[i]), *(len(r[i]) for r in rows)) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        out = [
            cell.ljust(width) if align == "<" else cell.rjust(width)
            for (_, align), cell, width in zip(columns, cells, widths)
        ]
        return "| " + " | ".join(out) + " |"

    sep = (
        "|"
        + "|".join(
            ("-" * (w + 1) + ":" if a == ">" else ":" + "-" * (w + 1)) for (_, a), w in zip(columns, widths)
        )
        + "|"
    )
    return [line(headers), sep, *(line(r) for r in rows)]


def _header(report: BenchReport) -> list[str]:
    """What the numbers were measured on, in lines of at most WIDTH characters."""
    m = report.machine
    idle = report.idle_lag
    parts = [
        f"device {m.get('device')}, {m.get('cores')} cores, torch {m.get('torch')}, python {m.get('python')}",
        f"runs {report.options.get('runs')}, scale {report.options.get('scale')}, {report.seconds:.0f} s in all; "
        f"load {m.get('loadavg_1min_at_start')}->{m.get('loadavg_1min_at_end')} (1-minute average)",
        f"idle loop lag p50/p99/max {_lag_triple(idle)} ms",
        "ms: median cached stage; cold: the first stage; lag: how late a 1 ms asyncio "
        "ticker woke while staging (ms); see docs/benchmarks.md",
    ]
    return [ln for p in parts for ln in textwrap.wrap(p, WIDTH, subsequent_indent="  ")]


class _Footnotes:
    """Numbered notes under the tables (a contender's failure: its message can be long)."""

    def __init__(self) -> None:
        self.notes: list[str] = []
        self._numbers: dict[tuple[str, str], int] = {}

    def mark(self, workload: str, s: StagerResult) -> str:
        key = (workload, s.name)
        if key not in self._numbers:
            self.notes.append(f"{s.name} failed on {workload}: {s.error}")
            self._numbers[key] = len(self.notes)
        return f"[{self._numbers[key]}]"

    def lines(self) -> list[str]:
        out: list[str] = []
        for i, note in enumerate(self.notes, 1):
            out += textwrap.wrap(f"[{i}] {note}", WIDTH, subsequent_indent="    ", break_on_hyphens=False)
        return out


_SPEED = (
    ("stager", "<"),
    ("cold ms", ">"),
    ("ms", ">"),
    ("GB/s", ">"),
    ("vs DCP", ">"),
    ("of bound", ">"),
)
_LOOP = (
    ("stager", "<"),
    ("lag p99/max", ">"),
    ("cold p99/max", ">"),
    ("host MiB", ">"),
    ("fds", ">"),
)


def _narrow(report: BenchReport, notes: _Footnotes) -> list[str]:
    """Per workload, two tables of at most WIDTH characters: times and ratios; loop lag
    (ms) and what the stager holds."""
    out: list[str] = []
    for w in report.workloads:
        speed: list[tuple[str, ...]] = []
        loop: list[tuple[str, ...]] = []
        for s in w.stagers:
            if s.error is not None:
                mark = notes.mark(w.name, s)
                speed.append((s.name, "failed", mark, "", "", ""))
                loop.append((s.name, "failed", mark, "", ""))
                continue
            speed.append(
                (
                    s.name,
                    _fit(s.cold_seconds * 1e3, 1, 7),
                    _fit(s.seconds * 1e3, 2, 7),
                    _fit(s.gbps, 2, 6),
                    "-" if s.vs_dcp is None else _fit(s.vs_dcp, 2, 6) + "x",
                    _fmt(s.of_bound, ".2f"),
                )
            )
            host = "-" if s.host_bytes is None else _fit(s.host_bytes / 2**20, 1, 8)
            loop.append((s.name, _lag_pair(s.lag), _lag_pair(s.cold_lag), host, str(s.fds)))
        b = w.bound
        speed.append(("bound (1 buffer)", "", _fit(b.seconds * 1e3, 2, 7), _fit(b.gbps, 2, 6), "", "1.00"))
        loop.append(("bound (1 buffer)", _lag_pair(b.lag), "", "", ""))
        out += [
            "",
            *textwrap.wrap(
                f"{w.name}: {w.tensors:,} tensors, {w.bytes / 2**20:.1f} MiB on {w.device}", WIDTH
            ),
            *_table(_SPEED, speed),
            "",
            *_table(_LOOP, loop),
        ]
        limits = _limit_lines(w)
        out += ["", *limits] if limits else []
    return out


_WIDE = (
    ("workload", "<"),
    ("stager", "<"),
    ("tensors", ">"),
    ("MiB", ">"),
    ("cold ms", ">"),
    ("ms", ">"),
    ("GB/s", ">"),
    ("vs DCP", ">"),
    ("of bound", ">"),
    ("us/tensor", ">"),
    ("lag p50/p99/max ms", ">"),
    ("cold lag p99/max", ">"),
    ("host MiB", ">"),
    ("fds", ">"),
)


#: The name of the copy limit's row (as ``measure.LIMIT``; the report reads results only).
LIMIT_ROW = "limit (_foreach_copy_)"


def of_limit(w: WorkloadResult) -> dict[str, float]:
    """Per stager of ``w`` that did not fail: the median over the rounds of its
    stage's seconds over the copy limit's (``limit (_foreach_copy_)``) in the same
    round; empty without a limit row. 1.5 means half again the bare copy."""
    limit = next((s for s in w.stagers if s.name == LIMIT_ROW and s.error is None), None)
    if limit is None:
        return {}
    out = {}
    for s in w.stagers:
        if s is limit or s.error is not None:
            continue
        ratios = [a / b for a, b in zip(s.runs, limit.runs) if b > 0]
        if ratios:
            out[s.name] = median(ratios)
    return out


def _limit_lines(w: WorkloadResult) -> list[str]:
    """``of limit: async_stager 1.52x, ...`` and each stager's loop lag p50/p99/max (ms)
    while staging (wrapped to WIDTH)."""
    ratios = of_limit(w)
    if not ratios:
        return []
    text = ", ".join(f"{name} {r:.2f}x" for name, r in ratios.items())
    lags = ", ".join(
        f"{s.name} {s.lag.p50_ms:.2f}/{s.lag.p99_ms:.2f}/{s.lag.max_ms:.2f}"
        for s in w.stagers
        if s.error is None and s.name != LIMIT_ROW
    )
    return [
        *textwrap.wrap(f"{w.name}, stage over the copy limit: {text}", WIDTH, subsequent_indent="  "),
        *textwrap.wrap(f"{w.name}, lag p50/p99/max ms: {lags}", WIDTH, subsequent_indent="  "),
    ]


def _wide(report: BenchReport, notes: _Footnotes) -> list[str]:
    """One table, every column, one row per stager and workload plus the bound."""
    rows: list[tuple[str, ...]] = []
    for w in report.workloads:
        mib = f"{w.bytes / 2**20:.1f}"
        for s in w.stagers:
            if s.error is not None:
                rows.append((w.name, s.name, str(w.tensors), mib, "failed", notes.mark(w.name, s), *[""] * 8))
                continue
            host = "-" if s.host_bytes is None else f"{s.host_bytes / 2**20:.1f}"
            rows.append(
                (
                    w.name,
                    s.name,
                    str(w.tensors),
                    mib,
                    f"{s.cold_seconds * 1e3:.1f}",
                    f"{s.seconds * 1e3:.2f}",
                    f"{s.gbps:.2f}",
                    _fmt(s.vs_dcp, ".2f") + ("x" if s.vs_dcp is not None else ""),
                    _fmt(s.of_bound, ".2f"),
                    f"{s.us_per_tensor:.2f}",
                    _lag_triple(s.lag),
                    _lag_pair(s.cold_lag),
                    host,
                    str(s.fds),
                )
            )
        b = w.bound
        bound = (w.name, "bound (1 buffer)", "1", mib, "", f"{b.seconds * 1e3:.2f}", f"{b.gbps:.2f}")
        rows.append((*bound, "", "1.00", "", _lag_triple(b.lag), "", "", ""))
    limits = [line for w in report.workloads for line in _limit_lines(w)]
    return ["", *_table(_WIDE, rows), *(["", *limits] if limits else [])]


def format_table(report: BenchReport, *, wide: bool = False) -> str:
    """The report as text: a header describing the machine, then per workload two
    tables (times and ratios; loop lag and memory), every line at most WIDTH (80)
    characters; a contender that failed has a numbered footnote with its error.
    ``wide``: one table with every column (about 190 characters wide), as
    docs/benchmarks.md shows. The tables use Markdown-compatible pipes."""
    notes = _Footnotes()
    body = _wide(report, notes) if wide else _narrow(report, notes)
    foot = notes.lines()
    return "\n".join([*_header(report), *body, *(["", *foot] if foot else [])])


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or a BenchError saying how to get it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise BenchError(
            "--plot needs matplotlib, which is not installed; install the optional extra: "
            "pip install 'async_stager[plot]'"
        ) from exc
    return plt


def write_plot(report: BenchReport, path: str) -> None:
    """A PNG with two panels per run: throughput (GB/s) of each stager and the bound per
    workload, and the event-loop lag (p99 and max, ms, log scale) per stager."""
    plt = require_matplotlib()
    names = [w.name for w in report.workloads]
    stagers: list[str] = []
    for w in report.workloads:
        for s in w.stagers:
            if s.name not in stagers:
                stagers.append(s.name)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 5.5))
    series = [*stagers, "bound (1 buffer)"]
    width = 0.8 / len(series)
    for k, label in enumerate(series):
        vals = []
        for w in report.workloads:
            if label == "bound (1 buffer)":
                vals.append(w.bound.gbps)
            else:
                vals.append(next((s.gbps for s in w.stagers if s.name == label), 0.0))
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(names))]
        ax1.bar(xs, vals, width, label=label)
    ax1.set_xticks(range(len(names)), names)
    ax1.set_ylabel("GB/s (cached stage, median)")
    ax1.set_yscale("log")
    ax1.set_title(f"Throughput on {report.machine.get('device')}")
    ax1.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
    width = 0.8 / max(1, len(stagers))
    for k, label in enumerate(stagers):
        p99 = []
        mx = []
        for w in report.workloads:
            found = next((s for s in w.stagers if s.name == label), None)
            p99.append(max(found.lag.p99_ms, 1e-3) if found else 1e-3)
            mx.append(max(found.lag.max_ms, 1e-3) if found else 1e-3)
        xs = [i + (k - (len(stagers) - 1) / 2) * width for i in range(len(names))]
        bars = ax2.bar(xs, p99, width, label=f"{label} p99")
        ax2.scatter(xs, mx, marker="v", color=bars.patches[0].get_facecolor(), zorder=3, label=f"{label} max")
    ax2.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="1 ms goal (p99)")
    ax2.set_xticks(range(len(names)), names)
    ax2.set_yscale("log")
    ax2.set_ylabel("1 ms ticker lateness while staging, ms")
    ax2.set_title("Event-loop lag (bar: p99, marker: max)")
    ax2.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
