"""Running the agent: its memory bound checked against the node, its command line.

``memory_limits`` decides the agent's bound at start from what the node can give
(``HostLimits``): ``MemAvailable``, the memory cgroup's headroom (memfd pages are
shmem, charged to the cgroup of the process that faults them in), descriptors left
under ``RLIMIT_NOFILE`` (the agent holds one per arena) and ``RLIMIT_FSIZE`` (an
arena is a file of its size). ``/dev/shm`` does not bound it: arenas are memfds, which
have no name and no mount size limit. ``main`` is ``python -m async_stager agent``.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from dataclasses import dataclass
from typing import TextIO

import anyio

from async_stager._core.memory.host_limits import HostLimits
from async_stager._tier.agent import Agent
from async_stager.errors import AgentError, HostLimitError

__all__ = ["AgentLimits", "add_agent_arguments", "agent_report", "main", "memory_limits", "run_agent"]

#: Descriptors the agent keeps free for connections and its own files.
SPARE_FDS = 64


@dataclass(frozen=True)
class AgentLimits:
    """What bounds an agent's memory on this node, in bytes (None: unknown or none).
    ``max_bytes``: the bound chosen (asked for, or by default half of what the tightest
    of ``mem_available`` and the cgroup's headroom allows); ``fds_free``: descriptors
    left for arenas; ``memfd``: memfd_create exists (required)."""

    max_bytes: int
    mem_available: int | None
    cgroup_headroom: int | None
    fds_free: int | None
    fsize: int | None
    memfd: bool

    def lines(self) -> list[str]:
        """One line per limit, for ``check`` and the agent's start log."""

        def b(n: int | None) -> str:
            return "unknown" if n is None else f"{n / 2**30:.2f} GiB"

        return [
            f"agent memory bound: {b(self.max_bytes)}",
            f"node MemAvailable: {b(self.mem_available)}",
            f"memory cgroup headroom: {b(self.cgroup_headroom) if self.cgroup_headroom is not None else 'no limit'}",
            f"descriptors free for arenas: {self.fds_free if self.fds_free is not None else 'no limit'}",
            f"largest arena (RLIMIT_FSIZE): {b(self.fsize) if self.fsize is not None else 'no limit'}",
            f"memfd_create: {'yes' if self.memfd else 'no (the agent cannot run)'}",
        ]


def memory_limits(max_bytes: int | None = None, limits: HostLimits | None = None) -> AgentLimits:
    """The agent's memory bound for this node: ``max_bytes`` if given and it fits, else
    half the tightest of MemAvailable and the cgroup's headroom. Raises HostLimitError
    naming the limit when ``max_bytes`` is more than it allows (or memfd_create or
    descriptors are missing): refused at the start, not as a SIGBUS or an OOM kill
    mid-job."""
    lim = limits if limits is not None else HostLimits.read()
    headroom = lim.cgroup.headroom if lim.cgroup is not None else None
    fds_free = None if lim.nofile is None else lim.nofile - lim.open_fds - SPARE_FDS
    if not lim.memfd:
        raise HostLimitError(
            "the memory agent needs memfd_create (Linux >= 3.17): arenas are handed over by descriptor",
            resource="memfd_create",
            fix="run on Linux",
        )
    if fds_free is not None and fds_free < 16:
        raise HostLimitError(
            f"RLIMIT_NOFILE leaves {fds_free} descriptors for the agent's arenas",
            resource="RLIMIT_NOFILE",
            need=16,
            limit=max(0, fds_free),
            unit="descriptors",
            fix="raise it (ulimit -n)",
        )
    room = [n for n in (lim.mem_available, headroom) if n is not None]
    if max_bytes is None:
        max_bytes = min(room) // 2 if room else 1 << 30
    for name, n in (("MemAvailable", lim.mem_available), ("memory cgroup headroom", headroom)):
        if n is not None and max_bytes > n:
            raise HostLimitError(
                f"--max-bytes {max_bytes} is more than the node's {name} ({n} bytes): the agent would be "
                "killed for memory while it holds snapshots",
                resource=name,
                need=max_bytes,
                limit=n,
                fix="give a smaller --max-bytes",
            )
    return AgentLimits(max_bytes, lim.mem_available, headroom, fds_free, lim.fsize, lim.memfd)


def agent_report(
    snapshot_bytes: int, ranks: int, out: TextIO, limits: HostLimits | None = None, keep: int = 2
) -> bool:
    """``check --agent``: the agent's limits on this node and whether ``keep`` snapshots
    of ``snapshot_bytes`` for each of ``ranks`` ranks fit its default bound. Writes the
    lines to ``out``; True if they fit."""
    try:
        lim = memory_limits(None, limits)
    except HostLimitError as exc:
        out.write(f"memory agent: cannot run: {exc}\n")
        return False
    need = keep * snapshot_bytes * ranks
    out.write("memory agent (python -m async_stager agent):\n")
    for line in lim.lines():
        out.write(f"  {line}\n")
    fits = need <= lim.max_bytes
    out.write(
        f"  needs {keep} x {snapshot_bytes / 2**30:.2f} GiB x {ranks} rank(s) = {need / 2**30:.2f} GiB: "
        f"{'fits' if fits else 'does not fit (pass a larger --max-bytes, or memory_keep=1)'}\n"
    )
    return fits


def add_agent_arguments(parser: argparse.ArgumentParser) -> None:
    """The agent's options on ``parser``."""
    parser.add_argument("--job", required=True, help="the job's id (the socket's path derives from it)")
    parser.add_argument(
        "--max-bytes",
        type=int,
        default=None,
        help="memory bound in bytes (default: half of what the node has free)",
    )
    parser.add_argument("--keep", type=int, default=2, help="complete snapshots kept per rank (default 2)")
    parser.add_argument(
        "--dir", default=None, help="the socket directory's base (default $XDG_RUNTIME_DIR or /tmp)"
    )


async def run_agent(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or SIGINT, then free everything and return 0."""
    limits = memory_limits(args.max_bytes)
    agent = Agent(args.job, max_bytes=limits.max_bytes, keep=args.keep, base=args.dir)
    log = logging.getLogger("async_stager.agent")
    for line in limits.lines():
        log.info("%s", line)
    async with anyio.create_task_group() as tg:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            await tg.start(agent.serve)
            print(
                f"async_stager agent: job {args.job} listening at {agent.path}, "
                f"at most {limits.max_bytes} bytes, keep {args.keep}",
                flush=True,
            )
            async for signum in signals:
                log.info("agent: signal %d, freeing %d bytes and exiting", signum, agent.held_bytes)
                break
            await agent.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m async_stager agent --job ID [--max-bytes N] [--keep K] [--dir D]``."""
    parser = argparse.ArgumentParser(prog="python -m async_stager agent")
    add_agent_arguments(parser)
    args = parser.parse_args(argv)
    return run(args)


def run(args: argparse.Namespace) -> int:
    """Run the agent for parsed ``args``; exit status 2 with the reason on stderr when
    it cannot start (limits, another agent on the socket)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return anyio.run(run_agent, args)
    except (AgentError, HostLimitError) as exc:
        print(f"async_stager agent: {exc}", file=sys.stderr)
        return 2
