"""The memory route (``agent=``): a snapshot staged into the memory tier's own
shared-memory Stager, then handed to the node agent by descriptor (BEGIN, its regions
hashed in a thread, COMMIT), on the loop (``_tier.MemoryTier``'s steps).

``DEFERRED`` (the tier's one writable buffer set is taken: the previous snapshot is
staging or committing) -> ``STAGING`` (a set free for it: the ranks' exchanges may have
to free one; the agent told what this rank holds after a failure; connected; then the
stage from the call's snapshot point) -> ``QUEUED`` (``save()`` returns True here) ->
``WRITING`` (the hand-over) -> ``DONE``. Not taken by the tier (no agent, a BEGIN
refused, no set could be freed): ``save()`` returns False. Shown as
``memory-staging`` until staged, then ``memory-committing``. Its queue
(``MemoryWay``): one snapshot at a time, the Checkpointer's policy, and a step is
listed in ``dropped`` only when no other route saves it. Failures of the agent never
reach the caller: the tier logs them and turns itself off for a while.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import anyio

from async_stager._checkpoint.item import Phase, Route
from async_stager._checkpoint.progress import SaveProgress
from async_stager._checkpoint.routes.way import Way, skipped
from async_stager._checkpoint.saves import SaveQueue
from async_stager._checkpoint.write import GivenUp
from async_stager._core.aio.stager import stager_internals

if TYPE_CHECKING:
    import anyio.abc

    from async_stager._checkpoint.item import Lane, SaveItem
    from async_stager._checkpoint.options import CheckpointerOptions, SaveStats
    from async_stager._core.aio.lease import Lease
    from async_stager._tier.retention import Ticket
    from async_stager._tier.tier import MemoryTier

__all__ = ["MemoryRoute", "MemoryWay"]


class MemoryRoute(Route):
    """A memory snapshot of ``sd`` (resolved), from its snapshot point ``point``.
    ``ticket``: its place in the ranks' exchanges (set ready once it ended); ``only``:
    no other route saves its step."""

    def __init__(
        self, sd: dict[str, Any], point: Any, tier: MemoryTier, ticket: Ticket | None, *, only: bool
    ) -> None:
        super().__init__()
        self.sd: dict[str, Any] | None = sd
        self.point = point
        self.tier = tier
        self.ticket = ticket
        self.only = only
        self.lease: Lease[Any] | None = None
        #: Its stage task's scope: cancelled when the caller cancels the save meanwhile.
        self.stage_scope = anyio.CancelScope()

    def holds_set(self, item: SaveItem) -> bool:
        # The tier's writable buffer set, from its stage until the agent holds it.
        return item.phase is not Phase.DEFERRED

    def wants_set(self, item: SaveItem) -> bool:
        return self.sd is not None

    def take_set(self, item: SaveItem, lane: Lane, tg: anyio.abc.TaskGroup) -> None:
        item.phase = Phase.STAGING
        item.queued = time.monotonic() - item.called
        tg.start_soon(self._stage_task, item, lane)

    async def _stage_task(self, item: SaveItem, lane: Lane) -> None:
        sd, self.sd = self.sd, None
        if sd is None:
            lane.end(item)  # ended before this task ran
            return
        t1 = time.monotonic()
        lease = None
        try:
            with self.stage_scope:  # cancelled when the caller cancels its save
                if not await self.tier.prepare(item.step, self.ticket):
                    self.tier.not_taken()
                    lane.skip(item, dropped=self.only)
                    return
                if item.ended:
                    return  # given up meanwhile (its caller, the close)
                # From the call's snapshot point, however long the set took.
                lease = await stager_internals(self.tier.stager).lease_at(sd, self.point)
        except Exception as exc:  # noqa: BLE001 - the stage failed: raised to the save's caller
            item.error = exc
        del sd
        if lease is not None and (item.cancelled or item.ended):
            lease.release()
            lease = None
        if lease is None:
            lane.end(item)
            return
        self.lease = lease
        item.staged = time.monotonic() - t1
        lane.staged(item)

    def writable(self, item: SaveItem, *, in_thread: bool = False) -> bool:
        # On the loop, once its caller can no longer give it up (``save()`` returned,
        # or nobody awaits it): a snapshot whose caller was cancelled is never handed over.
        return not in_thread and item.phase is Phase.QUEUED and item.settled.is_set()

    def start_write(self, item: SaveItem, then: Callable[[], None]) -> None:
        pass  # the hand-over runs on the loop (``wait_write``)

    async def wait_write(self, item: SaveItem, lane: Lane) -> SaveStats | None:
        lease, self.lease = self.lease, None
        if lease is None or item.cancelled:
            if lease is not None:
                lease.release()
            raise GivenUp
        item.committed = await self.tier.commit(lease, item.step, item.staged)
        return None  # (a memory snapshot is not a commit ``on_saved`` reports)

    def returns(self, item: SaveItem, *, coalesce: bool) -> bool:
        return item.phase is Phase.QUEUED or item.phase is Phase.WRITING

    def shown(self, item: SaveItem) -> Phase:
        staging = item.phase is Phase.DEFERRED or item.phase is Phase.STAGING
        return Phase.MEMORY_STAGING if staging else Phase.MEMORY_COMMITTING

    def cancel(self, item: SaveItem) -> None:
        if item.phase is Phase.STAGING:
            self.stage_scope.cancel()  # the stage task ends it

    def abandon(self, item: SaveItem) -> None:
        super().abandon(item)
        self.stage_scope.cancel()

    def release(self) -> None:
        self.sd = None
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.release()
        if self.ticket is not None:
            self.ticket.ready.set()  # its snapshot ended: the ranks' exchange of it may run


class MemoryWay(Way):
    """The memory tier's saves: a queue of one snapshot at a time under the
    Checkpointer's policy (``"wait"`` or ``"skip"``)."""

    def __init__(self, options: CheckpointerOptions, tier: MemoryTier) -> None:
        super().__init__(SaveQueue(dataclasses.replace(options, max_in_flight=1), 1, _no_stats))
        self.tier = tier

    def skips(self) -> bool:
        tier = self.tier
        return not tier.available or (
            self.queue.options.policy == "skip" and (self.queue.full or not tier.room)
        )

    def skip(self, step: int, *, alone: bool) -> Coroutine[Any, Any, bool]:
        ticket = self.tier.ticket()  # one exchange per call on every rank, skipped or not
        if ticket is not None:
            ticket.ready.set()
        self.tier.not_taken()
        if alone:  # a step saved nowhere
            return super().skip(step, alone=alone)
        return skipped()

    def route(self, sd: dict[str, Any], checked: int, *, alone: bool) -> Route:
        tier = self.tier
        point = stager_internals(tier.stager).snapshot_point(sd)
        return MemoryRoute(sd, point, tier, tier.ticket(), only=alone)

    def fence(self) -> Coroutine[Any, Any, None] | None:
        return self.tier.fence()

    def closing(self) -> None:
        # A snapshot whose caller never awaited it waits for its caller before its
        # hand-over (``MemoryRoute.writable``): at the close it is not taken (its
        # coroutine, awaited later, returns False).
        for item in list(self.queue.items):
            if not item.awaited and not item.wrote:
                self.queue.skip(item, dropped=False)
        self.tier.closing()  # replication's task must end with the Checkpointer's task group

    async def settle(self) -> None:
        await self.tier.settle()

    def replicating(self) -> list[SaveProgress]:
        """The snapshot being sent to the peer node's agent (``replicate=True``)."""
        rep = self.tier.replicator
        if rep is None:
            return []
        return [SaveProgress(p.step, p.phase, p.seconds, None, rep.sending_bytes) for p in rep.in_flight()]


def _no_stats(stats: SaveStats) -> None:
    raise AssertionError("a memory snapshot delivers no SaveStats")
