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
from async_stager._tier.regions import PIECE_BYTES, ArenaMaps, digests_of, regions_of
from async_stager._tier.sealing import is_sealed
from async_stager._tier.wire import Kind, Message
from async_stager.errors import (
    AgentError,
    AgentRefusedError,
    AgentTimeoutError,
    AgentUnavailableError,
    IntegrityError,
)

__all__ = ["AgentClient", "AgentStatus", "Fetched", "SnapshotInfo", "verify_fetched"]

#: Bytes per second an agent is assumed to hash at least (a call's bound grows with
#: its bytes at this rate, over ``timeout``).
SLOWEST_HASH = 200e6


@dataclass(frozen=True)
class SnapshotInfo:
    """A snapshot the agent holds: its rank, step, world size, whether it is complete
    (committed and verified: the only kind handed out), its arena bytes and tensors,
    when it was accepted (Unix seconds), its namespace (the Checkpointer's folder) and
    its timeline (the job's run since its last restore: a restore combines only the
    snapshots of one run)."""

    rank: int
    step: int
    world: int
    complete: bool
    bytes: int
    tensors: int
    since: float
    ns: str = ""
    timeline: str = ""


@dataclass(frozen=True)
class AgentStatus:
    """What an agent holds: its ``pid``, ``job``, socket ``path``, memory bound and
    bytes held (bytes), ``keep`` (snapshots per rank of a trainer that is gone), arenas
    held, and every snapshot (``SnapshotInfo``, oldest commit first per rank)."""

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
    region, and what it was saved as (``rank``, ``step``, ``world``). ``sealed``: the
    agent verified it after sealing its arenas, and the kernel confirms every seal on
    these descriptors (``sealing``): its bytes cannot have changed since."""

    handle: SharedHandle
    fds: tuple[int, ...]
    digests: tuple[tuple[int, ...], ...]
    piece_bytes: int
    rank: int
    step: int
    world: int
    sealed: bool = False

    def close(self) -> None:
        """Close the descriptors (idempotent: closing one already closed is ignored)."""
        wire.close_fds(list(self.fds))


def _info(d: dict[str, Any]) -> SnapshotInfo:
    return SnapshotInfo(
        int(d["rank"]), int(d["step"]), int(d["world"]), bool(d["complete"]), int(d["bytes"]),
        int(d.get("tensors", 0)), float(d.get("since", 0.0)), str(d.get("ns", "")),
        str(d.get("timeline", "")),
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

    @property
    def connected(self) -> bool:
        """A connection to the agent is open (it answered since it was made; it may
        have gone since)."""
        return self._stream is not None

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
        floor: int | None = None,
        timeline: str = "",
    ) -> list[int]:
        """Say ``step`` (of ``timeline``) is being staged by trainer ``session`` (a token
        of this process). The agent then forgets the snapshots this session committed
        except the steps in ``protect`` (whose buffers the caller holds leased: no stage
        writes into them), the rank's complete ones older than ``floor``, the begun ones
        never committed, and other sessions' at ``step`` or later; returns the steps it
        forgot. Call it before the stage writes into a buffer it released."""
        body = {
            "rank": rank,
            "step": step,
            "world": world,
            "session": session,
            "protect": list(protect or []),
            "ns": ns,
            "floor": floor,
            "timeline": timeline,
        }
        return [int(s) for s in (await self._call(Message(Kind.BEGIN, body))).body["dropped"]]

    async def retain(
        self,
        rank: int,
        *,
        session: str = "",
        protect: list[int] | None = None,
        ns: str = "",
        floor: int | None = None,
    ) -> list[int]:
        """Let go of snapshots: the agent forgets those this session committed except
        the steps in ``protect``, and the rank's complete ones older than ``floor``;
        returns the steps it forgot (their buffers are the caller's again)."""
        body = {"rank": rank, "session": session, "protect": list(protect or []), "ns": ns, "floor": floor}
        return [int(s) for s in (await self._call(Message(Kind.RETAIN, body))).body["dropped"]]

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
        floor: int | None = None,
    ) -> None:
        """Hand snapshot ``step`` over: the arenas' descriptors (``handle.arenas``, this
        process's own), the structure and each region's digest. Returns once the agent
        verified and holds it (and forgot ``session``'s other snapshots but the steps
        in ``protect``, and the rank's older than ``floor``: their buffers are the
        caller's again); AgentRefusedError if it did not accept it. ``ns``: the
        namespace (a Checkpointer's folder)."""
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
            "floor": floor,
        }
        fds = [a.fd for a in handle.arenas]
        msg = Message(Kind.COMMIT, body, handle.payload, fds)
        await self._call(msg, self.timeout + sum(sizes) / SLOWEST_HASH)

    async def fetch(
        self, rank: int, step: int, *, ns: str = "", timeline: str | None = None, wait: float = 0.0
    ) -> Fetched:
        """Snapshot ``step`` of ``rank`` (of ``timeline``; None: the newest commit) as
        this process's descriptors (close them: ``Fetched.close``). AgentRefusedError
        ``"unknown"`` if it holds no complete one, ``"checksum"`` if its memory changed
        after its commit. ``wait``: seconds the agent may take to seal and verify it
        first (``Fetched.sealed``; the call's bound grows by as much)."""
        body: dict[str, Any] = {"rank": rank, "step": step, "ns": ns, "wait": float(wait)}
        if timeline is not None:
            body["timeline"] = timeline
        answer = await self._call(Message(Kind.FETCH, body), self.timeout + wait)
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
                b.get("sealed") is True and all(is_sealed(fd) for fd in fds),
            )
        except BaseException:
            wire.close_fds(fds)
            raise


def verify_fetched(f: Fetched) -> None:
    """Check every region of a fetched snapshot against its digest (blocking: reads
    every byte once; run it in a thread). IntegrityError names the first that differs."""
    regions = regions_of(f.handle.refs)
    if len(regions) != len(f.digests):
        raise IntegrityError(
            f"memory snapshot of step {f.step}: {len(f.digests)} digests for {len(regions)} regions",
            step=f.step,
        )
    maps = ArenaMaps()
    try:
        got = digests_of(
            maps, list(f.fds), [a.nbytes for a in f.handle.arenas], regions, f.piece_bytes or PIECE_BYTES
        )
    finally:
        maps.close()
    for region, want, have in zip(regions, f.digests, got):
        if list(want) != have:
            raise IntegrityError(
                f"memory snapshot of rank {f.rank} step {f.step}: arena {region[0]} bytes "
                f"[{region[1]}, {region[1] + region[2]}) do not match their checksum",
                step=f.step,
            )
