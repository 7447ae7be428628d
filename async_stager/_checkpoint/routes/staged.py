"""The staged route: a lease on one of the Stager's buffer sets (the snapshot copied
into host memory from the call's snapshot point), then the write through the format,
the staged bytes hashed beside it, and the commit, in a daemon thread of its own.

``DEFERRED`` (waits for a buffer set) -> ``STAGING`` (the stage task) -> ``QUEUED``
(staged; ``save()`` returns here with ``"coalesce"``) -> ``WRITING`` (its thread;
``save()`` returns here otherwise) -> ``DONE``. The staged copy is handed back as soon
as its thread has written and hashed it (``freed``), before the commit, so the next
stage may use the buffer set while this save waits for the earlier commits.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine
from concurrent import futures
from typing import TYPE_CHECKING, Any

import anyio

from async_stager._checkpoint.item import Phase
from async_stager._checkpoint.node_budget import yield_idle
from async_stager._checkpoint.routes.disk import DiskContext, DiskRoute
from async_stager._checkpoint.statefuls import staged_bytes
from async_stager._checkpoint.write import GivenUp, Table, hash_staged
from async_stager._core.aio.stager import stager_internals
from async_stager._core.aio.waiting import threadsafe, wait_future

if TYPE_CHECKING:
    import anyio.abc

    from async_stager._checkpoint.item import Lane, SaveItem
    from async_stager._checkpoint.options import SaveStats
    from async_stager._core.memory.lease import Lease

__all__ = ["StagedRoute"]


class StagedRoute(DiskRoute):
    """A save staged whole into a buffer set, then written from it. ``admission`` and
    ``node_wait``: how it met the node budget (``node``), for its stats."""

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
        #: The submitted stage (``stager.lease`` coroutine), until it is awaited.
        self.stage: Coroutine[Any, Any, Lease[dict[str, Any]]] | None = None
        self.lease: Lease[dict[str, Any]] | None = None
        #: The stage task's scope: cancelled when the caller cancels the save while staging.
        self.stage_scope = anyio.CancelScope()
        #: Set (from any thread, through ``on_freed``) once its thread no longer reads
        #: the staged copy.
        self.freed: anyio.Event | None = None
        self.on_freed: Callable[[], None] | None = None

    # -- the buffer set and the stage ----------------------------------------------

    def holds_set(self, item: SaveItem) -> bool:
        return item.phase is Phase.STAGING or self.lease is not None

    def wants_set(self, item: SaveItem) -> bool:
        return self.sd is not None

    def take_set(self, item: SaveItem, lane: Lane, tg: anyio.abc.TaskGroup) -> None:
        assert self.sd is not None
        # Never hashed while staging: the write's thread hashes the staged host copy
        # beside the write (the bytes as staged, before they reach the disk), on every
        # device. On the CPU, hashing in the copy threads lengthened the caller's
        # blocked time; on a GPU the device hash reads the source at another moment
        # than the copy, so a buffer that training writes during an overlapped stage
        # (BatchNorm's running statistics) made restore reject a checkpoint written
        # correctly. ``stager.lease(sd, checksums=True)`` keeps the device hash for
        # callers who want it.
        self.stage = stager_internals(self.ctx.stager).lease_at(self.sd, self.point, checksums=False)
        self.sd = None
        item.phase = Phase.STAGING
        item.queued = time.monotonic() - item.called
        tg.start_soon(self._stage_task, item, lane)

    async def _stage_task(self, item: SaveItem, lane: Lane) -> None:
        """Finish the submitted stage (in the background: the caller may await later)."""
        stage, self.stage = self.stage, None
        if stage is None:
            # Ended (abandoned at a missed exit deadline, given up) before this task
            # ran: its stage was closed with it.
            lane.end(item)
            return
        t1 = time.monotonic()
        lease = None
        try:
            with self.stage_scope:  # cancelled when the caller cancels its save
                lease = await stage
        except Exception as exc:  # noqa: BLE001 - the stage failed: raised to the save's caller
            item.error = exc
        del stage
        if self.ctx.ledger is not None:
            self.ctx.ledger.drop_credit()  # what the stage did not draw of its admission
        if lease is not None and (item.cancelled or item.ended):
            lease.release()
            lease = None
        if lease is None:
            lane.end(item)
            return
        self.lease = lease
        item.staged = time.monotonic() - t1
        freed = self.freed = anyio.Event()
        self.on_freed = threadsafe(freed.set)
        lane.staged(item)

    # -- the write -------------------------------------------------------------------

    def writable(self, item: SaveItem, *, in_thread: bool = False) -> bool:
        return item.phase is Phase.QUEUED and self.on_freed is not None

    def start_write(self, item: SaveItem, then: Callable[[], None]) -> None:
        lease, written = self.lease, self.on_freed
        if lease is None or written is None:
            return  # (released meanwhile: its write task finds no future, commits nothing)
        # Its thread calls ``written`` once the staged copy is written and hashed; a
        # task then gives the copy back. Hazard: a thread-safe callback runs outside any
        # task, where anyio cannot start tasks, so the thread only sets an event that a
        # task waits on.
        writer = self.ctx.writer
        self.future = writer.start(
            item,
            lambda: self._write_and_commit(item, lease, written),
            name=f"async-stager-{writer.format.name}-save",
            then=then,
        )

    def start_tasks(self, item: SaveItem, lane: Lane, tg: anyio.abc.TaskGroup) -> None:
        if self.freed is not None:
            tg.start_soon(self._release_when, item, lane, self.freed)

    async def _release_when(self, item: SaveItem, lane: Lane, freed: anyio.Event) -> None:
        await freed.wait()
        if item.phase is Phase.WRITING:
            self._give_back()  # the staged buffers are free for the next stage
            lane.advance()
            if self.ctx.ledger is not None:
                await yield_idle(self.ctx.stager, self.ctx.ledger)

    async def wait_write(self, item: SaveItem, lane: Lane) -> SaveStats:
        fut, self.future = self.future, None
        if fut is None:
            raise GivenUp
        try:
            return await wait_future(fut)
        finally:
            if self.freed is not None:
                self.freed.set()  # the write ended (or failed) before it said so

    def _write_and_commit(
        self, item: SaveItem, lease: Lease[dict[str, Any]], written: Callable[[], None]
    ) -> SaveStats:
        """The background part of a staged save (blocking, its own thread): its folder,
        the staged copy written through the format while its bytes are hashed beside
        it, the copy handed back (``written``: it must only schedule work on the loop),
        then every earlier save waited for (commits in call order), the commit and
        the retention. Raises GivenUp if the caller gave the save up in time."""
        writer, ranks = self.ctx.writer, self.ctx.ranks
        if ranks.distributed:
            # One save at a time on several ranks: the collectives in call order.
            item.wait_earlier()
        t0 = time.monotonic()
        if item.cancelled:
            raise GivenUp
        writer.begin(item)
        try:
            manifest, entry, checksum_seconds, nbytes = self._write_staged(item, lease)
            written()
            t1 = time.monotonic()
            self.writing = Phase.COMMITTING
            item.wait_earlier()
            # Its caller may still be cancelled inside save() (the loop has not resumed it
            # since this write started): wait until it returned or gave up.
            item.settled.wait()
            if item.cancelled:
                raise GivenUp
            plan = writer.increments.plan_of(item.seq) if writer.increments is not None else None
            writer.commit(item, manifest, entry)
        finally:
            if writer.increments is not None:
                writer.increments.release(item.seq)  # its plan, whatever happened
        return writer.stats(
            item,
            nbytes,
            checksum_seconds,
            t0,
            t1,
            stage_seconds=item.staged,
            admission=self.admission,
            node_wait=self.node_wait,
            reused_bytes=plan.reused_bytes if plan is not None else 0,
        )

    def _write_staged(
        self, item: SaveItem, lease: Lease[dict[str, Any]]
    ) -> tuple[Table, dict[str, Any] | None, float, int]:
        """Write a staged copy into the save's folder: the manifest's tensors table, what
        the format's ``stored`` needs, the checksum seconds and the tensor bytes."""
        opts, writer = self.ctx.options, self.ctx.writer
        staged = lease.state_dict
        self.writing = Phase.WRITING
        nbytes = self.bytes = staged_bytes(staged)
        # What the copy threads did not hash (everything, on the CPU: there the stage
        # leaves hashing to this point, off the caller's blocked path) is hashed from
        # the staged copy beside the write; both end before the copy is handed back.
        hashing = hash_staged(staged, opts.checksum_threads, lease.checksums) if opts.checksums else None
        skip: frozenset[str] = frozenset()
        try:
            if writer.increments is not None and hashing is not None:
                # Incremental: the digests decide what is written, so the hash ends first.
                plan = writer.increments.plan(
                    item.seq, item.step, staged, hashing.result()[0], writer.tmp(item)
                )
                skip = plan.skip if plan is not None else skip
            entry = writer.format.write(staged, writer.tmp(item), self.ctx.ranks, skip)
        finally:
            if hashing is not None:
                futures.wait([hashing])  # it reads the staged buffers, whatever happened
        del staged
        manifest, checksum_seconds, _ = hashing.result() if hashing is not None else ({}, 0.0, 0)
        return manifest, entry, checksum_seconds, nbytes

    # -- its caller, cancelling, leaving ---------------------------------------------

    def returns(self, item: SaveItem, *, coalesce: bool) -> bool:
        return item.phase is Phase.WRITING or (item.phase is Phase.QUEUED and coalesce)

    def cancel(self, item: SaveItem) -> None:
        if item.phase is Phase.STAGING:
            self.stage_scope.cancel()  # the stage task ends it

    def abandon(self, item: SaveItem) -> None:
        super().abandon(item)
        self.stage_scope.cancel()

    def _give_back(self) -> None:
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.release()

    def release(self) -> None:
        self._give_back()
        super().release()
        stage, self.stage = self.stage, None
        if stage is not None:
            stage.close()  # never awaited: no warning; the stager abandons its job
