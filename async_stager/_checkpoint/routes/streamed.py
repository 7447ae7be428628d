"""The streamed route: the budgeted pipeline (``dcp.save(host_budget_bytes=...)``'s
``BudgetedJob``), which stages piece by piece into a ring within a host-memory budget
while DCP writes the pieces, then the commit, all in a daemon thread of its own.

``DEFERRED`` (waits for a write slot; no buffer set) -> ``WRITING`` (its thread; a
task waits for its last piece: ``save()`` returns then) -> ``DONE``. With
``host_budget_bytes`` its job (its checks, the pipeline, its fence points) is made at
the ``save`` call and a refusal is raised there; a save the node budget's admission
sends here makes it when its write starts.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio

from async_stager._checkpoint.item import Phase
from async_stager._checkpoint.routes.disk import DiskContext, DiskRoute
from async_stager._checkpoint.statefuls import typed_paths, write_typed_paths
from async_stager._checkpoint.write import GivenUp
from async_stager._core.aio.waiting import wait_future

if TYPE_CHECKING:
    import anyio.abc

    from async_stager._checkpoint.item import Lane, SaveItem
    from async_stager._checkpoint.options import SaveStats
    from async_stager._dcp.budget import BudgetedJob, BudgetStats

__all__ = ["StreamedRoute"]


class StreamedRoute(DiskRoute):
    """A save through the budgeted pipeline. ``admission`` and ``node_wait``: how it met
    the node budget (``"streamed"``), for its stats; None without a node budget."""

    def __init__(
        self,
        sd: dict[str, Any],
        point: Any,
        ctx: DiskContext,
        *,
        admission: str | None = None,
        node_wait: float = 0.0,
    ) -> None:
        super().__init__(sd, point, ctx)
        self.admission = admission
        self.node_wait = node_wait
        #: Its ``dcp.save`` job, run by its write's thread; and the wait that its fence
        #: points, read when the job was made, order.
        self.job: BudgetedJob | None = None
        self.fence_wait: Callable[[], Awaitable[None]] | None = None
        self.digests: dict[str, dict[str, Any]] = {}
        self.budget: list[BudgetStats] = []
        #: The wait for its last piece (cancelled at a missed exit deadline).
        self.fence_scope = anyio.CancelScope()
        #: A given-up save's wait for its thread (cancelled at a missed exit deadline:
        #: the thread is then left to the process's end).
        self.thread_wait: anyio.CancelScope | None = None
        #: Its write's thread was started (it forgets the job itself from then on).
        self.started = False

    def accept(self, item: SaveItem) -> bool:
        return self._make_job(item)

    def _make_job(self, item: SaveItem) -> bool:
        """Build its job (``dcp.save``'s checks and pipeline) from its snapshot point;
        its fence points are read now (the caller's streams, when called at
        ``save()``). A refusal is raised to the save's caller."""
        from async_stager._dcp.budget import BudgetSettings, budgeted_save

        ctx = self.ctx
        ranks, ledger, opts = ctx.ranks, ctx.ledger, ctx.options
        try:
            settings = BudgetSettings(
                opts.host_budget_bytes or (ledger.budget if ledger is not None else 0),
                str(ctx.writer.tmp(item)),
                process_group=ranks.group,
                no_dist=not ranks.distributed,
                on_stats=self.budget.append,
                digests=self.digests if opts.checksums else None,
                ledger=ledger,
                captures=self.point,
            )
            job = budgeted_save(self.sd or {}, ctx.stager, settings)
        except Exception as exc:  # noqa: BLE001 - refused at its start: raised to the save's caller
            item.error = exc
            return False
        self.job = job
        self.fence_wait = job.pipeline.fence(at_call=True)  # the streams of the save() call
        return True

    # -- the write -------------------------------------------------------------------

    def writable(self, item: SaveItem, *, in_thread: bool = False) -> bool:
        # Started on the loop only: a job not made yet is made there.
        return not in_thread and item.phase is Phase.DEFERRED

    def prepare_write(self, item: SaveItem) -> bool:
        item.queued = time.monotonic() - item.called
        return self.job is not None or self._make_job(item)

    def start_write(self, item: SaveItem, then: Callable[[], None]) -> None:
        self.started = True
        self.future = self.ctx.writer.start(
            item, lambda: self._write(item), name="async-stager-budgeted-save", then=then
        )

    def start_tasks(self, item: SaveItem, lane: Lane, tg: anyio.abc.TaskGroup) -> None:
        tg.start_soon(self._fence_task, item, lane)

    async def _fence_task(self, item: SaveItem, lane: Lane) -> None:
        t1 = time.monotonic()
        try:
            if self.fence_wait is not None:
                # Its last piece enqueued, and the streams read at its call ordered
                # after its copies (no host wait). Cancelled at a missed exit deadline.
                with self.fence_scope:
                    await self.fence_wait()
        finally:
            item.staged = time.monotonic() - t1
            item.read.set()
            lane.notify()

    async def wait_write(self, item: SaveItem, lane: Lane) -> SaveStats:
        fut, self.future = self.future, None
        if fut is None:
            if self.job is not None:
                self.job.forget()  # never started: its fence hook must go now
            raise GivenUp
        try:
            return await wait_future(fut)
        except BaseException:
            if self.job is not None and not fut.done():
                # Given up before its last piece (its scope cancelled): stop its copies
                # and wait for its thread, unless the exit deadline passed (then the
                # thread is left to the process's end).
                self.job.abort()
                if not lane.abandoned:
                    # Shielded, but not past a missed exit deadline (``abandon``
                    # cancels it): a value's serialization may ignore the abort.
                    with anyio.CancelScope(shield=True) as self.thread_wait:
                        try:
                            await wait_future(fut)
                        except BaseException:  # noqa: BLE001 - its failure (DCP's CheckpointException is one): given up
                            pass
            raise

    def _write(self, item: SaveItem) -> SaveStats:
        """Its whole write, blocking (its own thread): its folder, its job (the pipeline
        stages piece by piece and DCP writes them), then its commit, all without the
        event loop. Raises GivenUp if the caller gave the save up in time (its job is
        then aborted by the loop, or never run)."""
        job, writer, ranks = self.job, self.ctx.writer, self.ctx.ranks
        assert job is not None
        try:
            if ranks.distributed:
                item.wait_earlier()  # one save at a time: the collectives in call order
            t0 = time.monotonic()
            if item.cancelled:
                raise GivenUp
            writer.begin(item)
            sd, self.sd = self.sd, None
            if ranks.coordinator and sd is not None:
                write_typed_paths(writer.tmp(item), typed_paths(sd))
            del sd
            self.writing = Phase.WRITING
            job.run()
            budget = self.budget[0] if self.budget else None
            nbytes = self.bytes = budget.tensor_bytes if budget is not None else 0
            t1 = time.monotonic()
            self.writing = Phase.COMMITTING
            item.wait_earlier()
            item.settled.wait()  # its caller may still give it up (see the staged route)
            if item.cancelled:
                raise GivenUp
            writer.commit(item, self.digests, None)
            return writer.stats(
                item,
                nbytes,
                0.0,
                t0,
                t1,
                stage_seconds=budget.fence_seconds if budget is not None else item.staged,
                budget=budget,
                admission=self.admission,
                node_wait=self.node_wait + (budget.node_wait_seconds if budget is not None else 0.0),
            )
        finally:
            job.forget()  # never run (given up before): its fence hook goes

    # -- its caller, cancelling, leaving ---------------------------------------------

    def returns(self, item: SaveItem, *, coalesce: bool) -> bool:
        # Once its last piece is copied (its sources may change after that).
        return item.read.is_set() and item.phase is not Phase.DEFERRED

    def cancel(self, item: SaveItem) -> None:
        if item.phase is Phase.WRITING and not item.read.is_set():
            self.scope.cancel()  # before its last piece: nothing is committed

    def abandon(self, item: SaveItem) -> None:
        super().abandon(item)
        self.fence_scope.cancel()
        if self.thread_wait is not None:
            self.thread_wait.cancel()

    def release(self) -> None:
        super().release()
        if self.job is not None and not self.started:
            self.job.forget()  # ended while deferred: its fence hook goes now
