"""``python -m async_stager agent``: the memory tier's node agent, and ``check --agent``.

``add_agent_parser`` registers the command and its options, each checked by argparse
(a bad value is one usage line and exit status 2, before anything starts): ``--job``
(a non-empty id), ``--max-bytes`` (a size, as ``check --bytes`` takes it: ``64MiB``,
``2GiB``, ``1e9``), ``--keep`` (an int >= 1), ``--parent`` (a running process id) and
``--idle-exit`` (seconds > 0). ``run`` starts it: a start-up failure (the node's limits,
another agent on the socket) is one line on stderr and exit status 2. The agent's
service and lifetime live in ``_tier`` (``agent``, ``service``); ``check --agent``'s
report is ``check.agent_report``.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys

import anyio

from async_stager.errors import AgentError, HostLimitError, InvalidOptionError

from .check import parse_bytes

__all__ = ["add_agent_arguments", "add_agent_parser", "run"]


def _job(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError(f"the job id must be a non-empty string, got {text!r}")
    return text


def _keep(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 (snapshots), got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 (snapshots), got {text!r}")
    return n


def _pid(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a process id, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a process id >= 1, got {text!r}")
    return n


def _seconds(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}") from None
    if not (x > 0 and math.isfinite(x)):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return x


def add_agent_arguments(parser: argparse.ArgumentParser) -> None:
    """The agent's options on ``parser``."""
    parser.add_argument(
        "--job", required=True, type=_job, help="the job's id (the socket's path derives from it)"
    )
    parser.add_argument(
        "--max-bytes",
        type=parse_bytes,
        default=None,
        metavar="SIZE",
        help="memory bound: 64MiB, 2GiB, 1e9 (default: half of what the node has free)",
    )
    parser.add_argument(
        "--keep",
        type=_keep,
        default=2,
        help="snapshots kept per rank for a trainer that is gone (default 2); a running "
        "trainer's own are bounded by its memory_keep",
    )
    parser.add_argument(
        "--dir", default=None, help="the socket directory's base (default $XDG_RUNTIME_DIR or /tmp)"
    )
    parser.add_argument(
        "--parent",
        type=_pid,
        default=None,
        metavar="PID",
        help="exit (freeing everything) once process PID has exited: the job's launcher",
    )
    parser.add_argument(
        "--idle-exit",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="exit (freeing everything) after SECONDS with no trainer connected",
    )


def add_agent_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``agent`` on the command line's subparsers."""
    add_agent_arguments(
        sub.add_parser(
            "agent",
            help="the memory tier's node agent: holds each rank's newest snapshots in memory",
            description="Serve the trainers of one job on this node: hold their memory snapshots "
            "(received by file descriptor) until the agent exits (docs/concepts.md, the memory tier). "
            "Tie it to the job with --parent PID (the launcher) or --idle-exit SECONDS.",
        )
    )


async def _run(args: argparse.Namespace) -> int:
    from async_stager._tier.agent import Agent
    from async_stager._tier.service import ParentProcess, memory_limits, serve_until_stopped

    limits = memory_limits(args.max_bytes)
    parent = ParentProcess.of(args.parent) if args.parent is not None else None
    agent = Agent(args.job, max_bytes=limits.max_bytes, keep=args.keep, base=args.dir)
    log = logging.getLogger("async_stager.agent")
    for line in limits.lines():
        log.info("%s", line)

    def ready() -> None:
        print(
            f"async_stager agent: job {args.job} listening at {agent.path}, "
            f"at most {limits.max_bytes} bytes, keep {args.keep}, pid {os.getpid()}",
            flush=True,
        )

    await serve_until_stopped(agent, parent=parent, idle_exit=args.idle_exit, on_ready=ready)
    return 0


def run(args: argparse.Namespace) -> int:
    """Run the agent for parsed ``args`` until it is stopped (exit status 0); exit
    status 2 with the reason in one line on stderr when it cannot start (the node's
    limits, another agent on the socket, a ``--parent`` that is not running)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return anyio.run(_run, args)
    except (AgentError, HostLimitError, InvalidOptionError) as exc:
        print(f"async_stager agent: {exc}", file=sys.stderr)
        return 2
