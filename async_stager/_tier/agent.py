"""The node agent: an asyncio service that holds each rank's newest snapshots in memory.

One agent per node and job (``python -m async_stager agent --job ID``), started before
the trainers. It listens on ``wire.socket_path(job)`` and serves the connections of
this user only. A trainer snapshots in two messages:

- ``BEGIN rank step session protect floor timeline``: trainer ``session`` (a token per
  process) stages ``step`` of ``timeline`` (the job's run since its last restore). The
  agent records ``step`` as begun (never handed out until it commits) and applies the
  rank's retention (below); it also forgets the snapshots of other sessions at ``step``
  or later: the job restarted below them, so they belong to a run that is gone.
- ``COMMIT rank step`` with the arenas' descriptors (SCM_RIGHTS), the structure and
  every region's digest: the agent takes the descriptors (its own duplicates: the
  memory lives while it holds them, whatever happens to the trainer), checks the
  bytes against its memory bound, re-hashes every region through its own mapping and
  accepts the snapshot as complete only if every digest matches; then the retention.
- ``RETAIN rank session protect floor``: the retention alone (a trainer letting go of
  snapshots once the ranks agreed on a newer common step).

Retention is the trainer's decision, because the promise it keeps is the job's (a step
every rank holds: ``tier``, ``retention``); the agent applies it and never cuts on its
own what a running trainer holds. Of the calling session's complete snapshots it keeps
those in ``protect`` (the trainer holds their buffers leased: no stage writes into
them; the trainer releases the others' only once it is answered). It forgets every
complete snapshot of the rank older than ``floor`` (the newest step the ranks agreed
they all hold). Snapshots of other sessions (a trainer that died: nobody writes into
them) stay for a restart; at most ``keep`` of them per rank, the newest.

``LIST`` says which snapshots are complete; ``FETCH`` hands one back (descriptors,
structure, digests) to a restarted trainer; ``STATUS`` says what is held.

Sealing (``sealing``): when a trainer's connection ends, the agent seals the arenas of
its snapshots (granted by the kernel only once no process maps them writable: the
trainer is gone) and verifies them once more; a FETCH of a snapshot so sealed and
verified says ``sealed``, and the restarted trainer loads it without re-reading it. Nothing is
written to any file system; the agent's exit (or death) closes its descriptors and the
kernel frees every arena no trainer still maps.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Callable
from typing import Any

import anyio
import anyio.abc
from anyio.abc import SocketStream

from async_stager._tier import sealing, wire
from async_stager._tier.holdings import Arena, Held
from async_stager._tier.regions import ALGORITHM, PIECE_BYTES, ArenaMaps, digests_of, regions_of
from async_stager._tier.wire import Kind, Message
from async_stager.errors import AgentError, AgentRefusedError, AgentUnavailableError, InvalidOptionError

__all__ = ["Agent", "Held"]

_log = logging.getLogger("async_stager.agent")

#: The agent's INFO log: one summary of the snapshots accepted at most this often.
SUMMARY_SECONDS = 60.0


class Agent:
    """The service's state and handlers. ``serve`` listens; ``close`` frees everything.

    ``max_bytes``: the most arena bytes held at once (arenas shared by snapshots count
    once); ``keep``: complete snapshots kept per rank for trainers that are gone (>= 1;
    a running trainer's own are bounded by its ``memory_keep``). ``peer_uid``: how a connection's uid is read (the kernel's
    ``SO_PEERCRED``; the seam a test replaces)."""

    def __init__(
        self,
        job: str,
        *,
        max_bytes: int,
        keep: int = 2,
        path: str | None = None,
        base: str | None = None,
        peer_uid: Callable[[SocketStream], int] = wire.peer_uid,
    ) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise InvalidOptionError(f"agent keep must be an int >= 1, got {keep!r}")
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise InvalidOptionError(f"agent max_bytes must be an int >= 1 (bytes), got {max_bytes!r}")
        self.job = job
        self.max_bytes = max_bytes
        self.keep = keep
        self.path = path if path is not None else wire.socket_path(job, base)
        self._peer_uid = peer_uid
        self._uid = os.getuid()
        #: (namespace, rank) -> its snapshots, oldest commit first.
        self._ranks: dict[tuple[str, int], list[Held]] = {}
        self._arenas: dict[tuple[int, int], Arena] = {}
        self._reserved = 0
        self._maps = ArenaMaps()
        self._lock = anyio.Lock()
        self._listener: anyio.abc.SocketListener | None = None
        self._sealer = sealing.Sealer(self._drop_damaged)
        self._inode: tuple[int, int] | None = None
        self.closed = False
        #: Connections accepted so far, and open now.
        self.connections = 0
        self.open_connections = 0
        self._idle_since: float | None = time.monotonic()
        #: Commits since the last summary line, and when it was logged.
        self._commits = 0
        self._summary_at: float | None = None

    # -- what is held --------------------------------------------------------------------

    @property
    def held_bytes(self) -> int:
        """Bytes of every arena held now (each once)."""
        return sum(a.nbytes for a in self._arenas.values())

    def snapshots(self, rank: int | None = None) -> list[Held]:
        """Every snapshot held (of ``rank``), oldest commit first per rank."""
        return [h for (_, r), hs in sorted(self._ranks.items()) if rank is None or r == rank for h in hs]

    def _status(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "job": self.job,
            "path": self.path,
            "max_bytes": self.max_bytes,
            "held_bytes": self.held_bytes,
            "keep": self.keep,
            "arenas": len(self._arenas),
            "snapshots": [h.info() for h in self.snapshots()],
        }

    def _forget(self, held: Held) -> None:
        """Drop a snapshot; an arena no snapshot uses any more is closed and unmapped."""
        for arena in held.arenas:
            arena.users -= 1
            if arena.users == 0:
                self._arenas.pop(arena.key, None)
                self._maps.drop(arena.key)
                wire.close_fds([arena.fd])
        held.arenas = []
        held.payload = b""

    def _retain(
        self,
        rank: tuple[str, int],
        session: str,
        protect: frozenset[int],
        floor: int | None = None,
        begin: int | None = None,
    ) -> list[int]:
        """The rank's retention (see the module doc) at a message of trainer
        ``session``: its own complete snapshots outside ``protect`` are forgotten, every
        complete one older than ``floor`` too, and of other sessions' at most ``keep``
        are kept. With ``begin`` (a BEGIN of that step): also every incomplete one (a
        begun snapshot never committed) and other sessions' at ``begin`` or later.
        Returns the steps forgotten."""
        held = self._ranks.get(rank, [])

        def kept(h: Held) -> bool:
            if not h.complete:
                return begin is None
            if floor is not None and h.step < floor:
                return False
            if h.session == session:
                return h.step in protect
            return begin is None or h.step < begin

        keep = [h for h in held if kept(h)]
        others = [h for h in keep if h.complete and h.session != session]
        if len(others) > self.keep:
            oldest = sorted(others, key=lambda h: h.step)[: len(others) - self.keep]
            keep = [h for h in keep if h not in oldest]
        gone = [h for h in held if h not in keep]
        for h in gone:
            self._forget(h)
        self._ranks[rank] = keep
        return [h.step for h in gone]

    # -- serving -------------------------------------------------------------------------

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Listen until ``stop()`` (or cancellation), then ``aclose``. ``task_status.started()``
        once the socket accepts connections. Raises AgentError if another live agent
        serves the same socket. Cancellation: stops serving and frees everything
        (shielded); ``stop()`` is the clean way (no accept is left pending)."""
        await self._bind()
        listener = self._listener
        assert listener is not None
        try:
            async with anyio.create_task_group() as tg:
                self._sealer.tg = tg
                task_status.started()
                _log.info(
                    "agent for job %r listening at %s: at most %d bytes, keeping %d snapshots per rank of a trainer gone",
                    self.job,
                    self.path,
                    self.max_bytes,
                    self.keep,
                )
                while True:
                    try:
                        stream = await listener.accept()
                    except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                        break
                    tg.start_soon(self._connection, stream)
                tg.cancel_scope.cancel()  # open connections end with the agent
        finally:
            with anyio.CancelScope(shield=True):
                await self.aclose()

    async def stop(self) -> None:
        """Stop accepting; ``serve`` then closes the connections and frees everything."""
        if self._listener is not None:
            await self._listener.aclose()

    async def _bind(self) -> None:
        if os.path.lexists(self.path):
            try:
                probe = await anyio.connect_unix(self.path)
            except OSError:
                os.unlink(self.path)  # left by an agent that died: nobody listens
            else:
                await probe.aclose()
                raise AgentError(
                    f"an agent already serves job {self.job!r} at {self.path}; stop it first",
                    socket=self.path,
                )
        old = os.umask(0o177)  # the socket is born 0600: never a moment open to others
        try:
            self._listener = await anyio.create_unix_listener(self.path)
        finally:
            os.umask(old)
        st = os.stat(self.path)
        self._inode = (st.st_dev, st.st_ino)

    async def aclose(self) -> None:
        """Stop listening, forget every snapshot (closing every descriptor, unmapping
        every arena) and remove the socket if it is still this agent's. Idempotent."""
        if self.closed:
            return
        self.closed = True
        listener, self._listener = self._listener, None
        if listener is not None:
            await listener.aclose()
        self.close_memory()
        if self._inode is not None:
            try:
                st = os.stat(self.path)
                if (st.st_dev, st.st_ino) == self._inode and stat.S_ISSOCK(st.st_mode):
                    os.unlink(self.path)
            except OSError:
                pass

    def close_memory(self) -> None:
        """Forget every snapshot now (synchronous: also for a signal's exit path)."""
        for rank in list(self._ranks):
            for h in self._ranks.pop(rank):
                self._forget(h)
        self._maps.close()
        if self._arenas:  # pragma: no cover - every arena belongs to a snapshot
            wire.close_fds([a.fd for a in self._arenas.values()])
            self._arenas.clear()

    def idle_seconds(self) -> float | None:
        """Seconds since the last trainer's connection closed (or since the start), None
        while one is open."""
        return None if self._idle_since is None else time.monotonic() - self._idle_since

    async def _connection(self, stream: SocketStream) -> None:
        self.connections += 1
        self.open_connections += 1
        self._idle_since = None
        sessions: set[str] = set()
        try:
            await self._serve_connection(stream, sessions)
        finally:
            self.open_connections -= 1
            if self.open_connections == 0:
                self._idle_since = time.monotonic()
        # The trainer may be gone: seal and verify its snapshots (``sealing``).
        await self._sealer.seal_gone(lambda: [h for h in self.snapshots() if h.session in sessions])

    async def _serve_connection(self, stream: SocketStream, sessions: set[str]) -> None:
        async with stream:
            try:
                wire.check_peer(self._peer_uid(stream), self._uid)
            except AgentRefusedError as exc:
                _log.warning("%s", exc)
                await self._answer(stream, wire.error_message(exc))
                return
            while not self.closed:
                try:
                    message = await wire.receive(stream)
                except AgentRefusedError as exc:
                    await self._answer(stream, wire.error_message(exc))
                    return
                except AgentUnavailableError:
                    return
                if message is None:
                    return
                if message.kind in (Kind.BEGIN, Kind.COMMIT, Kind.RETAIN):
                    sessions.add(str(message.body.get("session", "")))
                try:
                    answer = await self._handle(message)
                except AgentRefusedError as exc:
                    answer = wire.error_message(exc)
                except Exception as exc:  # noqa: BLE001 - a bad request must not stop the agent
                    _log.exception("agent: a %s request failed", message.kind.name)
                    answer = wire.error_message(
                        AgentRefusedError(f"the agent failed: {exc!r}", reason="internal")
                    )
                finally:
                    wire.close_fds(message.fds)  # the handler dup'ed what it keeps
                if not await self._answer(stream, answer):
                    return

    async def _answer(self, stream: SocketStream, message: Message) -> bool:
        try:
            await wire.send(stream, message)
        except AgentUnavailableError:
            return False
        finally:
            wire.close_fds(message.fds)  # FETCH's duplicates: the peer has its own now
        return True

    async def _handle(self, m: Message) -> Message:
        body = m.body
        if m.kind == Kind.HELLO:
            job = body.get("job")
            if job is not None and job != self.job:
                raise AgentRefusedError(f"this agent serves job {self.job!r}, not {job!r}", reason="job")
            return Message(Kind.OK, self._status())
        if m.kind == Kind.STATUS:
            return Message(Kind.OK, self._status())
        if m.kind == Kind.LIST:
            rank, ns = body.get("rank"), body.get("ns")
            found = [h for h in self.snapshots(rank) if ns is None or h.ns == ns]
            return Message(Kind.OK, {"snapshots": [h.info() for h in found]})
        if m.kind == Kind.BEGIN:
            return await self._begin(body)
        if m.kind == Kind.COMMIT:
            return await self._commit(m)
        if m.kind == Kind.FETCH:
            return await self._fetch(body)
        if m.kind == Kind.RETAIN:
            return await self._retain_request(body)
        raise AgentRefusedError(f"a {m.kind.name} message is not a request", reason="request")

    async def _begin(self, body: dict[str, Any]) -> Message:
        rank, step, world = (
            wire.int_field(body, "rank"),
            wire.int_field(body, "step"),
            wire.int_field(body, "world", 1),
        )
        who = (str(body.get("ns", "")), rank)
        session = str(body.get("session", ""))
        protect, floor = wire.retention_of(body)
        async with self._lock:
            dropped = self._retain(who, session, protect, floor, begin=step)
            timeline = str(body.get("timeline", ""))
            self._ranks[who].append(Held(rank, step, world, session=session, ns=who[0], timeline=timeline))
        if dropped:
            _log.debug("rank %d begins step %d: forgot steps %s", rank, step, dropped)
        return Message(Kind.OK, {"dropped": dropped})

    async def _retain_request(self, body: dict[str, Any]) -> Message:
        rank = wire.int_field(body, "rank")
        who = (str(body.get("ns", "")), rank)
        protect, floor = wire.retention_of(body)
        async with self._lock:
            dropped = self._retain(who, str(body.get("session", "")), protect, floor)
        if dropped:
            _log.debug("rank %d lets go of steps %s", rank, dropped)
        return Message(Kind.OK, {"dropped": dropped})

    async def _commit(self, m: Message) -> Message:
        body = m.body
        rank, step, world = (
            wire.int_field(body, "rank"),
            wire.int_field(body, "step"),
            wire.int_field(body, "world", 1),
        )
        who = (str(body.get("ns", "")), rank)
        sizes = body.get("arenas")
        refs = body.get("refs")
        digests = body.get("digests")
        piece = body.get("piece_bytes", PIECE_BYTES)
        if (
            not isinstance(sizes, list)
            or not all(isinstance(n, int) and n > 0 for n in sizes)
            or len(sizes) != len(m.fds)
            or not isinstance(refs, list)
            or not isinstance(digests, list)
            or body.get("algorithm", ALGORITHM) != ALGORITHM
            or not isinstance(piece, int)
            or piece <= 0
        ):
            raise AgentRefusedError(
                f"a malformed COMMIT for rank {rank} step {step}: {len(m.fds)} descriptors for "
                f"arenas {sizes!r}, algorithm {body.get('algorithm')!r}",
                reason="request",
            )
        protect, floor = wire.retention_of(body)
        regions = regions_of(refs)
        if len(digests) != len(regions):
            raise AgentRefusedError(
                f"rank {rank} step {step}: {len(digests)} digests for {len(regions)} regions",
                reason="request",
            )
        async with self._lock:
            pending = self._pending(who, step)
            if pending.world != world:
                self._drop_pending(pending)
                raise AgentRefusedError(
                    f"rank {rank} step {step} began with world size {pending.world}, commits with {world}",
                    reason="request",
                )
            keys = []
            for fd, n in zip(m.fds, sizes):
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_size < n:
                    self._drop_pending(pending)
                    raise AgentRefusedError(
                        f"rank {rank} step {step}: a descriptor is not an arena of {n} bytes",
                        reason="request",
                    )
                keys.append((st.st_dev, st.st_ino))
            new = sum(n for k, n in dict(zip(keys, sizes)).items() if k not in self._arenas)
            if self.held_bytes + self._reserved + new > self.max_bytes:
                self._drop_pending(pending)
                raise AgentRefusedError(
                    f"rank {rank} step {step} needs {new} more bytes; the agent holds "
                    f"{self.held_bytes} of at most {self.max_bytes} (--max-bytes)",
                    reason="memory",
                )
            self._reserved += new
        try:
            maps = ArenaMaps()
            try:
                got = await anyio.to_thread.run_sync(lambda: digests_of(maps, m.fds, sizes, regions, piece))
            except (ValueError, OSError) as exc:
                raise AgentRefusedError(f"rank {rank} step {step}: {exc}", reason="request") from exc
            finally:
                maps.close()
            bad = [r for r, want, have in zip(regions, digests, got) if [int(x) for x in want] != have]
            async with self._lock:
                if bad or pending.complete or pending not in self._ranks.get(who, []):
                    self._drop_pending(pending)
                    if bad:
                        raise AgentRefusedError(
                            f"rank {rank} step {step}: {len(bad)} of {len(regions)} regions do not match "
                            f"their checksums (first: arena {bad[0][0]}, offset {bad[0][1]}, "
                            f"{bad[0][2]} bytes): the snapshot changed after it was hashed",
                            reason="checksum",
                        )
                    raise AgentRefusedError(
                        f"rank {rank} step {step} was superseded while it was verified", reason="request"
                    )
                for fd, key, n in zip(m.fds, keys, sizes):
                    arena = self._arenas.get(key)
                    if arena is None:
                        arena = self._arenas[key] = Arena(os.dup(fd), n, key)
                    arena.users += 1
                    pending.arenas.append(arena)
                pending.meta = {
                    k: body[k] for k in ("refs", "digests", "tensors", "nbytes", "piece_bytes") if k in body
                }
                pending.meta["arenas"] = sizes
                pending.payload = m.blob
                pending.complete = True
                pending.since = time.time()
                # The committing trainer releases its other snapshots' buffers now: of
                # its own, only this one and those it still holds leased (``protect``)
                # are safe from its next stage.
                self._retain(who, pending.session, protect | {step}, floor)
        finally:
            self._reserved -= new
        self._logged(rank, step, int(body.get("tensors", 0)), pending.bytes)
        return Message(Kind.OK, {"complete": True, "held_bytes": self.held_bytes})

    def _logged(self, rank: int, step: int, tensors: int, nbytes: int) -> None:
        """One DEBUG line per snapshot; at INFO the first one, then a summary at most
        every ``SUMMARY_SECONDS`` (a snapshot every step would flood the log)."""
        _log.debug(
            "holding rank %d step %d (%d tensors, %d arena bytes); %d of %d bytes held",
            rank,
            step,
            tensors,
            nbytes,
            self.held_bytes,
            self.max_bytes,
        )
        self._commits += 1
        now = time.monotonic()
        if self._summary_at is not None and now - self._summary_at < SUMMARY_SECONDS:
            return
        held = self.snapshots()
        _log.info(
            "%d snapshot(s) accepted%s; holding %d of %d bytes: %s",
            self._commits,
            "" if self._summary_at is None else f" in the last {now - self._summary_at:.0f} s",
            self.held_bytes,
            self.max_bytes,
            ", ".join(f"rank {h.rank} step {h.step}" for h in held if h.complete) or "nothing",
        )
        self._commits = 0
        self._summary_at = now

    def _pending(self, key: tuple[str, int], step: int) -> Held:
        rank = key[1]
        for h in self._ranks.get(key, []):
            if h.step == step and not h.complete:
                return h
        raise AgentRefusedError(
            f"rank {rank} step {step} was not begun (or was superseded): BEGIN before COMMIT",
            reason="request",
        )

    async def _drop_damaged(self, h: Held) -> None:
        async with self._lock:
            held = self._ranks.get((h.ns, h.rank), [])
            if h in held:
                held.remove(h)
                self._forget(h)

    def _drop_pending(self, pending: Held) -> None:
        held = self._ranks.get((pending.ns, pending.rank), [])
        if pending in held and not pending.complete:
            held.remove(pending)
            self._forget(pending)

    async def _fetch(self, body: dict[str, Any]) -> Message:
        """The snapshot's descriptors, structure and digests; ``sealed`` if it is sealed
        and verified after the seal. A FETCH's ``wait`` (seconds): how long to wait for
        that verification (started now if the kernel grants the seal)."""
        rank, step = wire.int_field(body, "rank"), wire.int_field(body, "step")
        timeline, wait = body.get("timeline"), body.get("wait", 0)
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait < 3600:
            raise AgentRefusedError(f"wait must be seconds in [0, 3600), got {wait!r}", reason="request")
        key = (str(body.get("ns", "")), rank)
        for h in reversed(self._ranks.get(key, [])):
            if h.step == step and h.complete and (timeline is None or h.timeline == timeline):
                await self._sealer.seal_now(h, wait)
                if h.seal.damaged:
                    raise AgentRefusedError(
                        f"rank {rank} step {step}: its regions do not match their checksums after "
                        "its seal (its memory changed after the commit was verified)",
                        reason="checksum",
                    )
                if not (h.complete and h.arenas and h in self._ranks.get(key, [])):
                    break  # forgotten while it was verified
                meta = dict(h.meta)
                meta.update(h.info())
                meta["sealed"] = h.seal.verified
                fds = [os.dup(a.fd) for a in h.arenas]
                return Message(Kind.OK, meta, h.payload, fds)
        raise AgentRefusedError(f"no complete snapshot of rank {rank} step {step}", reason="unknown")
