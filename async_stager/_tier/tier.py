"""A trainer's memory tier: snapshots handed to the node agent, restored from it.

``MemoryTier.save(sd, step)`` costs the caller the stage only: the stage into this
tier's own Stager, whose arenas are memfds (``share_memory=True``; pinned as well where
a CUDA device copies into them): the memory the copies land in is the memory handed
over, by descriptor, with no second copy. In the background: BEGIN (the agent lists
the step as being written), the staged regions hashed (a thread), COMMIT; the agent
re-hashes them and holds them.

Buffers: the tier's Stager has 2 buffer sets: one complete snapshot, one being
written. The tier holds the newest complete snapshot's lease, so no stage writes into
it; the agent, at each COMMIT, forgets the committing trainer's older snapshots, whose
buffers the tier releases once the COMMIT is answered. So the agent never holds as
complete a snapshot whose buffers a stage may be writing. (After a failure, where
what the agent holds is unknown, the next save BEGINs, and the agent forgets, before
the stage writes.) When a save comes while the previous one is still being staged or
committed (both sets busy), ``policy`` applies: ``"skip"`` returns False at once,
``"wait"`` waits for the commit.

Failures never stop training: an agent that is gone or too slow (AgentUnavailableError,
AgentTimeoutError) turns the tier off with one warning (saves return False; the
Checkpointer's disk saves go on), and it is tried again ``retry_seconds`` later (a
restarted agent starts empty and is used again). A snapshot the agent refuses (its
memory bound, checksums) is logged and not held.

Restore: ``complete_steps`` (what the agent holds for this rank, of this world size)
and ``load(step)``: the snapshot's descriptors, verified against its digests here
(every byte read once), attached without a copy. The caller decides the step with the
other ranks (never a step mixed from memory and disk: ``_checkpoint`` does that).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
import warnings
import weakref
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import anyio.abc

from async_stager._core.aio.lease import Lease
from async_stager._core.aio.stager import Stager
from async_stager._core.aio.threads import run_in_thread
from async_stager._share.handoff import AttachedStateDict, attach_shared, export_shared
from async_stager._tier.client import AgentClient, Fetched
from async_stager._tier.regions import PIECE_BYTES, ArenaMaps, digests_of, regions_of
from async_stager.errors import (
    AgentError,
    AgentTimeoutError,
    AgentUnavailableError,
    IntegrityError,
    InvalidOptionError,
)

__all__ = ["MemoryStats", "MemoryTier", "TierProgress"]

_log = logging.getLogger("async_stager.checkpoint")


@dataclass(frozen=True)
class MemoryStats:
    """The memory tier's counts and its newest snapshot, seconds and bytes.

    ``saved``: snapshots the agent accepted; ``skipped``: saves dropped by
    ``"skip"`` (the previous snapshot was still committing) or while the agent was
    away; ``refused``: snapshots the agent did not accept; ``failures``: times the
    agent was found gone or too slow. ``last_step``, ``stage_seconds`` (what the newest
    save blocked its caller for: BEGIN and stage), ``commit_seconds`` (its hashing and
    the agent's verification, in the background), ``bytes`` (its tensor bytes);
    ``available``: the tier is on (False after a failure, until its retry);
    ``restored``: the step the last ``Checkpointer.restore`` took from memory (None: none
    did)."""

    saved: int = 0
    skipped: int = 0
    refused: int = 0
    failures: int = 0
    last_step: int | None = None
    stage_seconds: float = 0.0
    commit_seconds: float = 0.0
    bytes: int = 0
    available: bool = True
    restored: int | None = None


@dataclass(frozen=True)
class TierProgress:
    """A memory snapshot in flight: its step, phase (``"memory-staging"`` or
    ``"memory-committing"``), seconds since its save was called, and the stage's
    seconds (None while staging)."""

    step: int
    phase: str
    seconds: float
    staged_seconds: float | None


class MemoryTier:
    """One rank's snapshots to the node agent ``client``. ``rank``/``world``: this
    process's place (a snapshot of one world size never restores in another);
    ``policy``: ``"wait"`` or ``"skip"`` when both buffer sets are busy; ``stager``:
    one with ``share_memory=True`` and at least 2 buffer sets (else its own);
    ``retry_seconds``: how long the tier stays off after the agent failed."""

    def __init__(
        self,
        client: AgentClient,
        *,
        rank: int = 0,
        world: int = 1,
        policy: Literal["wait", "skip"] = "wait",
        stager: Stager | None = None,
        retry_seconds: float = 30.0,
        keep: int = 2,
        namespace: str = "",
    ) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise InvalidOptionError(f"memory_keep must be an int >= 1 (snapshots), got {keep!r}")
        if policy not in ("wait", "skip"):
            raise InvalidOptionError(f"the memory tier's policy must be 'wait' or 'skip', got {policy!r}")
        if stager is not None and (
            not stager.options.share_memory or stager.options.max_buffer_sets < keep + 1
        ):
            raise InvalidOptionError(
                f"the memory tier needs a Stager(share_memory=True, max_buffer_sets>={keep + 1}): its arenas are "
                f"handed to the agent by descriptor, {keep} complete while the next is written"
            )
        self.keep = keep
        #: Snapshots of another namespace (another Checkpointer folder) never restore here.
        self.namespace = namespace
        self.client = client
        self.rank = rank
        self.world = world
        self.policy = policy
        self.retry_seconds = retry_seconds
        self._stager = stager
        self._own_stager = stager is None
        #: The newest ``keep`` complete snapshots' buffers (step, lease), oldest first.
        self._held: list[tuple[int, Lease[Any]]] = []
        #: This process's token: the agent tells our snapshots from a dead trainer's.
        self.session = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        #: Set while a snapshot is being staged or committed (the busy slot).
        self._busy: anyio.Event | None = None
        #: After a failure or refusal: BEGIN before the next stage writes.
        self._dirty = False
        self._progress: tuple[int, str, float, float | None] | None = None
        #: Steps not taken: skipped by the policy or while the agent was away.
        self.dropped: list[int] = []
        #: Calls whose stage has not read its sources yet (``fence``).
        self._unread: set[anyio.Event] = set()
        self._tg: anyio.abc.TaskGroup | None = None
        self._down_until = 0.0
        self._stats = MemoryStats()

    @property
    def stats(self) -> MemoryStats:
        return self._stats

    @property
    def stager(self) -> Stager:
        if self._stager is None:
            self._stager = Stager(share_memory=True, max_buffer_sets=self.keep + 1)
        return self._stager

    @property
    def available(self) -> bool:
        """The tier takes snapshots now (not off after a failure)."""
        on = time.monotonic() >= self._down_until
        if on and not self._stats.available:
            self._update(available=True)
        return on

    def _update(self, **changes: Any) -> None:
        from dataclasses import replace

        self._stats = replace(self._stats, **changes)

    def open(self, tg: anyio.abc.TaskGroup) -> None:
        """Commits run as tasks of ``tg`` (the Checkpointer's)."""
        self._tg = tg

    async def aclose(self) -> None:
        """Wait for a commit in flight, release the held snapshot (the agent keeps its
        own descriptors: the memory stays with the agent), close the connection and
        this tier's Stager. Cancellation: shielded."""
        with anyio.CancelScope(shield=True):
            while self._busy is not None:
                await self._busy.wait()
            self._release_held()
            await self.client.aclose()
            if self._own_stager and self._stager is not None:
                await self._stager.aclose()
                self._stager = None

    async def wait(self) -> None:
        """Until no snapshot is being staged or committed. Cancellation: only the wait."""
        while self._busy is not None:
            await self._busy.wait()

    def _release_held(self) -> None:
        held, self._held = self._held, []
        for _, lease in held:
            lease.release()

    def in_flight(self) -> list[TierProgress]:
        """The snapshot being staged or committed, if any (a snapshot; no I/O)."""
        if self._progress is None:
            return []
        step, phase, called, staged = self._progress
        return [TierProgress(step, phase, time.monotonic() - called, staged)]

    @property
    def busy(self) -> bool:
        """A snapshot is being staged or committed (its slot and the held one are both
        in use: a save now meets the policy)."""
        return self._busy is not None

    def _fail(self, exc: AgentError, step: int) -> None:
        """The agent is gone or too slow: off until the retry, one warning."""
        was = self.available
        self._down_until = time.monotonic() + self.retry_seconds
        self._update(failures=self._stats.failures + 1, available=False)
        self._dirty = True
        self._release_held()
        if was:
            warnings.warn(
                f"memory snapshot of step {step} failed ({exc}); memory checkpoints are off for "
                f"{self.retry_seconds:g} s, saves to disk go on",
                RuntimeWarning,
                stacklevel=3,
            )
        _log.warning("memory tier: step %d: %s; disk only for %g s", step, exc, self.retry_seconds)

    def save(self, sd: dict[str, Any], step: int) -> Coroutine[Any, Any, bool]:
        """Snapshot ``sd`` (a resolved state dict) as ``step``; await the returned
        coroutine: True once staged, False when not taken (``"skip"`` while the
        previous snapshot is still being committed, or the agent is away). The
        snapshot point is this call, except that a ``"wait"`` save behind a busy slot
        stages once the slot frees. The commit goes on in the background.

        Cancellation (or a coroutine never awaited): nothing is handed to the agent;
        a snapshot never committed is never complete there."""
        if not self.available:
            return self._skip(step)
        if self._busy is not None and self.policy == "skip":
            return self._skip(step)
        called = time.monotonic()
        stage: Coroutine[Any, Any, Lease[Any]] | None = None
        busy = None
        if self._busy is None and not self._dirty:
            busy = self._busy = anyio.Event()
            stage = self.stager.lease(sd)  # submitted now: the snapshot point
            sd = {}
        started = [False]
        read = anyio.Event()  # set once this call read its sources, or never will
        self._unread.add(read)
        coro = self._finish(stage, sd, step, called, started, read)
        # Never awaited: the slot must not stay busy for ever, nor a fence wait for it.
        weakref.finalize(coro, self._abandon, busy, started, read)
        return coro

    def _abandon(self, busy: anyio.Event | None, started: list[bool], read: anyio.Event) -> None:
        if started[0]:
            return
        self._unread.discard(read)
        read.set()
        if busy is not None and self._busy is busy:
            self._busy = None
            busy.set()

    def fence(self) -> Coroutine[Any, Any, None]:
        """Wait until every snapshot called so far has read its sources (its stage,
        also one still waiting for a busy slot): after this they may change. The
        stager's ordering points are read at this call. Cancellation: only the wait."""
        stager_fence = self._stager.fence() if self._stager is not None else None
        pending = [e for e in self._unread if not e.is_set()]

        async def fenced() -> None:
            if stager_fence is not None:
                await stager_fence
            for e in pending:
                await e.wait()

        return fenced()

    async def _skip(self, step: int) -> bool:
        self._update(skipped=self._stats.skipped + 1)
        self.dropped.append(step)
        await anyio.lowlevel.checkpoint()
        return False

    async def _finish(
        self,
        stage: Coroutine[Any, Any, Lease[Any]] | None,
        sd: dict[str, Any],
        step: int,
        called: float,
        started: list[bool],
        read: anyio.Event,
    ) -> bool:
        started[0] = True
        try:
            return await self._stage_and_commit(stage, sd, step, called)
        finally:
            self._unread.discard(read)
            read.set()

    async def _stage_and_commit(
        self, stage: Coroutine[Any, Any, Lease[Any]] | None, sd: dict[str, Any], step: int, called: float
    ) -> bool:
        # This call's slot: set at the call when staged there, else once it is free.
        busy = self._busy if stage is not None else None
        try:
            if stage is None:
                while self._busy is not None:
                    await self._busy.wait()
                busy = self._busy = anyio.Event()
                if self._dirty and not await self._begin(step):
                    raise _NotTaken
                self._dirty = False
                stage = self.stager.lease(sd)
                del sd
            self._progress = (step, "memory-staging", called, None)
            lease = await stage
        except _NotTaken:
            self._end(busy)
            return False
        except BaseException:
            if stage is not None:
                stage.close()
            self._end(busy)
            raise
        staged = time.monotonic() - called
        self._progress = (step, "memory-committing", called, staged)
        assert self._tg is not None, "MemoryTier.open(task_group) first"
        self._tg.start_soon(self._commit, lease, step, staged, busy)
        return True

    def _end(self, busy: anyio.Event | None) -> None:
        self._progress = None
        if self._busy is busy:
            self._busy = None
        if busy is not None:
            busy.set()

    async def _begin(self, step: int) -> bool:
        """BEGIN ``step``: the agent forgets this session's snapshots but the one whose
        buffers are held. False (handled) when the agent is away or refused."""
        protect = [s for s, _ in self._held]
        try:
            await self.client.begin(
                self.rank, step, self.world, session=self.session, protect=protect, ns=self.namespace
            )
        except (AgentUnavailableError, AgentTimeoutError) as exc:
            self._fail(exc, step)
            return False
        except AgentError as exc:
            _log.warning("memory tier: the agent refused to begin step %d: %s", step, exc)
            self._update(refused=self._stats.refused + 1)
            self._dirty = True
            return False
        return True

    async def _commit(self, lease: Lease[Any], step: int, staged: float, busy: anyio.Event | None) -> None:
        t0 = time.monotonic()
        try:
            with anyio.CancelScope(shield=True):
                if await self._begin(step):
                    await self._hand_over(lease, step, staged, t0)
                else:
                    lease.release()
        finally:
            self._end(busy)

    async def _hand_over(self, lease: Lease[Any], step: int, staged: float, t0: float) -> None:
        handle = export_shared(lease.state_dict, self.stager)
        fds = [a.fd for a in handle.arenas]
        sizes = [a.nbytes for a in handle.arenas]
        regions = regions_of(handle.refs)
        # Fresh mappings per snapshot: an arena the stager let go may leave its inode
        # number to a new one, and a mapping kept by inode would then hash old bytes.
        maps = ArenaMaps()
        try:
            try:
                digests = await run_in_thread(
                    lambda: digests_of(maps, fds, sizes, regions), name="async-stager-tier-hash"
                )
            finally:
                maps.close()
            kept = [s for s, _ in self._held][1 - self.keep :] if self.keep > 1 else []
            await self.client.commit(
                self.rank,
                step,
                self.world,
                handle,
                digests,
                PIECE_BYTES,
                session=self.session,
                protect=kept,
                ns=self.namespace,
            )
        except (AgentUnavailableError, AgentTimeoutError) as exc:
            lease.release()
            self._fail(exc, step)
            return
        except AgentError as exc:
            lease.release()
            self._dirty = True  # the agent's view of our snapshots is unknown: BEGIN first
            self._update(refused=self._stats.refused + 1)
            _log.warning("memory tier: the agent did not accept step %d: %s", step, exc)
            return
        except BaseException:
            lease.release()
            raise
        # The agent holds it, and forgot our snapshots but the newest ``keep``: the
        # older ones' buffers are free for the next stage.
        self._held.append((step, lease))
        while len(self._held) > self.keep:
            self._held.pop(0)[1].release()
        self._update(
            saved=self._stats.saved + 1,
            last_step=step,
            stage_seconds=staged,
            commit_seconds=time.monotonic() - t0,
            bytes=handle.nbytes,
        )

    # -- restoring ---------------------------------------------------------------------

    def note_restored(self, step: int) -> None:
        """``step`` was restored from memory (``MemoryStats.restored``)."""
        self._update(restored=step)

    async def complete_steps(self) -> list[int]:
        """Steps of this rank the agent holds complete, saved at this world size
        (newest last); [] if the agent is away (logged)."""
        try:
            infos = await self.client.snapshots(self.rank, ns=self.namespace)
        except Exception as exc:  # noqa: BLE001 - any failure here means: restore from disk
            _log.warning("memory tier: cannot list the agent's snapshots (%s): restoring from disk", exc)
            return []
        return [i.step for i in infos if i.complete and i.world == self.world]

    async def load(self, step: int) -> AttachedStateDict:
        """Snapshot ``step`` of this rank, attached (no copy) after every region was
        verified against its digest. Raises AgentError (gone, refused) or
        IntegrityError (a region does not match). Close the result when loaded."""
        fetched = await self.client.fetch(self.rank, step, ns=self.namespace)
        try:
            await run_in_thread(lambda: _verify(fetched), name="async-stager-tier-verify")
            return attach_shared(fetched.handle)
        finally:
            fetched.close()  # the mapping keeps the memory


class _NotTaken(Exception):
    """The agent did not take the snapshot's BEGIN (handled: the save returns False)."""


def _verify(f: Fetched) -> None:
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
