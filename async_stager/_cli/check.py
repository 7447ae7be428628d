"""``python -m async_stager check``: will a checkpoint of this size stage on this machine?

The pre-flight of ``Stager.reserve`` without a state dict: the size comes from
``--bytes`` (``37.2GiB``, ``40GB``, ``1e9``) or ``--model-size`` (parameters: ``7B``,
``350M``, ``7e9``) with ``--dtype`` and ``--optimizer``; the need (``--buffer-sets``
sets of one arena each, ``--pin-memory``, ``--share-memory``) is compared with this
process's limits, and a table of need against limit is printed. Exit status 0 when
everything fits, 1 when something does not, 2 for a usage error. Each limit that does
not fit is followed by its fix (``_preflight``): for host memory, fewer buffer sets
where fewer fit, and a budgeted save (``host_budget_bytes=N``) with a concrete N.

``--model-size`` counts the state dict that ``torch.optim`` and a model save: the
weights in ``--dtype`` plus the optimizer's per-parameter states in the same dtype
(AdamW/Adam: two, ``exp_avg`` and ``exp_avg_sq``; SGD with momentum: one; none: zero).
Gradients are not part of a checkpoint. Mixed precision with fp32 master weights: pass
``--dtype fp32`` (the optimizer's copy is what is saved) or use ``--bytes``.

The node: ``--ranks-per-node K`` (default 1) judges the machine-wide limits (memory,
the cgroup, /dev/shm) against K ranks' worth (the size is one rank's), and
``--node-budget SIZE`` (``node_budget_bytes``) caps what the node maps at the budget
and checks that one rank's need fits the whole budget (ranks beyond it take turns).
"""

from __future__ import annotations

import argparse
import math
import re
import textwrap
from typing import TextIO

from async_stager._core.memory.host_limits import HostLimits
from async_stager._core.memory.preflight import Need, check, human, set_bytes
from async_stager.errors import HostLimitError

__all__ = [
    "DTYPE_BYTES",
    "OPTIMIZER_STATES",
    "add_check_parser",
    "agent_report",
    "parse_bytes",
    "parse_count",
    "run_check",
]

#: Bytes per parameter of each ``--dtype``.
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
#: Per-parameter optimizer states of each ``--optimizer`` (in the parameters' dtype).
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1, "none": 0}

_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def _parse(text: str, units: dict[str, int], what: str) -> int:
    m = _NUMBER.match(text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in units:
        raise argparse.ArgumentTypeError(
            f"{what} {text!r}: expected a number with an optional unit ({', '.join(u for u in units if u)})"
        )
    value = float(m.group(1)) * units[unit]
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{what} {text!r}: too large")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{what} {text!r}: must be more than 0")
    return math.ceil(value)


def parse_bytes(text: str) -> int:
    """``"37.2GiB"``, ``"40GB"``, ``"1e9"``, ``"512 MiB"`` as bytes (argparse type)."""
    return _parse(text, _BYTE_UNITS, "size")


def parse_count(text: str) -> int:
    """``"7B"``, ``"350M"``, ``"1.5k"``, ``"7e9"`` as a count (argparse type)."""
    return _parse(text, _COUNT_UNITS, "model size")


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return n


def _count(n: int) -> str:
    """``7000000000`` as ``7B``, ``350000000`` as ``350M`` (``parse_count``'s units)."""
    for unit, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def add_check_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``check`` and its flags on the command line's subparsers."""
    p = sub.add_parser(
        "check",
        help="will a checkpoint of this size fit this machine's limits? (pre-flight)",
        description="Compare what staging a checkpoint needs (host, pinned and shared memory, "
        "descriptors) with this process's limits (MemAvailable, the memory cgroup, RLIMIT_MEMLOCK, "
        "/dev/shm, RLIMIT_FSIZE, RLIMIT_NOFILE). Exit status 0: it fits; 1: it does not; 2: a "
        "usage error (a bad or missing option, an unreadable size).",
    )
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument(
        "--bytes", type=parse_bytes, metavar="SIZE", help="checkpoint bytes: 37.2GiB, 40GB, 1e9"
    )
    size.add_argument(
        "--model-size", type=parse_count, metavar="PARAMS", help="parameters: 7B, 350M, 7e9 (see --dtype)"
    )
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16", help="with --model-size (bf16)")
    p.add_argument(
        "--optimizer", choices=sorted(OPTIMIZER_STATES), default="none", help="with --model-size (none)"
    )
    p.add_argument("--buffer-sets", type=_positive, default=2, metavar="K", help="max_buffer_sets (2)")
    p.add_argument("--pin-memory", action="store_true", help="pinned host buffers")
    p.add_argument("--share-memory", action="store_true", help="shared-memory host buffers")
    p.add_argument(
        "--ranks-per-node",
        type=_positive,
        default=1,
        metavar="K",
        help="ranks staging alike on this machine; the size is one rank's (1)",
    )
    p.add_argument(
        "--node-budget",
        type=parse_bytes,
        default=None,
        metavar="SIZE",
        help="node_budget_bytes: one host budget shared by the node's ranks (none)",
    )
    p.add_argument(
        "--agent",
        action="store_true",
        help="also the memory tier's node agent: its memory bound on this node, and whether "
        "3 snapshots of every rank fit it (memory_keep=2, and one more while the ranks agree)",
    )


def checkpoint_bytes(ns: argparse.Namespace) -> int:
    """The checkpoint's bytes from ``--bytes`` or ``--model-size`` (see module doc)."""
    if ns.bytes is not None:
        return int(ns.bytes)
    per_param = DTYPE_BYTES[ns.dtype] * (1 + OPTIMIZER_STATES[ns.optimizer])
    return int(ns.model_size) * per_param


def run_check(ns: argparse.Namespace, out: TextIO, limits: HostLimits | None = None) -> int:
    """Print the pre-flight table for the parsed ``check`` flags; 0 if it fits, else 1.
    ``limits``: the seam (default: this process's, read now)."""
    nbytes = checkpoint_bytes(ns)
    need = Need(
        per_set=set_bytes([nbytes]),
        sets=ns.buffer_sets,
        pinned=ns.pin_memory,
        shared=ns.share_memory,
        ranks=getattr(ns, "ranks_per_node", 1),
        node_budget=getattr(ns, "node_budget", None),
    )
    report = check(need, limits if limits is not None else HostLimits.read())
    kinds = [k for k, on in (("pinned", ns.pin_memory), ("shared", ns.share_memory)) if on] or ["private"]
    source = f"{human(nbytes)} checkpoint"
    if ns.bytes is None:
        source += f" ({_count(ns.model_size)} parameters, {ns.dtype}, {ns.optimizer} optimizer)"
    out.write(f"pre-flight: {source}\n")
    out.write(f"need: {need.describe_node()} of {', '.join(kinds)} host memory\n\n")
    out.write(report.format() + "\n\n")
    short = [r for r in report.rows if r.enforced and not r.fits]
    agent_fits = True
    if getattr(ns, "agent", False):
        agent_fits = agent_report(nbytes, need.ranks, out, limits)
    if not short:
        out.write("fits: yes\n" if agent_fits else "fits: not in the memory agent\n")
        return 0 if agent_fits else 1
    for r in short:
        out.write(textwrap.fill(f"does not fit: {r.resource}: {r.fix}", 80, subsequent_indent="  ") + "\n")
    return 1


def agent_report(
    snapshot_bytes: int, ranks: int, out: TextIO, limits: HostLimits | None = None, keep: int = 2
) -> bool:
    """``check --agent``: the agent's limits on this node and whether ``keep + 1``
    snapshots of ``snapshot_bytes`` for each of ``ranks`` ranks fit its default bound
    (``memory_keep``, and one more while the ranks agree on a newer common step: the
    tier's buffer sets, which the agent holds once a trainer died). Writes the lines to
    ``out``; True if they fit."""
    from async_stager._tier.service import memory_limits

    try:
        lim = memory_limits(None, limits)
    except HostLimitError as exc:
        out.write(f"memory agent: cannot run: {exc}\n")
        return False
    slots = keep + 1
    need = slots * snapshot_bytes * ranks
    out.write("memory agent (python -m async_stager agent):\n")
    for line in lim.lines():
        out.write(f"  {line}\n")
    fits = need <= lim.max_bytes
    out.write(
        f"  needs {slots} x {snapshot_bytes / 2**30:.2f} GiB x {ranks} rank(s) = {need / 2**30:.2f} GiB "
        f"(memory_keep={keep}, and one more while the ranks agree): "
        f"{'fits' if fits else 'does not fit (pass a larger --max-bytes, or memory_keep=1)'}\n"
    )
    return fits
