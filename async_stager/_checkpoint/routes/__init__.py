"""The routes a Checkpointer's save travels, one module each, the ways they go
(``way.Way``: a save queue and its routes) and ``Schedule``: which ways a step takes.

- ``staged``: a lease on a buffer set, then the write through the format.
- ``streamed``: the budgeted pipeline (``host_budget_bytes``, or a node budget that
  could not hold a staged copy).
- ``node``: the node budget's admission, which hands the save to one of the two.
- ``memory``: the memory tier's snapshot, handed to the node agent (``agent=``).

The queues (``saves``) order the saves and apply the policy through the ``Route``
interface (``item``); they never ask which route a save takes.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from async_stager._checkpoint.node_budget import check_largest
from async_stager._checkpoint.progress import SaveProgress, progress_of
from async_stager._checkpoint.routes.disk import DiskContext
from async_stager._checkpoint.routes.memory import MemoryWay
from async_stager._checkpoint.routes.node import AdmissionRoute
from async_stager._checkpoint.routes.staged import StagedRoute
from async_stager._checkpoint.routes.streamed import StreamedRoute
from async_stager._checkpoint.routes.way import Way, answer
from async_stager._checkpoint.statefuls import resolve
from async_stager._core.aio.stager import stager_internals

if TYPE_CHECKING:
    from collections.abc import Coroutine

    import anyio
    import anyio.abc

    from async_stager._checkpoint.formats import CheckpointFormat
    from async_stager._checkpoint.item import Route
    from async_stager._checkpoint.saves import SaveQueue
    from async_stager._checkpoint.tiered import TierSchedule
    from async_stager._tier.tier import MemoryTier

__all__ = ["DiskContext", "DiskWay", "MemoryWay", "Schedule", "Way"]


class DiskWay(Way):
    """The saves to the folder: streamed with ``host_budget_bytes``, admitted by the
    node budget with ``node_budget_bytes``, else staged. Opened with the Checkpointer
    (``open``: what its routes use while it is open)."""

    def __init__(self, queue: SaveQueue, fmt: CheckpointFormat) -> None:
        super().__init__(queue)
        self.format = fmt
        self._ctx: DiskContext | None = None

    def open(self, ctx: DiskContext) -> None:
        self._ctx = ctx

    @property
    def ctx(self) -> DiskContext:
        assert self._ctx is not None, "DiskWay.open first"
        return self._ctx

    def check(self, sd: dict[str, Any]) -> int:
        """Refuse at ``save()`` what no route to the folder can save: a value the format
        cannot restore, a tensor bigger than the whole node budget. Returns the largest
        tensor item's bytes (0 when no node budget asks for it)."""
        self.format.check_savable(sd)
        node = self.ctx.options.node_budget_bytes
        return check_largest(sd, node) if node is not None else 0

    def route(self, sd: dict[str, Any], checked: int, *, alone: bool) -> Route:
        """Its snapshot point is taken now, on the caller's current streams, whenever
        the policy lets the save stage (a deferred save stages from it later)."""
        ctx = self.ctx
        point = stager_internals(ctx.stager).snapshot_point(sd)
        if ctx.options.host_budget_bytes is not None:
            admission = "streamed" if ctx.ledger is not None else None
            return StreamedRoute(sd, point, ctx, admission=admission)
        if ctx.ledger is not None:
            return AdmissionRoute(sd, point, ctx, checked)
        return StagedRoute(sd, point, ctx)

    def fence(self) -> Coroutine[Any, Any, None] | None:
        return self.ctx.stager.fence()


class Schedule:
    """The ways of a Checkpointer's saves: the folder, and the memory tier's (``agent=``)
    for the steps ``every`` sends there (``memory_every``, ``persist_every``)."""

    def __init__(self, disk: DiskWay, memory: MemoryWay | None, every: TierSchedule) -> None:
        self.disk = disk
        self.memory = memory
        self.every = every
        #: Every way, the folder's first (``in_flight``'s order).
        self.ways: list[Way] = [disk] if memory is None else [disk, memory]

    @classmethod
    def make(
        cls, disk: SaveQueue, fmt: CheckpointFormat, tier: MemoryTier | None, every: TierSchedule
    ) -> Schedule:
        memory = MemoryWay(disk.options, tier) if tier is not None else None
        return cls(DiskWay(disk, fmt), memory, every)

    # -- what the Checkpointer does to every way alike -------------------------------

    @property
    def queues(self) -> list[SaveQueue]:
        return [w.queue for w in self.ways]

    def open(self, tg: anyio.abc.TaskGroup) -> None:
        for q in self.queues:
            q.open(tg)

    def closing(self) -> None:
        for w in self.ways:
            w.closing()

    async def drain(self, *, settle: bool = False) -> None:
        """Until every save accepted so far ended (``settle``: and what each way waits
        for besides). Cancellation: only the wait."""
        for w in self.ways:
            await w.queue.drain()
            if settle:
                await w.settle()

    def abandon(self) -> None:
        for q in self.queues:
            q.abandon()

    def close(self) -> None:
        """Before the task group ends, then without it (the Checkpointer's close)."""
        for q in self.queues:
            q.stop_waker()
            q.close()

    def raise_failure(self, *, closing: bool = False) -> None:
        for q in self.queues:
            q.raise_at_close() if closing else q.raise_failure()

    @property
    def dropped(self) -> list[int]:
        return [step for q in self.queues for step in q.dropped]

    def in_flight(self) -> list[SaveProgress]:
        """The saves not yet ended, the folder's first, oldest call first, then the
        memory snapshot being replicated (``"memory-replicating"``). A write that ended
        in its thread has ended, even before the loop saw it."""
        now = time.monotonic()
        saves = [progress_of(i, now, q.rate) for q in self.queues for i in q.items if not i.finished.is_set()]
        return saves + (self.memory.replicating() if self.memory is not None else [])

    def fence(self) -> tuple[list[Coroutine[Any, Any, None]], list[anyio.Event]]:
        """Each way's stager's ordering points, read now, and the events of the saves
        that have not read their sources yet."""
        fences = [f for f in (w.fence() for w in self.ways) if f is not None]
        return fences, [i.read for q in self.queues for i in q.items if not i.read.is_set()]

    def save(self, state: dict[str, Any], step: int, called: float) -> Coroutine[Any, Any, bool]:
        """``Checkpointer.save``'s part after its checks: the ways of ``step`` (the
        memory tier's first: its stage is submitted first), each skipped by its policy
        or submitted with its route; what no route can save is refused (raised) before
        anything is submitted. The coroutine its caller awaits: the last way's answer
        (the folder's, when it saves the step)."""
        plan = self.plan(step)
        skips = [w.skips() for w in plan]
        sd = resolve(state) if not all(skips) else {}
        checked = [0 if skip else w.check(sd) for w, skip in zip(plan, skips)]
        alone = len(plan) == 1
        answers = [
            w.skip(step, alone=alone) if skip else w.submit(sd, step, called, c, alone=alone)
            for w, skip, c in zip(plan, skips, checked)
        ]
        return answers[0] if len(answers) == 1 else answer(answers)

    def plan(self, step: int) -> list[Way]:
        """The ways a save of ``step`` takes, the memory tier's first (its stage is
        submitted first); none: the step is not saved."""
        if self.memory is None:
            return [self.disk]
        to_memory, to_disk = self.every.route(step)
        return [w for w, on in ((self.memory, to_memory), (self.disk, to_disk)) if on]
