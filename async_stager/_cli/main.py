"""The command line: ``python -m async_stager`` (or ``async-stager``).

- ``bench``: async_stager versus PyTorch DCP's DefaultStager and the one-buffer copy
  bound, on synthetic state dicts (see docs/benchmarks.md).
- ``verify``: check committed checkpoints against their checksums (see verify.py).
- ``bench-process``: DCP's process writer (``AsyncCheckpointerType.PROCESS``) with our
  DefaultStager against DCP's own, with gloo ranks (``_cli/process.py``).
- ``bench-budget``: a DCP save within a host-memory budget (``_cli.budget``).
- ``demo``: stage a small transformer state dict twice and print what each stage did
  (the first allocates host memory; the second reuses it).
- ``check``: pre-flight: does a checkpoint of a given size fit this machine's limits?
  (exit status 1 when it does not; see ``check.py``).
- ``agent``: the memory tier's node agent (``agent.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
import textwrap
from typing import Any, TextIO

import anyio
import torch

from async_stager._core.stats import StageStats
from async_stager.errors import StagingError

from . import bench as _bench
from .args import add_arguments, options_from_args, scale_argument, unwritable
from .budget import add_budget_parser, run_budget_bench
from .check import add_check_parser, run_check
from .report import BenchError, format_table, require_matplotlib, to_json, write_plot
from .verify import add_verify_parser, run_verify
from .workloads import build_transformer, count_tensors, describe_transformer

__all__ = ["DEMO_WIDTH", "demo", "main"]


#: The demo's lines are at most this wide (wrapped, continuation lines indented).
DEMO_WIDTH = 100
#: The demo's default ``--scale``.
DEMO_SCALE = 0.25


def _say(out: TextIO, text: str) -> None:
    for line in textwrap.wrap(text, DEMO_WIDTH, subsequent_indent="    ", break_on_hyphens=False):
        out.write(line + "\n")


def _stage_line(label: str, st: StageStats, held_before: int) -> str:
    new = st.host_bytes - held_before
    return (
        f"{label}: {st.seconds * 1e3:.1f} ms, {st.bytes_per_second / 1e9:.2f} GB/s, "
        f"{st.tensors} tensors in {st.storages} storages, cache hits/misses "
        f"{st.cache_hits}/{st.cache_misses}, fast path {st.fast_path}, new host memory "
        f"{new / 2**20:.1f} MiB (held: {st.host_bytes / 2**20:.1f} MiB)"
    )


async def demo(
    scale: float, device: torch.device, out: TextIO | None = None
) -> tuple[StageStats, StageStats]:
    """Build the transformer workload at ``scale`` on ``device`` and stage it twice with
    one Stager, printing on ``out`` (default stdout) what each stage did, every line at
    most DEMO_WIDTH columns. The first result is dropped before the second stage, so the
    second reuses its buffer set (cache hits, no new host memory); a result still
    referenced would hold its buffer set and send the second stage to a new one.
    Returns both stages' StageStats. Runs on any anyio backend."""
    from async_stager._core.aio.stager import Stager

    out = out if out is not None else sys.stdout
    sd = build_transformer(scale, device)
    tensors, nbytes = count_tensors(sd)
    _say(
        out,
        f"state dict on {device}: {tensors} tensors, {nbytes / 2**20:.1f} MiB ({describe_transformer(scale)})",
    )
    async with Stager() as stager:
        opts = stager.options
        _say(
            out,
            "options: " + ", ".join(f"{f.name}={getattr(opts, f.name)!r}" for f in dataclasses.fields(opts)),
        )
        first: Any = await stager.stage(sd)
        a = stager.stats
        assert a is not None
        _say(out, _stage_line("first stage (allocates host memory)", a, 0))
        # The result holds its buffer set while it is referenced: drop it, so the
        # second stage can take that buffer set over.
        del first
        second: Any = await stager.stage(sd)
        b = stager.stats
        assert b is not None
        _say(out, _stage_line("second stage (reuses it)", b, a.host_bytes))
        w = second["model"]["embed.weight"]
        same = torch.equal(w, sd["model"]["embed.weight"].cpu())
        _say(out, f"staged embed.weight: {tuple(w.shape)} on {w.device}, equal to the source: {same}")
        del second, w
    return a, b


async def demo_checkpoint(
    scale: float, device: torch.device, directory: str, out: TextIO | None = None
) -> None:
    """Save the demo's state dict with a Checkpointer into ``directory`` (three steps)
    and show the saves' progress on stderr while they run (``_cli/watch``), then each
    commit's SaveStats on ``out``."""
    from async_stager._checkpoint.checkpointer import Checkpointer
    from async_stager._cli.watch import watch

    out = out if out is not None else sys.stdout
    sd = build_transformer(scale, device)
    async with Checkpointer(directory, keep=2) as ckpt:
        failed: Exception | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch, ckpt, sys.stderr)
            try:
                for step in (1, 2, 3):
                    await ckpt.save(sd, step=step)
                await ckpt.wait()
            except Exception as exc:  # noqa: BLE001 - raised below as it is, not in an ExceptionGroup
                failed = exc
            finally:
                tg.cancel_scope.cancel()
        if failed is not None:
            raise failed
        st = ckpt.last
        assert st is not None
        _say(
            out,
            f"checkpoint step {st.step} committed in {st.path}: {st.bytes / 2**20:.1f} MiB, staged in "
            f"{st.stage_seconds * 1e3:.1f} ms (what save() blocked), written in {st.write_seconds:.2f} s, "
            f"committed in {st.commit_seconds * 1e3:.1f} ms; kept steps {ckpt.steps()}",
        )


def _checkpoint_problem(path: str) -> str | None:
    """Why ``demo --checkpoint PATH`` cannot save into ``PATH``, found before the demo
    runs; None when it may (what only the save finds out is reported then)."""
    if not path:
        return "an empty folder name"
    if os.path.exists(path) and not os.path.isdir(path):
        return "is a file, not a folder; give a folder for the checkpoints (made if missing)"
    return None


def _one_line(exc: BaseException) -> str:
    """``exc`` as one line, with its cause's reason when the message leaves it out."""
    text = " ".join(ln.strip() for ln in str(exc).splitlines() if ln.strip()) or type(exc).__name__
    cause = exc.__cause__
    if isinstance(cause, OSError) and cause.strerror and cause.strerror not in text:
        text += f" ({cause.strerror})"
    return text


def run_cli(ns: argparse.Namespace, out: TextIO) -> int:
    """Run ``bench`` as parsed: the table on ``out`` (unless JSON goes there), JSON and
    chart files as asked. Raises BenchError for what cannot run (checked up front)."""
    opts = options_from_args(ns)
    if ns.plot:
        require_matplotlib()  # fail now, not after a minute of measuring
    # The output files were checked while parsing (a usage error); a Namespace made
    # another way gets the same check here, still before anything runs.
    for flag, path in (("--json", ns.json), ("--plot", ns.plot)):
        problem = unwritable(path) if path and path != "-" else None
        if problem is not None:
            raise BenchError(f"{flag} {path!r}: {problem}")
    report = asyncio.run(_bench.run_bench(opts, None if ns.quiet else sys.stderr))
    if ns.json == "-":
        out.write(to_json(report) + "\n")
    else:
        out.write(format_table(report, wide=getattr(ns, "wide", False)) + "\n")
        if ns.json:
            try:
                with open(ns.json, "w", encoding="utf-8") as f:
                    f.write(to_json(report) + "\n")
            except OSError as exc:  # it went away during the run
                raise BenchError(f"--json {ns.json!r}: {exc.strerror or exc}") from exc
    if ns.plot:
        try:
            write_plot(report, ns.plot)
        except OSError as exc:
            raise BenchError(f"--plot {ns.plot!r}: {exc.strerror or exc}") from exc
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="async-stager",
        description="async_stager's command line: benchmarks (bench, bench-process, bench-budget), "
        "a demo, checking saved checkpoints (verify) and a pre-flight of host limits (check). "
        "COMMAND --help says more.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser(
        "bench",
        help="benchmark against PyTorch DCP's DefaultStager",
        description="Stage synthetic state dicts with async_stager and with PyTorch DCP's DefaultStager, "
        "side by side, and report times, throughput, loop lag, host memory and file descriptors.",
    )
    add_arguments(bench)
    from . import process as _process

    _process.add_arguments(
        sub.add_parser(
            "bench-process",
            help="DCP async_save PROCESS mode: our DefaultStager against DCP's",
            description="Save with DCP's async_save in PROCESS mode (a writer daemon per rank, "
            "gloo ranks spawned here, CPU) using async_stager's DefaultStager and using DCP's own, "
            "and compare staging time, host memory, descriptors sent and bytes the pickler copied "
            "(docs/benchmarks.md).",
        )
    )
    add_budget_parser(sub)
    demo_parser = sub.add_parser(
        "demo",
        help="stage a small transformer state dict twice; the second stage reuses the host memory",
        description="Build the benchmark's transformer workload (docs/benchmarks.md): a decoder-only "
        "transformer's weights plus AdamW state (exp_avg, exp_avg_sq and a scalar step per "
        "parameter), float32, in the layout of {'model': ..., 'optim': optimizer.state_dict()}; "
        f"at the default --scale {DEMO_SCALE:g}: {describe_transformer(DEMO_SCALE)}. Stage it twice "
        "with one Stager(), dropping the first result before the second stage, and print what "
        "each stage did: the first allocates host memory, the second reuses it (cache hits, no "
        "new host memory).",
    )
    scale_argument(
        demo_parser,
        DEMO_SCALE,
        f"multiply the state dict's bytes (default {DEMO_SCALE:g}; 1: {describe_transformer(1.0)}): "
        "layers grow with X above 1/8, hidden size and vocabulary shrink below it",
    )
    demo_parser.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="then save it with a Checkpointer into DIR (three steps, the last two kept), "
        "showing the saves' progress on stderr",
    )
    demo_parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where the state dict is built (auto: CUDA when available)",
    )
    add_verify_parser(sub)
    add_check_parser(sub)
    from .agent import add_agent_parser

    add_agent_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for a usage problem: a bad flag
    is reported before anything runs)."""
    try:
        ns = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2), printed
        if exc.code is None:
            return 0
        return exc.code if isinstance(exc.code, int) else 2
    try:
        if ns.command == "bench":
            return run_cli(ns, sys.stdout)
        if ns.command == "verify":
            return run_verify(ns, sys.stdout)
        if ns.command == "check":
            return run_check(ns, sys.stdout)
        if ns.command == "agent":
            from .agent import run as run_agent

            return run_agent(ns)
        if ns.command == "bench-process":
            from . import process as _process

            return _process.run_cli(ns)
        if ns.command == "bench-budget":
            return run_budget_bench(ns, sys.stdout)
        if ns.checkpoint is not None:
            problem = _checkpoint_problem(ns.checkpoint)
            if problem is not None:  # before a minute of demo, not after
                raise BenchError(f"--checkpoint {ns.checkpoint!r}: {problem}")
        device = _bench.BenchOptions(device=ns.device).resolved_device()
        _bench.check_fits(["transformer"], ns.scale, device)
        asyncio.run(demo(ns.scale, device))
        if ns.checkpoint:
            try:
                asyncio.run(demo_checkpoint(ns.scale, device, ns.checkpoint))
            except StagingError as exc:  # a folder that cannot take them, a full disk: said in one line
                print(f"async-stager: error: demo --checkpoint: {_one_line(exc)}", file=sys.stderr)
                return 1
        return 0
    except BenchError as exc:
        print(f"async-stager: error: {exc}", file=sys.stderr)
        return 2
