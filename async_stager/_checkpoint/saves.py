"""The save policy: which accepted saves stage, wait, are dropped, and start writing.

A ``SaveItem`` is one accepted ``save`` call; ``SaveQueue`` moves the items forward,
oldest first: it submits stages while buffer sets are free (a deferred save's snapshot
point), applies the policy (``"wait"``, ``"skip"``, ``"coalesce"``), and starts writes
while write slots are free, strictly in call order. The write itself (``Writer``) runs
in a thread of its own; what comes back to the loop is only its end and the moment the
staged copy is free, so the loop-side state here changes only on the loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc

from async_stager._checkpoint.disk import checkpoint_failure
from async_stager._checkpoint.item import Phase, SaveItem, clear_frames
from async_stager._checkpoint.node_budget import CreditLedger, admit_item, yield_idle
from async_stager._checkpoint.options import CheckpointerOptions, SaveStats
from async_stager._checkpoint.progress import report_progress
from async_stager._checkpoint.ranks import Ranks
from async_stager._checkpoint.write import GivenUp, Writer
from async_stager._core.aio.waiting import threadsafe, wait_future
from async_stager.errors import ClosedError

if TYPE_CHECKING:
    from async_stager._core.aio.stager import Stager

__all__ = ["SaveQueue"]

_log = logging.getLogger("async_stager.checkpoint")


class SaveQueue:
    """The accepted saves of one Checkpointer and the policy that moves them.

    ``sets``: buffer sets a save may hold at once; ``deliver``: called on the loop with
    each commit's stats. Opened with the Checkpointer (``open``): its task group, its
    writer and its stager."""

    def __init__(
        self,
        options: CheckpointerOptions,
        ranks: Ranks,
        sets: int,
        deliver: Callable[[SaveStats], None],
    ) -> None:
        self.options = options
        self.ranks = ranks
        self.sets = sets
        self.deliver = deliver
        self.items: list[SaveItem] = []
        self.seq = 0
        #: Failed writes not yet raised, (call order, error): raised oldest call first.
        self.failures: list[tuple[int, BaseException]] = []
        self.dropped: list[int] = []
        self.abandoned = False
        #: The newest commit's write rate (bytes per second): the in-flight view's ETA.
        self.rate: float | None = None
        self._changed: anyio.Event | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._writer: Writer | None = None
        self._stager: Stager | None = None
        self._ledger: CreditLedger | None = None
        #: Guards what a write's thread may change when it ends (``_next_in_thread``)
        #: against the loop: a queued save's phase, the items' order of writes.
        self._lock = threading.RLock()
        self._wake: Callable[[], None] | None = None
        self._waker_scope: anyio.CancelScope | None = None
        self._loop_thread = -1
        self._forgotten: list[SaveItem] = []
        #: Commits whose stats wait for an earlier save to end: delivered in call order
        #: (= commit order). Hazard: writes end in their threads, so the loop may see a
        #: later write's end first.
        self._undelivered: dict[int, SaveStats] = {}

    @property
    def writing(self) -> int:
        """Writes holding a slot: started, their thread not ended."""
        return sum(1 for i in self.items if i.phase is Phase.WRITING and not i.finished.is_set())

    def open(
        self, tg: anyio.abc.TaskGroup, writer: Writer, stager: Stager, ledger: CreditLedger | None = None
    ) -> None:
        self._tg, self._writer, self._stager, self._ledger = tg, writer, stager, ledger
        self._changed = anyio.Event()
        self.abandoned = False
        # A write's thread that started the next write asks the loop to start its
        # tasks. Hazard: a thread-safe callback runs outside any task, where anyio
        # cannot start tasks, so it only sets an event that this task waits on.
        woken = anyio.Event()
        scope = self._waker_scope = anyio.CancelScope()
        self._wake = threadsafe(lambda: woken.set())
        self._loop_thread = threading.get_ident()

        async def waker() -> None:
            nonlocal woken
            with scope:
                while True:
                    await woken.wait()
                    woken = anyio.Event()
                    while self._forgotten:
                        self.forget(self._forgotten.pop(0))
                    self.advance()

        tg.start_soon(waker)

    def stop_waker(self) -> None:
        """Before the task group ends (the Checkpointer's close)."""
        if self._waker_scope is not None:
            self._waker_scope.cancel()

    def close(self) -> None:
        self._tg = None

    @property
    def writer(self) -> Writer:
        assert self._writer is not None
        return self._writer

    @property
    def stager(self) -> Stager:
        assert self._stager is not None
        return self._stager

    # -- changes -----------------------------------------------------------------------

    def notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = anyio.Event()

    async def changes(self) -> None:
        assert self._changed is not None
        await self._changed.wait()

    def raise_failure(self) -> None:
        if self.failures:
            raise self.failures.pop(0)[1]

    async def drain(self) -> None:
        for item in list(self.items):
            await item.done.wait()

    # -- accepting -----------------------------------------------------------------------

    def submit(
        self, sd: dict[str, Any], step: int, called: float, *, largest: int = 0, point: Any = None
    ) -> SaveItem:
        """Accept a save; ``point``: its snapshot point, taken at the call on the
        caller's streams (every stage or pipeline of it starts from there)."""
        item = SaveItem(
            self.seq, step, anyio.Event(), anyio.Event(), sd=sd, called=called, largest=largest, point=point
        )
        self.seq += 1
        if self.options.host_budget_bytes is not None and not self._make_job(item):
            # Refused at its start (raised to the save's caller): never queued.
            item.phase = Phase.DONE
            for event in (item.settled, item.finished):
                event.set()
            item.read.set()
            item.done.set()
            return item
        with self._lock:
            self.items.append(item)
        self.advance()
        return item

    def forget(self, item: SaveItem) -> None:
        """A save's coroutine died never awaited: abandoned unless its write started.
        Its finalizer runs wherever the coroutine died: the cyclic collector may run
        it in any thread, where nothing of the loop's may be touched (a task started,
        a scope cancelled), so there it is handed to the loop."""
        if threading.get_ident() != self._loop_thread:
            self._forgotten.append(item)
            if self._wake is not None:
                self._wake()
            return
        if not item.awaited and item.phase in (Phase.DEFERRED, Phase.STAGING, Phase.QUEUED):
            self.cancel(item)

    def in_flight(self) -> int:
        """Saves not yet ended: their write's thread has not finished (or not started)."""
        return sum(1 for i in self.items if not i.finished.is_set())

    def _holders(self) -> int:
        """Buffer sets held or about to be: saves staging, and staged copies not yet
        released (queued, or being written)."""
        return sum(1 for i in self.items if i.phase is Phase.STAGING or i.lease is not None or i.admitting)

    def advance(self) -> None:
        """Move the saves forward, oldest first: submit stages while buffer sets are
        free (the snapshot point of a deferred save), then start writes while slots are
        free, strictly in call order (a save never starts writing before an older one,
        so a commit never waits for a save that waits for its slot). Runs in background
        tasks and at each call: a save progresses whether or not its caller awaits."""
        with self._lock:
            self._advance()

    def _advance(self) -> None:
        tg = self._tg
        if tg is None or self.abandoned:
            return
        for item in self.items:
            if item.phase is Phase.WRITING and not item.tasks:
                self._start_tasks(tg, item)  # its write a thread started
        opts = self.options
        budgeted = opts.host_budget_bytes is not None
        if not budgeted:
            free = self.sets - self._holders()
            for item in self.items:
                if free <= 0:
                    break
                if item.phase is not Phase.DEFERRED or item.sd is None or item.stream or item.admitting:
                    continue
                if self._ledger is not None and item.admission is None:
                    # The node budget first (a worker thread): staged or streamed.
                    item.admitting = True
                    tg.start_soon(self._admit_task, item)
                else:
                    item.stage = self.stager.lease(
                        item.sd, checksums=self._checksums_while_staging(), at=item.point
                    )
                    item.sd = None
                    item.phase = Phase.STAGING
                    item.queued = time.monotonic() - item.called
                    tg.start_soon(self._stage_task, item)
                free -= 1
        for item in self.items:
            if self.writing >= opts.max_in_flight:
                break
            if item.phase is Phase.QUEUED:
                self._start_write(tg, item)
            elif (budgeted or item.stream) and item.phase is Phase.DEFERRED:
                self._start_budgeted(tg, item)
            elif item.phase is not Phase.WRITING:
                break
        self.notify()

    def _checksums_while_staging(self) -> bool:
        """Never: the write's thread hashes the staged host copy beside the write (the
        bytes as staged, before they reach the disk), on every device. On the CPU,
        hashing in the copy threads lengthened the caller's blocked time; on a GPU the
        device hash reads the source at another moment than the copy, so a buffer that
        training writes during an overlapped stage (BatchNorm's running statistics)
        made restore reject a checkpoint written correctly. ``stager.lease(sd,
        checksums=True)`` keeps the device hash for callers who want it."""
        return False

    def _start_write(self, tg: anyio.abc.TaskGroup, item: SaveItem) -> None:
        self._begin_write(item)
        self._start_tasks(tg, item)

    def _begin_write(self, item: SaveItem) -> None:
        """Start ``item``'s write in a thread of its own, now (holding ``_lock``; on the
        loop, or in the thread of a write that just ended): not in a task, which would
        run only at the loop's next turn, which a training loop that does not yield
        never gives. Its loop-side tasks follow (``_start_tasks``)."""
        item.phase = Phase.WRITING
        item.phase_detail = Phase.WRITING
        item.wrote = True
        if not item.awaited:
            item.settled.set()  # nobody waits in save(): nobody can give it up now
        item.earlier = [i.finished for i in self.items if i.seq < item.seq]
        if item.lease is not None:
            # Its thread calls ``on_freed`` once the staged copy is written and hashed;
            # a task then gives the copy back. Hazard: a thread-safe callback runs
            # outside any task, where anyio cannot start tasks, so the thread only sets
            # an event that a task waits on.
            assert item.on_freed is not None
            item.future = self.writer.start(item, item.lease, item.on_freed, then=self._next_in_thread)
        elif item.job is not None:
            item.future = self.writer.start_budgeted(item, then=self._next_in_thread)

    def _start_tasks(self, tg: anyio.abc.TaskGroup, item: SaveItem) -> None:
        """The loop-side part of a started write: its end, the moment its staged copy is
        free, its progress records, and (budgeted) the moment its sources were read."""
        item.tasks = True
        if item.freed is not None:
            tg.start_soon(self._release_when, item, item.freed)
        tg.start_soon(self._write_task, item)
        tg.start_soon(report_progress, item, lambda: self.rate)
        if item.job is not None:
            tg.start_soon(self._budget_fence_task, item)

    def _next_in_thread(self) -> None:
        """A write's thread ended (in that thread): start the next queued staged save's
        write at once, if a slot is free and every older save is writing or ended (the
        order ``advance`` keeps), so a queued save (``"coalesce"``, ``"wait"``) does not
        wait for the loop's next turn. Its loop-side tasks start at that turn."""
        started = False
        with self._lock:
            if self._tg is None or self.abandoned:
                return
            for item in list(self.items):
                if self.writing >= self.options.max_in_flight:
                    break
                if item.phase is Phase.WRITING:
                    continue
                if item.phase is not Phase.QUEUED or item.on_freed is None:
                    break
                self._begin_write(item)
                started = True
        if started and self._wake is not None:
            self._wake()

    def end(self, item: SaveItem, *, dropped: bool = False) -> None:
        """An item leaves: committed, failed, dropped or abandoned (idempotent)."""
        with self._lock:
            if item.phase is Phase.DONE:
                return
            item.phase = Phase.DONE
            item.release()
            item.settled.set()
            item.finished.set()
            item.read.set()
            item.done.set()
            if item in self.items:
                self.items.remove(item)
            if dropped:
                item.superseded = True
                self.dropped.append(item.step)
            if item.request is not None:
                item.request._finish(item.stats if item.committed else None, item.failure)
            self.advance()
        if threading.get_ident() == self._loop_thread:
            self._flush_deliveries()  # an earlier save that ended uncommitted frees later commits
        self.notify()

    def cancel(self, item: SaveItem) -> None:
        """The caller gave the save up before it returned: nothing is saved for it."""
        with self._lock:  # a queued save's write may start in another's thread
            self._cancel(item)

    def _cancel(self, item: SaveItem) -> None:
        item.cancelled = True
        item.settled.set()  # after ``cancelled``: the write's thread reads it next
        if item.phase is Phase.STAGING:
            item.stage_scope.cancel()  # the stage task ends it
        elif item.phase in (Phase.DEFERRED, Phase.QUEUED):
            self.end(item)
        elif item.phase is Phase.WRITING and item.lease is None and not item.read.is_set():
            item.scope.cancel()  # a budgeted save before its last piece: nothing committed
        # A staged save already handed its write slot: the write's thread sees
        # ``cancelled`` before it writes, and again before it commits.

    def abandon(self) -> None:
        """The exit deadline passed: stop waiting for the saves in flight (their
        threads go on until the process exits, and commit nothing: the Checkpointer
        that owned them has closed, and a later one may own the folder)."""
        with self._lock:
            self.abandoned = True
        for item in list(self.items):
            if item.phase is Phase.WRITING:
                item.cancelled = True  # its thread checks it before it commits
                item.settled.set()
                item.scope.cancel()
                item.stage_scope.cancel()  # (a budgeted save's wait for its last piece)
                if item.thread_wait is not None:
                    item.thread_wait.cancel()
            else:
                item.stage_scope.cancel()
                self.end(item)

    # -- the node budget ------------------------------------------------------------------

    async def _admit_task(self, item: SaveItem) -> None:
        """How a save meets the node budget (``node_budget.admit_item``), then on with
        it: a failure ends it (raised to its caller), a save given up meanwhile is not
        saved, else it stages or streams. Cancellation: as ``admit_item``."""
        assert self._ledger is not None
        outcome = await admit_item(self._ledger, self.stager, item)
        if outcome == "failed":
            self.end(item)
        elif outcome == "admitted":
            self.advance()
            self.notify()

    async def _yield_idle(self) -> None:
        if self._ledger is not None:
            await yield_idle(self.stager, self._ledger)

    # -- staging -------------------------------------------------------------------------

    async def _stage_task(self, item: SaveItem) -> None:
        """Finish a submitted stage (in the background: the caller may await later)."""
        stage, item.stage = item.stage, None
        if stage is None:
            # Ended (abandoned at a missed exit deadline, given up) before this task
            # ran: its stage was closed with it.
            self.end(item)
            return
        t1 = time.monotonic()
        lease = None
        try:
            with item.stage_scope:  # cancelled when the caller cancels its save
                lease = await stage
        except Exception as exc:  # noqa: BLE001 - the stage failed: raised to the save's caller
            item.error = exc
        del stage
        if self._ledger is not None:
            self._ledger.drop_credit()  # what the stage did not draw of its admission
        if lease is not None and (item.cancelled or item.phase is Phase.DONE):
            lease.release()
            lease = None
        if lease is None:
            self.end(item)
            return
        item.lease = lease
        item.staged = time.monotonic() - t1
        freed = item.freed = anyio.Event()
        item.on_freed = threadsafe(freed.set)
        with self._lock:
            item.phase = Phase.QUEUED
        item.read.set()
        self.advance()
        self.coalesce()
        self.notify()

    def coalesce(self) -> None:
        """``"coalesce"``: of the queued saves, keep the newest whose ``save()``
        returned and every newer one (still cancellable); drop the older ones. Keyed by
        call order, not by when a stage finished: concurrent stages finish in any
        order, and an older one finishing last must not stay queued beside a newer."""
        if self.options.policy != "coalesce":
            return
        with self._lock:
            self._coalesce()

    def _coalesce(self) -> None:
        kept = [i.seq for i in self.items if i.phase is Phase.QUEUED and i.returned]
        if not kept:
            return
        newest = max(kept)
        for older in [i for i in self.items if i.phase is Phase.QUEUED and i.seq < newest]:
            self.end(older, dropped=True)

    def _make_job(self, item: SaveItem) -> bool:
        """Build a budgeted save's job (``dcp.save``'s checks and pipeline) from its
        snapshot point; its fence points are read now (the caller's streams, when
        called at ``save()``). A refusal is raised to the save's caller."""
        from async_stager._dcp.budget import BudgetSettings, budgeted_save

        ranks, ledger = self.ranks, self._ledger
        try:
            settings = BudgetSettings(
                self.options.host_budget_bytes or (ledger.budget if ledger is not None else 0),
                str(self.writer.tmp(item)),
                process_group=ranks.group,
                no_dist=not ranks.distributed,
                on_stats=item.budget.append,
                digests=item.digests if self.options.checksums else None,
                ledger=ledger,
                captures=item.point,
            )
            job = budgeted_save(item.sd or {}, self.stager, settings)
        except Exception as exc:  # noqa: BLE001 - refused at its start: raised to the save's caller
            item.error = exc
            return False
        item.job = job
        item.fence_wait = job.pipeline.fence(at_call=True)  # the streams of the save() call
        return True

    def _start_budgeted(self, tg: anyio.abc.TaskGroup, item: SaveItem) -> None:
        """Start a budgeted save's write (building its job first if a node budget's
        admission chose it); a task of its own waits until its last piece is copied
        (``item.read``)."""
        item.queued = time.monotonic() - item.called
        ledger = self._ledger
        if ledger is not None and item.admission is None:
            item.admission = "streamed"
        if item.job is None and not self._make_job(item):
            self.end(item)
            return
        self._start_write(tg, item)

    async def _budget_fence_task(self, item: SaveItem) -> None:
        t1 = time.monotonic()
        try:
            if item.fence_wait is not None:
                # Its last piece enqueued, and the streams read at its call ordered
                # after its copies (no host wait). Cancelled at a missed exit deadline.
                with item.stage_scope:
                    await item.fence_wait()
        finally:
            item.staged = time.monotonic() - t1
            item.read.set()
            self.notify()

    async def await_save(self, item: SaveItem) -> bool:
        """The caller's side of a save: wait until it is staged (``"coalesce"``: queued
        is enough; ``"wait"``: until its write started; budgeted: until its last piece
        is copied). Cancellation: before that, the save is given up."""
        item.awaited = True
        opts = self.options
        try:
            while True:
                if item.error is not None:
                    raise item.error
                if opts.host_budget_bytes is not None or item.stream:
                    if item.read.is_set() and item.phase is not Phase.DEFERRED:
                        break
                elif item.phase is Phase.WRITING or (
                    item.phase is Phase.QUEUED and opts.policy == "coalesce"
                ):
                    break
                if item.phase is Phase.DONE:
                    if item.committed or item.wrote or item.superseded:
                        break
                    raise ClosedError("the Checkpointer closed before this save was staged")
                await self.changes()
        except BaseException:
            if item.error is None:
                self.cancel(item)
            item.settled.set()
            raise
        # No await from the loop's exit to here: a cancellation cannot come between
        # "staged" and "returned", so a queued save replaces older ones only once its
        # caller can no longer give it up.
        item.returned = True
        item.settled.set()
        self.coalesce()
        return True

    # -- writing -------------------------------------------------------------------------

    async def _write_task(self, item: SaveItem) -> None:
        writer = self.writer
        stats: SaveStats | None = None
        try:
            outcome = await self._write_outcome(writer, item)
            if isinstance(outcome, BaseException):
                # Caught one frame down, in a frame that has returned: clearing the
                # error's frames then reaches every frame that held the staged copy
                # (an executing frame, this one, cannot be cleared).
                self._record_failure(item, outcome)
            else:
                stats = item.stats = outcome
            del outcome
        finally:
            item.finished.set()  # (the thread's end) later commits need not wait for the loop
            if not item.committed and not self.abandoned:
                await writer.discard(item)
            self.end(item)
        if stats is not None:
            self.rate = stats.bytes_per_second or self.rate
            self._undelivered[item.seq] = stats
        self._flush_deliveries()

    def _flush_deliveries(self) -> None:
        """On the loop: deliver the commits no earlier save is still ahead of, in call
        order."""
        if not self._undelivered:
            return
        ahead = min((i.seq for i in self.items), default=None)
        for seq in sorted(self._undelivered):
            if ahead is not None and seq > ahead:
                break
            self.deliver(self._undelivered.pop(seq))

    async def _write_outcome(self, writer: Writer, item: SaveItem) -> SaveStats | BaseException | None:
        """Run the write: its stats, its failure (returned, not raised), or None when
        its caller gave it up before ``save()`` returned (nothing committed)."""
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

        try:
            with item.scope:  # shielded: outer cancellation does not stop a write
                return await self._write(writer, item)
        except GivenUp:
            return None
        except (Exception, CheckpointException) as group:  # noqa: BLE001 - kept for the next save/wait
            return group
        return None  # its scope was cancelled (a budgeted save given up): nothing committed

    async def _write(self, writer: Writer, item: SaveItem) -> SaveStats:
        fut, item.future = item.future, None
        if fut is None:
            if item.job is not None:
                item.job.forget()  # never started: its fence hook must go now
            raise GivenUp
        try:
            return await wait_future(fut)
        except BaseException:
            if item.job is not None and not fut.done():
                # A budgeted save given up before its last piece (its scope cancelled):
                # stop its copies and wait for its thread, unless the exit deadline
                # passed (then the thread is left to the process's end).
                item.job.abort()
                if not self.abandoned:
                    # Shielded, but not past a missed exit deadline (``abandon``
                    # cancels it): a value's serialization may ignore the abort.
                    with anyio.CancelScope(shield=True) as item.thread_wait:
                        try:
                            await wait_future(fut)
                        except BaseException:  # noqa: BLE001 - its failure (DCP's CheckpointException is one): given up
                            pass
            raise
        finally:
            if item.freed is not None:
                item.freed.set()  # the write ended (or failed) before it said so

    async def _release_when(self, item: SaveItem, freed: anyio.Event) -> None:
        await freed.wait()
        if item.phase is Phase.WRITING:
            item.release()  # the staged buffers are free for the next stage
            self.advance()
            if self._ledger is not None:
                await self._yield_idle()

    def _record_failure(self, item: SaveItem, group: BaseException) -> None:
        exc: BaseException = group
        while len(getattr(exc, "exceptions", ())) == 1:  # a task group's wrapper
            exc = exc.exceptions[0]  # type: ignore[attr-defined]
        clear_frames(exc)
        failure = checkpoint_failure(item.step, exc, self.options.directory)
        _log.error("%s", failure)
        item.failure = failure
        self.failures.append((item.seq, failure))  # each raised once, oldest call first
        self.failures.sort(key=lambda f: f[0])
