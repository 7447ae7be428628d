"""The trainer's side of the agent: an async client, every call bounded in time.

``AgentClient(job)`` talks to the agent of ``job`` on this node (``wire.socket_path``).
It connects on first use and after a broken connection (a restarted agent is used
again), runs one call at a time, and bounds each call: ``timeout`` seconds, or what the
call's bytes need (``commit``/``fetch``: the agent hashes every byte). A call that
does not finish in time closes the connection (so a late answer is never read as the
next call's) and raises AgentTimeoutError; no agent raises AgentUnavailableError; an
agent's refusal raises AgentRefusedError with its reason. Works on any anyio backend.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import anyio
from anyio.abc import SocketStream

from async_stager._share.handoff import SharedArenaRef, SharedHandle
from async_stager._tier import wire
from async_stager._tier.wire import Kind, Message
from async_stager.errors import AgentError, AgentRefusedError, AgentTimeoutError, AgentUnavailableError

__all__ = ["AgentClient", "AgentStatus", "Fetched", "SnapshotInfo"]

#: Bytes per second an agent is assumed to hash at least (a call's bound grows with
#: its bytes at this rate, over ``timeout``).
SLOWEST_HASH = 200e6


@dataclass(frozen=True)
class SnapshotInfo:
    """A snapshot the agent holds: its rank, step, world size, whether it is complete
    (committed and verified: the only kind handed out), its arena bytes and tensors,
    and when it was accepted (Unix seconds)."""

    rank: int
    step: int
    world: int
    complete: bool
    bytes: int
    tensors: int
    since: float
    ns: str = ""


@dataclass(frozen=True)
class AgentStatus:
    """What an agent holds: its ``pid``, ``job``, socket ``path``, memory bound and
    bytes held (bytes), ``keep`` per rank, arenas held, and every snapshot."""

    pid: int
    job: str
    path: str
    max_bytes: int
    held_bytes: int
    keep: int
    arenas: int
    snapshots: tuple[SnapshotInfo, ...]


@dataclass(frozen=True)
class Fetched:
    """A snapshot handed back: ``handle`` names this process's own descriptors (close
    them with ``close()`` once attached: a mapping keeps the memory), ``digests`` per
    region, and what it was saved as (``rank``, ``step``, ``world``)."""

    handle: SharedHandle
    fds: tuple[int, ...]
    digests: tuple[tuple[int, ...], ...]
    piece_bytes: int
    rank: int
    step: int
    world: int

    def close(self) -> None:
        """Close the descriptors (idempotent: closing one already closed is ignored)."""
        wire.close_fds(list(self.fds))


def _info(d: dict[str, Any]) -> SnapshotInfo:
    return SnapshotInfo(
        int(d["rank"]), int(d["step"]), int(d["world"]), bool(d["complete"]), int(d["bytes"]),
        int(d.get("tensors", 0)), float(d.get("since", 0.0)), str(d.get("ns", "")),
    )  # fmt: skip


def _tuples(x: Any) -> Any:
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


class AgentClient:
    """A connection to the agent of ``job`` (or at ``path``). ``timeout``: seconds a
    small call may take (connect included). Use ``async with``, or ``aclose()``."""

    def __init__(
        self,
        job: str | None = None,
        *,
        path: str | None = None,
        timeout: float = 5.0,
        base: str | None = None,
    ) -> None:
        if path is None:
            if job is None:
                raise AgentError("AgentClient needs a job id or a socket path")
            path = wire.socket_path(job, base)
        if not (isinstance(timeout, (int, float)) and timeout > 0 and math.isfinite(timeout)):
            from async_stager.errors import InvalidOptionError

            raise InvalidOptionError(
                f"the agent timeout must be a positive number of seconds, got {timeout!r}"
            )
        self.job = job
        self.path = path
        self.timeout = float(timeout)
        self._stream: SocketStream | None = None
        self._lock: anyio.Lock | None = None

    async def __aenter__(self) -> AgentClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection (the agent keeps everything it holds). Idempotent."""
        stream, self._stream = self._stream, None
        if stream is not None:
            with anyio.CancelScope(shield=True):
                await stream.aclose()

    async def _call(self, message: Message, seconds: float | None = None) -> Message:
        """Send ``message`` and return the agent's OK answer, within ``seconds``.
        Cancellation: the connection is closed (its state is unknown), nothing else."""
        if self._lock is None:
            self._lock = anyio.Lock()
        bound = self.timeout if seconds is None else seconds
        answer: Message | None = None
        async with self._lock:
            try:
                with anyio.fail_after(bound):
                    if self._stream is None:
                        try:
                            self._stream = await anyio.connect_unix(self.path)
                        except OSError as exc:
                            raise AgentUnavailableError(
                                f"no agent at {self.path} ({exc.strerror or exc}): start one with "
                                f"`python -m async_stager agent --job {self.job or 'JOB'}`",
                                socket=self.path,
                            ) from exc
                    await wire.send(self._stream, message)
                    answer = await wire.receive(self._stream)
            except TimeoutError:
                await self.aclose()
                raise AgentTimeoutError(
                    f"the agent at {self.path} did not answer a {message.kind.name} within {bound:.1f} s",
                    socket=self.path,
                    seconds=bound,
                ) from None
            except AgentError as exc:
                await self.aclose()
                exc.socket = self.path
                raise
            except BaseException:
                await self.aclose()
                raise
        if answer is None:
            await self.aclose()
            raise AgentUnavailableError(f"the agent at {self.path} closed the connection", socket=self.path)
        if answer.kind == Kind.ERROR:
            wire.close_fds(answer.fds)
            reason = str(answer.body.get("reason", ""))
            if reason == "peer":
                await self.aclose()
            raise AgentRefusedError(
                f"the agent at {self.path} refused: {answer.body.get('message', '')}",
                socket=self.path,
                reason=reason,
            )
        return answer

    # -- calls -------------------------------------------------------------------------

    async def status(self) -> AgentStatus:
        """What the agent holds now."""
        b = (await self._call(Message(Kind.STATUS))).body
        return AgentStatus(
            int(b["pid"]), str(b["job"]), str(b["path"]), int(b["max_bytes"]), int(b["held_bytes"]),
            int(b["keep"]), int(b["arenas"]), tuple(_info(s) for s in b["snapshots"]),
        )  # fmt: skip

    async def hello(self) -> AgentStatus:
        """Check that the agent serves this job (AgentRefusedError ``"job"`` if not)."""
        msg = Message(Kind.HELLO, {"job": self.job} if self.job is not None else {})
        b = (await self._call(msg)).body
        return AgentStatus(
            int(b["pid"]), str(b["job"]), str(b["path"]), int(b["max_bytes"]), int(b["held_bytes"]),
            int(b["keep"]), int(b["arenas"]), tuple(_info(s) for s in b["snapshots"]),
        )  # fmt: skip

    async def snapshots(self, rank: int | None = None, *, ns: str | None = None) -> list[SnapshotInfo]:
        """The snapshots held (of ``rank``, in namespace ``ns``), complete or not,
        oldest commit first."""
        body: dict[str, Any] = {} if rank is None else {"rank": rank}
        if ns is not None:
            body["ns"] = ns
        return [_info(s) for s in (await self._call(Message(Kind.LIST, body))).body["snapshots"]]

    async def begin(
        self,
        rank: int,
        step: int,
        world: int,
        *,
        session: str = "",
        protect: list[int] | None = None,
        ns: str = "",
    ) -> list[int]:
        """Say ``step`` is being staged by trainer ``session`` (a token of this
        process): the agent forgets the snapshots this session committed except the
        steps in ``protect`` (whose buffers the caller holds leased: no stage writes
        into them), then keeps the rank's newest ``keep - 1`` complete ones; returns
        the steps it forgot. Call it before the stage writes."""
        body = {
            "rank": rank,
            "step": step,
            "world": world,
            "session": session,
            "protect": list(protect or []),
            "ns": ns,
        }
        return [int(s) for s in (await self._call(Message(Kind.BEGIN, body))).body["dropped"]]

    async def commit(
        self,
        rank: int,
        step: int,
        world: int,
        handle: SharedHandle,
        digests: list[list[int]],
        piece_bytes: int,
        *,
        session: str = "",
        protect: list[int] | None = None,
        ns: str = "",
    ) -> None:
        """Hand snapshot ``step`` over: the arenas' descriptors (``handle.arenas``, this
        process's own), the structure and each region's digest. Returns once the agent
        verified and holds it (and forgot ``session``'s other snapshots but the steps
        in ``protect``: their buffers are the caller's again); AgentRefusedError if it
        did not accept it. ``ns``: the namespace (a Checkpointer's folder)."""
        sizes = [a.nbytes for a in handle.arenas]
        body = {
            "rank": rank,
            "step": step,
            "world": world,
            "arenas": sizes,
            "refs": [list(r) for r in handle.refs],
            "digests": digests,
            "piece_bytes": piece_bytes,
            "tensors": handle.tensors,
            "nbytes": handle.nbytes,
            "session": session,
            "protect": list(protect or []),
            "ns": ns,
        }
        fds = [a.fd for a in handle.arenas]
        msg = Message(Kind.COMMIT, body, handle.payload, fds)
        await self._call(msg, self.timeout + sum(sizes) / SLOWEST_HASH)

    async def fetch(self, rank: int, step: int, *, ns: str = "") -> Fetched:
        """Snapshot ``step`` of ``rank`` as this process's descriptors (close them:
        ``Fetched.close``). AgentRefusedError ``"unknown"`` if it holds no complete one."""
        answer = await self._call(Message(Kind.FETCH, {"rank": rank, "step": step, "ns": ns}))
        b, fds = answer.body, answer.fds
        try:
            sizes = [int(n) for n in b["arenas"]]
            if len(sizes) != len(fds):
                raise AgentRefusedError(f"{len(fds)} descriptors for {len(sizes)} arenas", reason="request")
            pid = os.getpid()
            arenas = []
            for fd, n in zip(fds, sizes):
                st = os.fstat(fd)
                arenas.append(SharedArenaRef(pid=pid, fd=fd, nbytes=n, dev=st.st_dev, ino=st.st_ino))
            handle = SharedHandle(
                arenas=tuple(arenas),
                payload=answer.blob,
                refs=tuple(_tuples(r) for r in b["refs"]),
                tensors=int(b.get("tensors", 0)),
                nbytes=int(b.get("nbytes", 0)),
            )
            return Fetched(
                handle,
                tuple(fds),
                tuple(tuple(int(x) for x in d) for d in b["digests"]),
                int(b.get("piece_bytes", 0)),
                int(b["rank"]),
                int(b["step"]),
                int(b["world"]),
            )
        except BaseException:
            wire.close_fds(fds)
            raise
