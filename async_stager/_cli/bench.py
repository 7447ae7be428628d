"""``python -m async_stager bench``: async_stager versus PyTorch DCP, side by side.

For each workload (see ``workloads``) the same state dict, on the same machine in
the same run, is staged by each contender once cold (host memory allocated then) and
then ``runs`` times cached, the contenders and the one-buffer bound taking turns (the
order rotates every run) so a noisy machine slows all of them alike; the medians are
reported. Loop lag is measured while each contender stages (see ``measure``).

Contenders: ``async_stager`` (``Stager()``, ``copy_threads="auto"``: on the CPU every
core for programs mostly of big tensors and for a first stage, all cores but one
otherwise), ``async_stager[threads=N]`` (``copy_threads`` = torch's thread count, raw
throughput) and ``async_stager[threads=M]`` (all cores but one, the loop's core left
free: the other end of the frontier), both only where they differ, and ``dcp``
(DCP's ``DefaultStager``, async mode). ``limit (_foreach_copy_)`` is no stager: one
``torch._foreach_copy_`` of the same tensors into outputs that already exist, timed in
the same rounds (the report gives each stager's ratio to it).
"""

from __future__ import annotations

import collections
import functools
import gc
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

import torch

from async_stager._core.options import loop_friendly_threads, usable_cores

from .measure import (
    LIMIT,
    Contender,
    DcpContender,
    DefaultStagerContender,
    ForeachCopyLimit,
    OneBufferCopy,
    OursContender,
    dcp_available,
    idle_lag,
    open_fds,
    synchronize,
    timed_stage,
)
from .report import BenchError, BenchReport, BoundResult, StagerResult, WorkloadResult, lag_stats, median
from .workloads import WORKLOADS, count_tensors, renew

__all__ = [
    "BenchOptions",
    "Progress",
    "check_fits",
    "run_bench",
]

OURS = "async_stager"
OURS_DEFAULT_STAGER = "async_stager.DefaultStager"
DCP = "dcp"

#: Largest ``scale`` (the transformer would be about 275 TiB): beyond any machine, it
#: only keeps the size arithmetic finite; ``check_fits`` refuses what memory cannot hold.
MAX_SCALE = 1e6
#: Python and torch bookkeeping per tensor of a built state dict (bytes): a low
#: estimate, so no feasible run is refused.
TENSOR_OVERHEAD = 512


@dataclass(frozen=True)
class BenchOptions:
    """What to run. ``scale`` multiplies each workload's bytes; ``runs`` is the number of
    cached stages per contender (medians over them; large1g runs twice as many);
    ``warmup``: unreported cached rounds first; ``device`` is ``auto`` (CUDA when
    available), ``cpu`` or ``cuda``; ``all_threads``: add the ``copy_threads`` = all
    threads row (None: when that differs from the default); ``share_memory``: both
    stagers stage into shared memory; ``lag_period``: the ticker's period (seconds);
    ``idle_seconds``: how long the idle loop lag (the floor) is measured."""

    workloads: tuple[str, ...] = tuple(WORKLOADS)
    runs: int = 7
    warmup: int = 1
    scale: float = 1.0
    device: str = "auto"
    all_threads: bool | None = None
    dcp: bool = True
    share_memory: bool = False
    lag_period: float = 0.001
    idle_seconds: float = 1.0

    def check(self) -> None:
        """Raise BenchError for what cannot run as asked (before anything runs)."""
        if not self.workloads:
            raise BenchError(f"no workload given; choose from {', '.join(WORKLOADS)}")
        for w in self.workloads:
            if w not in WORKLOADS:
                raise BenchError(f"unknown workload {w!r}; choose from {', '.join(WORKLOADS)}")
        if len(set(self.workloads)) != len(self.workloads):
            raise BenchError(f"a workload is named twice in {', '.join(self.workloads)}")
        if not _is_int(self.runs) or self.runs < 1:
            raise BenchError(f"--runs must be >= 1 (an integer), got {self.runs!r}")
        if not _is_int(self.warmup) or self.warmup < 0:
            raise BenchError(f"--warmup must be >= 0 (an integer), got {self.warmup!r}")
        if not _is_real(self.scale) or not (0 < self.scale <= MAX_SCALE):
            raise BenchError(f"--scale must be a finite number > 0 and <= {MAX_SCALE:g}, got {self.scale!r}")
        if not _is_real(self.lag_period) or not (0 < self.lag_period <= 1):
            raise BenchError(f"lag_period must be > 0 and <= 1 seconds, got {self.lag_period!r}")
        if not _is_real(self.idle_seconds) or not (0 <= self.idle_seconds <= 3600):
            raise BenchError(f"idle_seconds must be >= 0 and <= 3600, got {self.idle_seconds!r}")

    def resolved_device(self) -> torch.device:
        """The device the state dicts are built on."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise BenchError("--device cuda: no CUDA device is available")
        return torch.device(self.device)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _physical_memory() -> int | None:
    """This machine's RAM (bytes), or None where it cannot be told."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:,.1f} GiB"


def check_fits(workloads: Sequence[str], scale: float, device: torch.device) -> None:
    """BenchError when a workload at ``scale`` cannot fit in this machine's memory: its
    state dict and one staged copy (host), or its state dict (a GPU's). A low estimate:
    it catches a scale that is sure to fail, before minutes of building and staging."""
    ram = _physical_memory()
    gpu = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    for name in workloads:
        tensors, nbytes = WORKLOADS[name].footprint(scale)
        host = (2 if device.type == "cpu" else 1) * nbytes + tensors * TENSOR_OVERHEAD
        if ram is not None and host > ram:
            raise BenchError(
                f"--scale {scale:g} is too large: the {name} workload needs at least {_gib(host)} of "
                f"host memory ({tensors:,} tensors, {_gib(nbytes)}, and a staged copy); "
                f"this machine has {_gib(ram)}"
            )
        if gpu is not None and nbytes > gpu:
            raise BenchError(
                f"--scale {scale:g} is too large: the {name} workload needs {_gib(nbytes)} on {device}, "
                f"which has {_gib(gpu)}"
            )


def _clock(seconds: float) -> str:
    """``m:ss`` (``h:mm:ss`` from an hour)."""
    s = max(0, round(seconds))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


@dataclass
class Progress:
    """Progress on stderr, every line at most ``width`` characters: on a terminal one
    line redrawn at each step; otherwise (a CI log, a file) one line per step, so a log
    never goes quiet for long. Each line shows the steps done, the time so far and an
    estimate of the time left (steps left at the mean pace so far), then what ran."""

    total: int
    stream: TextIO | None = field(default_factory=lambda: sys.stderr)
    done: int = 0
    width: int = 79
    _t0: float = field(default_factory=time.perf_counter)

    def line(self, phase: str, detail: str = "") -> str:
        """The progress line as of now (no newline, at most ``width`` characters)."""
        frac = min(1.0, self.done / max(1, self.total))
        elapsed = time.perf_counter() - self._t0
        eta = _clock(elapsed / self.done * (self.total - self.done)) if self.done else "?"
        bar = "#" * int(frac * 8)
        what = f"{phase} {detail}".strip()
        text = f"[{bar:<8}] {self.done}/{self.total} {_clock(elapsed)} eta {eta} {what}"
        return text[: self.width]

    def step(self, phase: str, detail: str = "") -> None:
        """One step done; ``phase`` and ``detail`` say what it was."""
        self.done += 1
        if self.stream is None:
            return
        text = self.line(phase, detail)
        if self.stream.isatty():
            self.stream.write("\r" + text.ljust(self.width))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def skip(self, steps: int) -> None:
        """Steps that will not run (a contender failed): counted as done, not shown."""
        self.done += steps

    def finish(self) -> None:
        if self.stream is not None and self.stream.isatty():
            self.stream.write("\n")
            self.stream.flush()


def _contender_makers(opts: BenchOptions, device: torch.device) -> list[tuple[str, Callable[[], Contender]]]:
    cuda = device.type == "cuda"
    makers: list[tuple[str, Callable[[], Contender]]] = [
        (OURS, lambda: OursContender(OURS, share_memory=opts.share_memory))
    ]
    threads = torch.get_num_threads()
    all_threads = opts.all_threads
    if all_threads is None:
        all_threads = not cuda and threads != loop_friendly_threads()
    if all_threads:
        for n in sorted({threads, loop_friendly_threads()}, reverse=True):
            name = f"{OURS}[threads={n}]"
            makers.append(
                (
                    name,
                    functools.partial(OursContender, name, copy_threads=n, share_memory=opts.share_memory),
                )
            )
    makers.append(
        (
            OURS_DEFAULT_STAGER,
            lambda: DefaultStagerContender(OURS_DEFAULT_STAGER, share_memory=opts.share_memory),
        )
    )
    # The copy limit (no stager: one _foreach_copy_ into existing outputs), a row like
    # the stagers', so the cached stage's ratio to it comes from the same rounds.
    makers.append((LIMIT, functools.partial(ForeachCopyLimit, device)))
    if opts.dcp:
        why = dcp_available()
        if why is not None:
            print(f"skipping DCP: {why}", file=sys.stderr)
        else:
            makers.append((DCP, lambda: DcpContender(DCP, cuda=cuda, share_memory=opts.share_memory)))
    return makers


def _runs(opts: BenchOptions, name: str) -> int:
    return opts.runs * WORKLOADS[name].runs_factor


def _steps(opts: BenchOptions, contenders: int) -> int:
    # Per workload: built, each contender's cold stage, then per round one synchronous
    # bound, one bound, and for each contender its stage and the bound after it.
    per_round = 2 + 2 * contenders
    return sum(1 + contenders + (opts.warmup + _runs(opts, w)) * per_round for w in opts.workloads)


def _paired(num: list[float], den: list[float]) -> float | None:
    """Median over rounds of ``num[i] / den[i]`` (None without rounds)."""
    ratios = [a / b for a, b in zip(num, den) if b > 0]
    return median(ratios) if ratios else None


async def _bench_workload(
    name: str,
    opts: BenchOptions,
    device: torch.device,
    makers: list[tuple[str, Callable[[], Contender]]],
    progress: Progress,
) -> WorkloadResult:
    workload = WORKLOADS[name]
    sd = workload.build(opts.scale, device)
    synchronize(device)
    tensors, nbytes = count_tensors(sd)
    bound = OneBufferCopy(nbytes, device)
    progress.step(name, f"built ({tensors:,} tensors, {nbytes / 2**20:,.1f} MiB)")
    total = opts.warmup + _runs(opts, name)
    # The first stage of the run pays the most for fresh pages: the contenders take
    # turns at going first, one workload each.
    shift = opts.workloads.index(name) % len(makers)
    live: dict[str, Contender] = {}
    cold: dict[str, tuple[float, list[float]]] = {}
    fds: dict[str, int] = {}
    errors: dict[str, str] = {}
    try:
        for cname, make in makers[shift:] + makers[:shift]:
            gc.collect()
            before = open_fds()
            try:
                c = make()
                live[cname] = c
                cold[cname] = await timed_stage(c, sd, device, opts.lag_period)
            except Exception as exc:  # noqa: BLE001 - a failing contender is a result
                errors[cname] = f"{type(exc).__name__}: {exc}"
                progress.step(name, f"cold: {cname} failed")
                progress.skip(total * 2)
                continue
            fds[cname] = open_fds() - before
            progress.step(name, f"cold: {cname}")

        # Hazard: a clone made while only the current dict is alive gets the addresses
        # freed two renewals ago back (CUDA's caching allocator, malloc too), so the
        # "new" tensors would alternate between two address sets. The last generations
        # stay alive, so each stage sees addresses it has not seen in a while.
        kept: collections.deque[Any] = collections.deque(maxlen=3)

        async def timed(c: Contender) -> tuple[float, list[float]]:
            nonlocal sd
            if workload.fresh and c is not bound:
                # New tensors for this stage (untimed); the previous ones are kept a while.
                kept.append(sd)
                sd = renew(sd)
                synchronize(device)
            gc.collect()
            return await timed_stage(c, sd, device, opts.lag_period)

        # Rounds: the contenders in an order rotating per round, each between two
        # bound copies (timed the same way). A round's reference is the median of its
        # bound copies: drift slower than a round cancels in the ratio, and a single
        # copy that caught a fast or slow moment does not count (the mean of the two
        # copies around a stage did: one fast copy among slow ones moved a ratio by
        # a tenth). The first ``warmup`` rounds are not reported.
        order = [n for n in live if n not in errors]
        times: dict[str, list[float]] = {n: [] for n in order}
        reference: list[float] = []
        lags: dict[str, list[float]] = {n: [] for n in order}
        bound_runs: list[float] = []
        bound_lag: list[float] = []
        sync_runs: list[float] = []
        for r in range(total):
            k = r % len(order) if order else 0
            report = r >= opts.warmup
            phase = "warm-up" if not report else f"{r - opts.warmup + 1}/{total - opts.warmup}"
            phase = f"{name} {phase}:"  # "transformer 3/7: async_stager" (round 3 of 7)
            gc.collect()
            sync_s = bound.run()
            progress.step(phase, "bound (calling thread)")
            first, lag = await timed(bound)
            progress.step(phase, "bound")
            round_bounds = [first]
            round_lag = lag
            round_times: dict[str, float] = {}
            round_lags: dict[str, list[float]] = {}
            for cname in order[k:] + order[:k]:
                try:
                    round_times[cname], round_lags[cname] = await timed(live[cname])
                except Exception as exc:  # noqa: BLE001 - a failing contender is a footnote
                    # DCP's DefaultStager on torch 2.11 fails here, on its second stage.
                    errors[cname] = f"{type(exc).__name__}: {exc} (stage {r + 2} of the run)"
                    progress.step(phase, f"{cname} failed")
                    progress.skip(1 + 2 * (total - r - 1))
                    continue
                progress.step(phase, cname)
                after, blag = await timed(bound)
                progress.step(phase, "bound")
                round_bounds.append(after)
                round_lag.extend(blag)
            # A contender that failed this round leaves the rounds: its times so far are
            # dropped, it is reported with its error.
            order = [n for n in order if n not in errors]
            for gone in [n for n in times if n in errors]:
                del times[gone], lags[gone]
            if report:
                sync_runs.append(sync_s)
                bound_runs.extend(round_bounds)
                bound_lag.extend(round_lag)
                reference.append(median(round_bounds))
                for cname in order:
                    times[cname].append(round_times[cname])
                    lags[cname].extend(round_lags[cname])
        bound_s = median(bound_runs)
        results: list[StagerResult] = []
        for cname, _ in makers:
            if cname in errors:
                empty = lag_stats([])
                results.append(
                    StagerResult(
                        cname, 0.0, 0.0, (), 0.0, None, None, 0.0, empty, empty, None, 0, errors[cname]
                    )
                )
                continue
            runs = times[cname]
            s = median(runs)
            results.append(
                StagerResult(
                    name=cname,
                    cold_seconds=cold[cname][0],
                    seconds=s,
                    runs=tuple(runs),
                    gbps=nbytes / s / 1e9 if s > 0 else 0.0,
                    vs_dcp=_paired(times[DCP], runs) if DCP in times and cname != DCP else None,
                    of_bound=_paired(reference, runs),
                    us_per_tensor=s / max(1, tensors) * 1e6,
                    lag=lag_stats(lags[cname]),
                    cold_lag=lag_stats(cold[cname][1]),
                    host_bytes=live[cname].host_bytes(),
                    fds=fds[cname],
                )
            )
    finally:
        for c in live.values():
            await c.close()
    return WorkloadResult(
        name=name,
        description=workload.description,
        device=str(device),
        tensors=tensors,
        bytes=nbytes,
        bound=BoundResult(
            seconds=bound_s,
            gbps=nbytes / bound_s / 1e9 if bound_s > 0 else 0.0,
            runs=tuple(bound_runs),
            sync_seconds=median(sync_runs),
            lag=lag_stats(bound_lag),
        ),
        stagers=tuple(results),
    )


def _loadavg() -> float | None:
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def machine_info(device: torch.device) -> dict[str, Any]:
    """What the numbers were measured on."""
    cores = usable_cores()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})"
    return {
        "device": name,
        "cores": cores,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch_threads": torch.get_num_threads(),
        "default_copy_threads": "auto",
        "loop_friendly_threads": loop_friendly_threads(),
        # Other processes on the machine skew every number: the 1-minute load average.
        "loadavg_1min_at_end": _loadavg(),
    }


async def run_bench(opts: BenchOptions, stream: TextIO | None = None) -> BenchReport:
    """Run every selected workload; progress on ``stream`` (None: silent). Raises
    BenchError, before anything runs, for options that cannot run (see
    ``BenchOptions.check``, ``check_fits``)."""
    opts.check()
    device = opts.resolved_device()
    check_fits(opts.workloads, opts.scale, device)
    t0 = time.perf_counter()
    load_at_start = _loadavg()
    makers = _contender_makers(opts, device)
    idle = lag_stats(await idle_lag(opts.idle_seconds, opts.lag_period))
    progress = Progress(_steps(opts, len(makers)), stream)
    results = []
    try:
        for name in opts.workloads:
            results.append(await _bench_workload(name, opts, device, makers, progress))
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        progress.finish()
    options = asdict(opts)
    options["device"] = str(device)
    options["contenders"] = [n for n, _ in makers]
    machine = machine_info(device)
    machine["loadavg_1min_at_start"] = load_at_start
    return BenchReport(
        machine=machine,
        options=options,
        idle_lag=idle,
        workloads=tuple(results),
        seconds=time.perf_counter() - t0,
    )
