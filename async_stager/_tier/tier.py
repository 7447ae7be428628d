"""A trainer's memory tier: snapshots handed to the node agent, restored from it.

A snapshot costs its caller the stage only, into this tier's own Stager whose arenas
are memfds (``share_memory=True``; pinned too where a CUDA device copies into them):
the memory the copies land in is handed over by descriptor, no second copy. In the
background: BEGIN, the regions hashed (a thread), COMMIT; the agent re-hashes them.

Buffers: ``keep + 1`` buffer sets (2 more with a ``replicator``: the step being sent,
the newest every rank replicated). The tier holds the leases of the complete snapshots
it keeps and stages into a free set. Which it keeps is the job's decision
(``retention``); the agent forgets a snapshot first (``RETAIN``, or a ``COMMIT``'s
``protect``) and the tier releases its buffers once that is answered, so the agent
never holds as complete a buffer a stage may be writing (after a failure the next save
BEGINs first).

The Checkpointer's memory route (``_checkpoint/routes/memory``) drives ``ticket``,
``prepare`` and ``commit``; ``save`` is the tier alone (a tool, a test). Failures never
stop training: an agent gone or too slow turns the tier off with one warning, tried
again ``retry_seconds`` later; a refused snapshot is logged and not held; the ranks'
exchanges failing (a rank died) turn it off for good. Restore: ``complete_snapshots``
and ``load(step, timeline)``: the snapshot's descriptors, trusted if the agent sealed
and verified it after its writer was gone, else verified here, attached without a copy
(``loading``); the caller decides the step with the other ranks (``_checkpoint/tiered``).
"""

from __future__ import annotations

import logging
import math
import os
import time
import uuid
import warnings
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Literal

import anyio
import anyio.abc

from async_stager._core.aio.stager import Stager
from async_stager._core.aio.threads import run_in_thread
from async_stager._core.memory.lease import Lease
from async_stager._share.handoff import export_shared
from async_stager._tier.client import AgentClient
from async_stager._tier.loading import Loaded, load_snapshot
from async_stager._tier.regions import PIECE_BYTES, ArenaMaps, digests_of, regions_of
from async_stager._tier.retention import Agreement, Ticket, droppable, forced
from async_stager._tier.solo import SoloSaves
from async_stager._tier.stats import MemoryStats, TierProgress
from async_stager.errors import (
    AgentError,
    AgentTimeoutError,
    AgentUnavailableError,
    InvalidOptionError,
)

if TYPE_CHECKING:
    from async_stager._tier.replicator import Replicator

__all__ = ["MemoryStats", "MemoryTier", "TierProgress"]

_log = logging.getLogger("async_stager.checkpoint")


class MemoryTier:
    """One rank's snapshots to the node agent ``client``. ``rank``/``world``: this
    process's place (a snapshot of one world size never restores in another);
    ``policy``: ``"wait"`` or ``"skip"`` when the previous snapshot is still in flight
    or no buffer set is free; ``stager``: one with ``share_memory=True`` and at least
    ``keep + 1`` buffer sets (else its own); ``retry_seconds``: how long the tier stays
    off after the agent failed; ``keep``: the complete snapshots it keeps at least
    (one more while the ranks agree on a newer common step).

    ``agree``: with several ranks, a blocking all-gather of this rank's list on a
    process group of the tier's own (``retention.Agreement``: what keeps the promise
    for the job); None for one process. ``timeline``: the job's run, the same on every
    rank (the ranks agree on it; ``restarting`` moves it on)."""

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
        agree: Callable[[list[Any]], list[Any]] | None = None,
        timeline: str | None = None,
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
        #: The complete snapshots' buffers (step, lease), oldest first: what this rank
        #: tells the other ranks it holds.
        self._held: list[tuple[int, Lease[Any]]] = []
        #: This process's token: the agent tells our snapshots from a dead trainer's.
        self.session = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._timeline_base = timeline if timeline is not None else self.session
        self._restores = 0
        #: The newest step every rank holds (None: unknown), and the step restored.
        self._common: int | None = None
        self._restored: int | None = None
        #: The newest step every rank holds with its replica verified (``replicator``).
        self._replicated: int | None = None
        #: Replication to another node's agent (set by whoever builds the tier).
        self.replicator: Replicator | None = None
        self._agreement = (
            None
            if agree is None
            else Agreement(
                agree, published=self._published, on_common=self._on_common, on_broken=self._on_broken
            )
        )
        #: Guards ``_held`` and the agent's view of it across an await (one message).
        self._retaining = anyio.Lock()
        #: After a failure or refusal: BEGIN before the next stage writes.
        self._dirty = False
        #: ``save`` alone: the busy slot and the snapshot in flight (``solo``).
        self._solo = SoloSaves(self)
        #: A snapshot was let go without the ranks' agreement (warned once).
        self._forced = False
        self._tg: anyio.abc.TaskGroup | None = None
        self._down_until = 0.0
        self._stats = MemoryStats()

    @property
    def stats(self) -> MemoryStats:
        return self._stats

    @property
    def timeline(self) -> str:
        """The job's run this rank's snapshots belong to now."""
        return f"{self._timeline_base}.{self._restores}"

    @property
    def stager(self) -> Stager:
        if self._stager is None:
            self._stager = Stager(share_memory=True, max_buffer_sets=self.keep + 1 + self._extra)
        return self._stager

    @property
    def available(self) -> bool:
        """The tier takes snapshots now (not off after a failure)."""
        on = time.monotonic() >= self._down_until
        if on and not self._stats.available:
            self._update(available=True)
        return on

    @property
    def _extra(self) -> int:
        return self.replicator.EXTRA_SETS if self.replicator is not None else 0

    def _pins(self) -> set[int]:
        return self.replicator.pins(self._replicated) if self.replicator is not None else set()

    def held_steps(self) -> list[int]:
        """The steps of this rank's complete snapshots whose buffers it holds."""
        return [s for s, _ in self._held]

    def _update(self, **changes: Any) -> None:
        from dataclasses import replace

        self._stats = replace(self._stats, **changes)

    #: For the replicator (on the loop): its counts into ``stats``.
    update_stats = _update

    @property
    def replicated_step(self) -> int | None:
        """The newest step every rank holds complete with its replica verified."""
        return self._replicated

    def open(self, tg: anyio.abc.TaskGroup) -> None:
        """Commits (and the ranks' exchanges, and replication) run as tasks of ``tg``
        (the Checkpointer's)."""
        self._tg = tg
        if self.replicator is not None:
            self.replicator.open(tg)

    @property
    def task_group(self) -> anyio.abc.TaskGroup:
        """The task group of ``open`` (the commits of ``save`` run there)."""
        assert self._tg is not None, "MemoryTier.open(task_group) first"
        return self._tg

    def closing(self) -> None:
        """Its owner closes: replication stops sending (its task ends with the owner's
        task group; the snapshot on the wire, if any, is finished)."""
        if self.replicator is not None:
            self.replicator.stop_sending()

    async def aclose(self) -> None:
        """Wait for a commit in flight, release the held snapshots (the agent keeps its
        own descriptors: the memory stays with the agent), close the connection and
        this tier's Stager. Cancellation: shielded."""
        with anyio.CancelScope(shield=True):
            await self._solo.idle()
            if self.replicator is not None:
                await self.replicator.aclose()
            if self._agreement is not None:
                self._agreement.close()
            self._release_held()
            await self.client.aclose()
            if self._own_stager and self._stager is not None:
                await self._stager.aclose()
                self._stager = None

    async def wait(self) -> None:
        """Until no snapshot of ``save`` is in flight and the ranks' exchanges of those
        that ended ran (``settle``). Cancellation: only the wait."""
        await self._solo.idle()
        await self.settle()

    def _release_held(self) -> None:
        held, self._held = self._held, []
        for _, lease in held:
            lease.release()

    def in_flight(self) -> list[TierProgress]:
        """The snapshot being staged or committed, if any, and the replica being sent to
        the peer node (a snapshot; no I/O)."""
        sending = self.replicator.in_flight() if self.replicator is not None else []
        return [*self._solo.in_flight(), *sending]

    @property
    def busy(self) -> bool:
        """A snapshot of ``save`` is being staged or committed."""
        return self._solo.busy

    def _fail(self, exc: AgentError, step: int) -> None:
        """The agent is gone or too slow: off until the retry, one warning."""
        was = self.available
        self._down_until = max(self._down_until, time.monotonic() + self.retry_seconds)
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

    def _on_broken(self, exc: BaseException) -> None:
        """The ranks' exchanges failed (a rank died, or this Checkpointer is being torn
        down): off for good; what the agent holds stays for a restart."""
        was = self.available
        self._down_until = math.inf
        self._update(available=False)
        if was and isinstance(exc, Exception):
            warnings.warn(
                f"the ranks' memory-tier exchange failed ({exc!r}): memory checkpoints are off for "
                "this run, saves to disk go on",
                RuntimeWarning,
                stacklevel=2,
            )
            _log.warning("memory tier: the ranks' exchange failed (%r): disk only from now on", exc)

    # -- what a snapshot does (the Checkpointer's memory route; ``save`` alone) --------

    @property
    def room(self) -> bool:
        """A buffer set is free for the next stage (no more than ``keep`` held)."""
        return len(self._held) <= self.keep + self._extra

    def ticket(self) -> Ticket | None:
        """A memory save's place in the ranks' exchanges, taken at every call (None: one
        process); set its ``ready`` once the save ended, whatever became of it."""
        tg = self.task_group  # asserts ``open`` first, one process too
        return self._agreement.ticket(tg) if self._agreement is not None else None

    def not_taken(self) -> None:
        """A snapshot not taken (skipped, the tier off, no agent, no room): counted."""
        self._update(skipped=self._stats.skipped + 1)

    async def prepare(self, step: int, ticket: Ticket | None) -> bool:
        """Before a stage writes into a buffer set: a set free (the ranks' exchanges of
        the saves before ``ticket`` may free one), the agent told what this rank holds
        after a failure (BEGIN), the agent connected. False: not taken (logged)."""
        if not await self._room(ticket):
            return False
        if self._dirty and not await self._begin(step):
            return False
        self._dirty = False
        return self.client.connected or await self._probe(step)

    async def commit(self, lease: Lease[Any], step: int, staged: float) -> bool:
        """Hand a staged snapshot to the agent: BEGIN, its regions hashed (a thread),
        COMMIT; the tier then holds ``lease`` (or released it). True if the agent holds
        the snapshot. Cancellation: shielded (a commit half sent is not left)."""
        t0 = time.monotonic()
        held = False
        with anyio.CancelScope(shield=True):
            if await self._begin(step):
                held = await self._hand_over(lease, step, staged, t0)
            else:
                lease.release()
        return held

    def fence(self) -> Coroutine[Any, Any, None] | None:
        """Its Stager's ordering points, read now (``Stager.fence``); None before any."""
        return self._stager.fence() if self._stager is not None else None

    async def settle(self) -> None:
        """Until the ranks' exchanges of the ended snapshots ran. Cancellation: the wait."""
        if self._agreement is not None:
            await self._agreement.settle()

    def save(self, sd: dict[str, Any], step: int) -> Coroutine[Any, Any, bool]:
        """Snapshot ``sd`` (a resolved state dict) as ``step`` with this tier alone:
        one snapshot at a time; ``policy`` when the previous one is in flight or no
        buffer set is free (``"skip"``: False at once; ``"wait"``: it waits, for the
        commit, for the ranks' exchanges). Await the returned coroutine: True once
        staged, False when not taken. The snapshot point is this call; the commit goes
        on in the background. Cancellation: nothing is handed to the agent."""
        return self._solo.save(sd, step)

    async def _probe(self, step: int) -> bool:
        """Connect to the agent (not connected: the first save, or after a failure);
        False (warned once, the tier off until the retry) if there is none."""
        try:
            await self.client.hello()
        except AgentError as exc:
            self._fail(exc, step)
            return False
        return True

    async def _room(self, ticket: Ticket | None) -> bool:
        """Until a buffer set is free: the ranks' exchanges of the saves before this
        one let go of a snapshot, else (a rank failed to commit) the oldest that is not
        the common step goes. False if the tier went off meanwhile."""
        while not self.room:
            agreement = self._agreement
            if not self.available:
                return False
            if agreement is None or ticket is None or agreement.done_through(ticket.index - 1):
                async with self._retaining:
                    pins = self._pins()
                    step = forced([s for s in self.held_steps() if s not in pins], self._common)
                    if step is not None and not self.room:
                        # Once at WARNING (a rank that keeps failing would say it every step).
                        _log.log(
                            logging.DEBUG if self._forced else logging.WARNING,
                            "memory tier: rank %d has no buffer set free and the ranks share no newer step "
                            "than %s: letting go of step %d (a rank failed to commit a snapshot)",
                            self.rank,
                            self._common,
                            step,
                        )
                        self._forced = True
                        await self._let_go([step])
                if not self.room:
                    return False
                break
            await agreement.changed()
        return True

    def _floor(self, held: list[int]) -> int | None:
        """The oldest step the agent must keep of this rank: the newest step every rank
        holds (or the one restored), unless this rank still holds an older one."""
        base = self._common if self._common is not None else self._restored
        if base is None:
            return None
        return min([base, *held])

    def _published(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        # Read from the exchanges' thread: one reference taken, then fresh tuples.
        held = tuple(s for s, _ in self._held)
        rep = self.replicator
        return (held, *rep.report(held)) if rep is not None else (held, (), ())

    async def _on_common(
        self, common: int | None, replicated: int | None = None, extras: list[Any] | None = None
    ) -> None:
        """After an exchange: the next step to replicate (``_replicate_next``), then let
        go of what the rule allows (``retention``), never the step being replicated nor
        the newest step every rank has replicated."""
        async with self._retaining:
            self._common = common
            self._replicated = replicated
            if self.replicator is not None:
                self.replicator.decide(common, extras or [])
            pins = self._pins()
            drop = [s for s in droppable(self.held_steps(), common, self.keep) if s not in pins]
            if drop and self.available:
                await self._let_go(drop)

    async def _let_go(self, steps: list[int]) -> None:
        """Have the agent forget ``steps`` (of ``_held``), then release their buffers.
        Under ``_retaining``. On a failure the tier is off (and releases everything) or,
        refused, keeps them."""
        gone = [(s, lease) for s, lease in self._held if s in steps]
        self._held = [(s, lease) for s, lease in self._held if s not in steps]  # no longer reported
        keep = self.held_steps()
        try:
            with anyio.CancelScope(shield=True):
                await self.client.retain(
                    self.rank, session=self.session, protect=keep, ns=self.namespace, floor=self._floor(keep)
                )
        except (AgentUnavailableError, AgentTimeoutError) as exc:
            self._held = sorted(self._held + gone, key=lambda h: h[0])
            self._fail(exc, gone[-1][0] if gone else -1)
            return
        except AgentError as exc:
            self._held = sorted(self._held + gone, key=lambda h: h[0])
            self._dirty = True
            _log.warning("memory tier: the agent refused to let go of steps %s: %s", steps, exc)
            return
        for _, lease in gone:
            lease.release()

    async def _begin(self, step: int) -> bool:
        """BEGIN ``step``: the agent forgets this session's snapshots but those whose
        buffers are held, and those of ``step`` or later (a rewound run: their buffers
        are released once it answered). False (handled) when the agent is away or
        refused."""
        async with self._retaining:
            later = [(s, lease) for s, lease in self._held if s >= step]
            self._held = [(s, lease) for s, lease in self._held if s < step]
            protect = self.held_steps()
            try:
                await self.client.begin(
                    self.rank,
                    step,
                    self.world,
                    session=self.session,
                    protect=protect,
                    ns=self.namespace,
                    floor=self._floor(protect),
                    timeline=self.timeline,
                )
            except (AgentUnavailableError, AgentTimeoutError) as exc:
                self._held = sorted(self._held + later, key=lambda h: h[0])
                self._fail(exc, step)
                return False
            except AgentError as exc:
                self._held = sorted(self._held + later, key=lambda h: h[0])
                _log.warning("memory tier: the agent refused to begin step %d: %s", step, exc)
                self._update(refused=self._stats.refused + 1)
                self._dirty = True
                return False
            for _, lease in later:
                lease.release()
            return True

    async def _hand_over(self, lease: Lease[Any], step: int, staged: float, t0: float) -> bool:
        handle = export_shared(lease.state_dict, self.stager)
        fds = [a.fd for a in handle.arenas]
        sizes = [a.nbytes for a in handle.arenas]
        regions = regions_of(handle.refs)
        # Fresh mappings per snapshot: an arena the stager let go may leave its inode
        # number to a new one, and a mapping kept by inode would then hash old bytes.
        maps = ArenaMaps()
        try:
            digests = await run_in_thread(
                lambda: digests_of(maps, fds, sizes, regions), name="async-stager-tier-hash"
            )
        finally:
            maps.close()
        async with self._retaining:
            after = [*self.held_steps(), step]
            # One process: this step is the job's newest common one once committed.
            common = step if self._agreement is None else self._common
            pins = self._pins()
            drop = [s for s in droppable(after, common, self.keep) if s not in pins]
            keep = [s for s in after if s not in drop]
            dropping = [h for h in self._held if h[0] in drop]
            self._held = [h for h in self._held if h[0] not in drop]  # no longer reported
            try:
                await self.client.commit(
                    self.rank,
                    step,
                    self.world,
                    handle,
                    digests,
                    PIECE_BYTES,
                    session=self.session,
                    protect=keep,
                    ns=self.namespace,
                    floor=self._floor(keep) if self._agreement is not None else min(keep),
                )
            except (AgentUnavailableError, AgentTimeoutError) as exc:
                lease.release()
                self._held = sorted(self._held + dropping, key=lambda h: h[0])
                self._fail(exc, step)
                return False
            except AgentError as exc:
                lease.release()
                self._held = sorted(self._held + dropping, key=lambda h: h[0])
                self._dirty = True  # the agent's view of our snapshots is unknown: BEGIN first
                self._update(refused=self._stats.refused + 1)
                _log.warning("memory tier: the agent did not accept step %d: %s", step, exc)
                return False
            except BaseException:
                lease.release()
                self._held = sorted(self._held + dropping, key=lambda h: h[0])
                raise
            # The agent holds it and forgot ``drop``: their buffers are free again.
            self._held = [*self._held, (step, lease)]
            for _, old in dropping:
                old.release()
            if self._agreement is None:
                self._common = step
        if self.replicator is not None:
            self.replicator.keep(step, self.timeline, handle, digests, self.held_steps())
        self._update(
            saved=self._stats.saved + 1,
            last_step=step,
            stage_seconds=staged,
            commit_seconds=time.monotonic() - t0,
            bytes=handle.nbytes,
        )
        return True

    # -- restoring ---------------------------------------------------------------------

    def restarting(self) -> None:
        """A restore begins (on every rank): the snapshots saved from now on belong to
        a new run of the job (``timeline``), never combined with the old run's. The
        step the ranks shared in the old run says nothing about the new one."""
        self._restores += 1
        self._common = None
        self._restored = None
        self._replicated = None

    def note_restored(self, step: int, sealed: bool | None = None) -> None:
        """``step`` was restored from memory (``MemoryStats.restored``, ``restored_sealed``):
        every rank holds it, so the agent may forget this rank's older ones."""
        self._restored = step
        self._update(restored=step, restored_sealed=sealed)

    async def complete_snapshots(self) -> list[tuple[int, str]]:
        """(step, timeline) of this rank's snapshots the agent holds complete, saved at
        this world size (newest commit last); [] if the agent is away (logged)."""
        try:
            infos = await self.client.snapshots(self.rank, ns=self.namespace)
        except Exception as exc:  # noqa: BLE001 - any failure here means: restore from disk
            _log.warning("memory tier: cannot list the agent's snapshots (%s): restoring from disk", exc)
            return []
        return [(i.step, i.timeline) for i in infos if i.complete and i.world == self.world]

    async def complete_steps(self) -> list[int]:
        """The steps of ``complete_snapshots``."""
        return [s for s, _ in await self.complete_snapshots()]

    async def load(self, step: int, timeline: str | None = None) -> Loaded:
        """Snapshot ``step`` (of ``timeline``: None, the newest) of this rank, attached
        (no copy), trusted if the agent sealed and verified it, else verified here
        (``loading``). Raises AgentError (gone, refused) or IntegrityError (a region does
        not match). Close the result when loaded (``Loaded.read_into`` copies it)."""
        ns, wait = self.namespace, self.client.timeout
        return await load_snapshot(self.client, self.rank, step, ns=ns, timeline=timeline, wait=wait)
