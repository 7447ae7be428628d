"""The ``bench`` subcommand's flags: each is checked while the command line is parsed,
so a bad one is a usage error (exit status 2) before anything runs."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

from .bench import MAX_SCALE, BenchOptions
from .workloads import WORKLOADS

__all__ = [
    "Checked",
    "add_arguments",
    "int_at_least",
    "options_from_args",
    "output_file",
    "scale_argument",
    "unwritable",
]


class Checked(argparse.Action):
    """A flag whose text ``convert(flag, text, namespace)`` turns into its value; a
    ValueError from it is a usage error (the message, exit status 2), raised while the
    command line is parsed, before anything runs."""

    def __init__(
        self, option_strings: Sequence[str], dest: str, *, convert: Callable[..., Any], **kwargs: Any
    ) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.convert = convert

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        flag = max(self.option_strings, key=len) if self.option_strings else self.dest
        try:
            value = self.convert(flag, str(values), namespace)
        except ValueError as exc:
            parser.error(str(exc))
        setattr(namespace, self.dest, value)


def int_at_least(minimum: int) -> Callable[[str, str, argparse.Namespace], int]:
    """A ``Checked`` converter: an integer >= ``minimum``."""

    def convert(flag: str, text: str, namespace: argparse.Namespace) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"{flag} must be an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise ValueError(f"{flag} must be >= {minimum}, got {text!r}")
        return value

    return convert


def _scale(flag: str, text: str, namespace: argparse.Namespace) -> float:
    allowed = f"{flag} must be a finite number > 0 and <= {MAX_SCALE:g}"
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{allowed}, got {text!r}") from None
    if not math.isfinite(value) or not (0 < value <= MAX_SCALE):
        raise ValueError(f"{allowed}, got {text!r}")
    return value


def scale_argument(parser: argparse.ArgumentParser, default: float, help: str) -> None:
    """``--scale X``: a finite number in (0, MAX_SCALE], checked while parsing."""
    parser.add_argument("--scale", action=Checked, convert=_scale, default=default, metavar="X", help=help)


def _workloads(flag: str, text: str, namespace: argparse.Namespace) -> str:
    names = [w.strip() for w in text.split(",") if w.strip()]
    choose = f"choose from {', '.join(WORKLOADS)}"
    if not names:
        raise ValueError(f"{flag} names no workload ({text!r}); {choose}")
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown:
        what = "workload" if len(unknown) == 1 else "workloads"
        raise ValueError(f"{flag}: unknown {what} {', '.join(map(repr, unknown))}; {choose}")
    twice = sorted({w for w in names if names.count(w) > 1})
    if twice:
        raise ValueError(f"{flag} names {', '.join(map(repr, twice))} more than once")
    return ",".join(names)


def _output_file(
    other: str | None, *, stdout: bool, chart: bool = True
) -> Callable[[str, str, argparse.Namespace], str]:
    """An output file flag: ``-`` (when ``stdout``) or a file that can be written now,
    and not the file ``other`` (the other output flag's dest) names; ``chart``: without
    ``stdout``, a chart file (its extension a format matplotlib writes)."""

    def convert(flag: str, text: str, namespace: argparse.Namespace) -> str:
        if text == "-":
            if stdout:
                return text
            raise ValueError(f"{flag} cannot write to stdout ('-'); give a file name")
        problem = unwritable(text)
        if problem is not None:
            raise ValueError(f"{flag} {text!r}: {problem}")
        taken = getattr(namespace, other, None) if other else None
        if taken and taken != "-" and os.path.realpath(taken) == os.path.realpath(text):
            raise ValueError(f"{flag} {text!r}: the same file as --{other}")
        if not stdout and chart:
            _check_plot_format(flag, text)
        return text

    return convert


def output_file() -> Callable[[str, str, argparse.Namespace], str]:
    """A ``Checked`` converter for a plain output file (not ``-``): one that can be
    written (created or replaced) now."""
    return _output_file(None, stdout=False, chart=False)


def unwritable(path: str) -> str | None:
    """Why ``path`` cannot be written (created or replaced) now; None if it can."""
    if not path:
        return "an empty file name"
    if os.path.isdir(path):
        return "is a folder; give a file name"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"the folder {folder!r} does not exist"
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            return "the file is not writable"
    elif not os.access(folder, os.W_OK | os.X_OK):
        return f"cannot create a file in the folder {folder!r} (permission denied)"
    return None


def _check_plot_format(flag: str, path: str) -> None:
    """A chart file name matplotlib can write (its extension picks the format; none:
    PNG). Without matplotlib there is nothing to check here: ``run_cli`` says how to
    get it."""
    ext = os.path.splitext(path)[1][1:].lower()
    if not ext:
        return
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        return
    formats = FigureCanvasBase.get_supported_filetypes()
    if ext not in formats:
        raise ValueError(
            f"{flag} {path!r}: cannot write a chart as .{ext}; use one of: {', '.join(sorted(formats))}"
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` subcommand's flags. Each is checked while the command line is
    parsed (a bad one is a usage error, exit status 2, before anything runs): integers
    in range, a finite positive scale, known workloads, writable output files."""
    parser.add_argument(
        "--workloads",
        action=Checked,
        convert=_workloads,
        default=",".join(WORKLOADS),
        metavar="A,B",
        help=f"comma-separated, from: {', '.join(WORKLOADS)} (default: all)",
    )
    parser.add_argument(
        "--runs",
        action=Checked,
        convert=int_at_least(1),
        default=BenchOptions.runs,
        metavar="N",
        help="reported cached rounds (default 7; twice as many for large1g); medians over them",
    )
    parser.add_argument(
        "--warmup",
        action=Checked,
        convert=int_at_least(0),
        default=BenchOptions.warmup,
        metavar="N",
        help="unreported cached rounds first",
    )
    scale_argument(parser, 1.0, "multiply every workload's bytes (default 1)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument(
        "--all-threads",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="add a row with copy_threads = torch's thread count (default: on the CPU when it differs)",
    )
    parser.add_argument("--no-dcp", dest="dcp", action="store_false", help="skip PyTorch DCP's DefaultStager")
    parser.add_argument("--share-memory", action="store_true", help="both stagers stage into shared memory")
    parser.add_argument(
        "--json",
        action=Checked,
        convert=_output_file("plot", stdout=True),
        metavar="FILE",
        help="write the results as JSON ('-' for stdout)",
    )
    parser.add_argument(
        "--plot",
        action=Checked,
        convert=_output_file("json", stdout=False),
        metavar="FILE.png",
        help="write a chart (needs matplotlib: async_stager[plot])",
    )
    parser.add_argument(
        "--wide",
        action="store_true",
        help="one table with every column (about 190 characters wide; default: two tables "
        "per workload that fit 80 columns)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines")


def options_from_args(ns: argparse.Namespace) -> BenchOptions:
    return BenchOptions(
        workloads=tuple(w.strip() for w in ns.workloads.split(",") if w.strip()),
        runs=ns.runs,
        warmup=ns.warmup,
        scale=ns.scale,
        device=ns.device,
        all_threads=ns.all_threads,
        dcp=ns.dcp,
        share_memory=ns.share_memory,
    )
