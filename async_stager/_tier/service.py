"""Running the agent: its memory bound checked against the node, and its lifetime.

``memory_limits`` decides the agent's bound at start from what the node can give
(``HostLimits``): ``MemAvailable``, the memory cgroup's headroom (memfd pages are
shmem, charged to the cgroup of the process that faults them in), descriptors left
under ``RLIMIT_NOFILE`` (the agent holds one per arena) and ``RLIMIT_FSIZE`` (an
arena is a file of its size). ``/dev/shm`` does not bound it: arenas are memfds, which
have no name and no mount size limit.

``serve_until_stopped`` runs an agent until SIGTERM or SIGINT, or until the job is
gone: ``parent`` (a process id: the agent exits once that process has exited, found
by its start time, so a reused id is not mistaken for it) and ``idle_exit`` (seconds
with no trainer connected). An agent outlives its trainers on purpose (it holds their
memory for a restart), but never its job: tie it to the job's launcher, or bound its
idle time. The command line (``python -m async_stager agent``) is ``_cli.agent``.
"""

from __future__ import annotations

import logging
import math
import signal
from collections.abc import Callable
from dataclasses import dataclass

import anyio

from async_stager._core.aio.signals import SignalCatcher
from async_stager._core.memory.host_limits import HostLimits
from async_stager._tier.agent import Agent
from async_stager.errors import HostLimitError, InvalidOptionError

__all__ = ["AgentLimits", "ParentProcess", "memory_limits", "serve_until_stopped"]

_log = logging.getLogger("async_stager.agent")

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


@dataclass(frozen=True)
class ParentProcess:
    """A process the agent lives no longer than: its id and its start time (clock ticks
    after boot, ``/proc/PID/stat`` field 22), so that a later process given the same id
    is not taken for it."""

    pid: int
    start: int

    @classmethod
    def of(cls, pid: int) -> ParentProcess:
        """The running process ``pid``; InvalidOptionError if there is none."""
        if isinstance(pid, bool) or not isinstance(pid, int) or pid < 1:
            raise InvalidOptionError(f"--parent must be a process id >= 1, got {pid!r}")
        start = _start_time(pid)
        if start is None:
            raise InvalidOptionError(f"--parent {pid}: no such process")
        return cls(pid, start)

    def alive(self) -> bool:
        return _start_time(self.pid) == self.start


def _start_time(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or ')'.
    fields = stat[stat.rindex(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):  # a zombie has exited: only its exit status is left
        return None
    return int(fields[19])


async def serve_until_stopped(
    agent: Agent,
    *,
    parent: ParentProcess | None = None,
    idle_exit: float | None = None,
    poll: float = 0.5,
    on_ready: Callable[[], None] | None = None,
) -> str:
    """Serve ``agent`` until SIGTERM or SIGINT, until ``parent`` has exited, or until no
    trainer has been connected for ``idle_exit`` seconds (counted from the start, and
    from each time the last connection closed); then free everything. Returns why it
    stopped (``"signal 15"``, ``"parent 1234 exited"``, ``"idle 600 s"``). ``on_ready``
    runs once the socket accepts connections. Cancellation: frees everything
    (shielded), as ``Agent.serve``."""
    if idle_exit is not None and not (idle_exit > 0 and math.isfinite(idle_exit)):
        raise InvalidOptionError(f"--idle-exit must be a positive number of seconds, got {idle_exit!r}")
    why = ""
    stopping = anyio.CancelScope()

    def on_signal(signum: int) -> None:
        nonlocal why
        if not why:
            why = f"signal {signum}"
            _log.info("agent: %s, freeing %d bytes and exiting", why, agent.held_bytes)
        stopping.cancel()

    # Caught the way a Checkpointer's ``Shutdown`` catches them (``SignalCatcher``): an
    # agent served in a trainer's process never leaves its ``Shutdown`` deaf, nor the
    # other way round; both hear a SIGTERM.
    with stopping:
        async with SignalCatcher((signal.SIGTERM, signal.SIGINT), on_signal):
            why = await _serve(agent, parent, idle_exit, poll, on_ready) or why
    _log.info("agent for job %r stopped (%s) and freed what it held", agent.job, why)
    return why


async def _serve(
    agent: Agent,
    parent: ParentProcess | None,
    idle_exit: float | None,
    poll: float,
    on_ready: Callable[[], None] | None,
) -> str:
    """Serve until the parent exits or the idle bound passes (the reason), or until
    cancelled (a signal: the caller's scope)."""
    why = ""
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            nonlocal why
            while True:
                await anyio.sleep(poll)
                if parent is not None and not parent.alive():
                    why = f"parent {parent.pid} exited"
                    break
                idle = agent.idle_seconds()
                if idle_exit is not None and idle is not None and idle >= idle_exit:
                    why = f"idle {idle_exit:g} s with no trainer connected"
                    break
            tg.cancel_scope.cancel()

        await tg.start(agent.serve)
        if parent is not None or idle_exit is not None:
            tg.start_soon(watch)
        if on_ready is not None:
            on_ready()
        await anyio.sleep_forever()
    return why
