"""The save queue: the policy that orders a Checkpointer's saves, whatever their route.

A ``SaveItem`` is one accepted ``save`` call and its ``Route`` (``item``; the routes
are in ``routes``). ``SaveQueue`` moves the items forward, oldest first: it lends free
buffer sets to the saves that wait for one, applies the policy (``"wait"``,
``"skip"``, ``"coalesce"``), starts writes while write slots are free
(``max_in_flight``), strictly in call order, and delivers the commits in call order.
It asks each route what it needs through the ``Route`` methods and never which route
a save takes. A write runs in a thread of its own; what comes back to the loop is only
its end (and what its route's own tasks wait for), so the loop-side state here changes
only on the loop, except a queued save's write, which the thread of a write that ended
may start (under the queue's lock).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import anyio
import anyio.abc

from async_stager._checkpoint.disk import checkpoint_failure
from async_stager._checkpoint.item import Phase, SaveItem, clear_frames
from async_stager._checkpoint.options import CheckpointerOptions, SaveStats
from async_stager._checkpoint.progress import finish_request, report_progress
from async_stager._checkpoint.write import GivenUp
from async_stager._core.aio.waiting import threadsafe
from async_stager.errors import CheckpointError, ClosedError

if TYPE_CHECKING:
    from async_stager._checkpoint.item import Route

__all__ = ["SaveQueue"]

_log = logging.getLogger("async_stager.checkpoint")


class SaveQueue:
    """The accepted saves of one Checkpointer and the policy that moves them.

    ``sets``: buffer sets the saves may hold at once; ``deliver``: called on the loop
    with each commit's stats, in commit order. Opened with the Checkpointer (``open``:
    its task group)."""

    def __init__(self, options: CheckpointerOptions, sets: int, deliver: Callable[[SaveStats], None]) -> None:
        self.options = options
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

    def open(self, tg: anyio.abc.TaskGroup) -> None:
        self._tg = tg
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

    def raise_at_close(self) -> None:
        """At the close: nothing comes after it to raise the failures not yet raised,
        so more than one are one CheckpointError (each was logged when it happened),
        the oldest as its cause."""
        if len(self.failures) > 1:
            failures = [f for _, f in self.failures]
            self.failures.clear()
            steps = [getattr(f, "step", None) for f in failures]
            err = CheckpointError(
                f"{len(failures)} checkpoint writes failed before the close (steps {steps}): "
                + "; ".join(str(f).splitlines()[0] for f in failures)
            )
            err.failures = failures  # type: ignore[attr-defined]
            raise err from failures[0]
        self.raise_failure()

    async def drain(self) -> None:
        for item in list(self.items):
            await item.done.wait()

    # -- accepting -----------------------------------------------------------------------

    def submit(self, route: Route, step: int, called: float) -> SaveItem:
        """Accept a save of ``step`` along ``route`` (``called``: when ``save`` was
        called). A route that refuses it at its start (``Route.accept``) leaves it
        ended, its error for the caller: never queued."""
        item = SaveItem(self.seq, step, route, called)
        self.seq += 1
        if not route.accept(item):
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

    @property
    def full(self) -> bool:
        """As many saves in flight as write slots (``"skip"`` skips a save now). In
        flight: not ended by its write's thread (a write that committed in its thread
        is done, even before the loop has seen its end)."""
        return self.in_flight() >= self.options.max_in_flight

    def advance(self) -> None:
        """Move the saves forward, oldest first: lend free buffer sets to the saves that
        wait for one (a deferred save stages from its snapshot point), then start writes
        while slots are free, strictly in call order (a save never starts writing before
        an older one, so a commit never waits for a save that waits for its slot). Runs
        in background tasks and at each call: a save progresses whether or not its
        caller awaits."""
        with self._lock:
            self._advance()

    def _advance(self) -> None:
        tg = self._tg
        if tg is None or self.abandoned:
            return
        for item in self.items:
            if item.phase is Phase.WRITING and not item.tasks:
                self._start_tasks(tg, item)  # its write a thread started
        free = self.sets - sum(1 for i in self.items if i.route.holds_set(i))
        for item in self.items:
            if free <= 0:
                break
            if item.phase is Phase.DEFERRED and item.route.wants_set(item):
                item.route.take_set(item, self, tg)
                free -= 1
        for item in list(self.items):
            if self.writing >= self.options.max_in_flight:
                break
            if item.phase is Phase.WRITING:
                continue
            if not item.route.writable(item):
                break
            if self._begin_write(item):
                self._start_tasks(tg, item)
        self.notify()

    def _begin_write(self, item: SaveItem) -> bool:
        """Start ``item``'s write in a thread of its own, now (holding ``_lock``; on the
        loop, or in the thread of a write that just ended): not in a task, which would
        run only at the loop's next turn, which a training loop that does not yield
        never gives. Its loop-side tasks follow (``_start_tasks``). False: its route
        could not start it (its error is for its caller; it ended)."""
        if not item.route.prepare_write(item):
            self.end(item)
            return False
        item.phase = Phase.WRITING
        item.wrote = True
        if not item.awaited:
            item.settled.set()  # nobody waits in save(): nobody can give it up now
        item.earlier = [i.finished for i in self.items if i.seq < item.seq]
        item.route.start_write(item, self._next_in_thread)
        return True

    def _start_tasks(self, tg: anyio.abc.TaskGroup, item: SaveItem) -> None:
        """The loop-side part of a started write: its route's tasks, its end, and its
        progress records."""
        item.tasks = True
        item.route.start_tasks(item, self, tg)
        tg.start_soon(self._write_task, item)
        tg.start_soon(report_progress, item, lambda: self.rate)

    def _next_in_thread(self) -> None:
        """A write's thread ended (in that thread): start the next queued save's write
        at once, if a slot is free, its route lets a thread start it, and every older
        save is writing or ended (the order ``advance`` keeps), so a queued save
        (``"coalesce"``, ``"wait"``) does not wait for the loop's next turn. Its
        loop-side tasks start at that turn."""
        started = False
        with self._lock:
            if self._tg is None or self.abandoned:
                return
            for item in list(self.items):
                if self.writing >= self.options.max_in_flight:
                    break
                if item.phase is Phase.WRITING:
                    continue
                if not item.route.writable(item, in_thread=True):
                    break
                started = self._begin_write(item) or started
        if started and self._wake is not None:
            self._wake()

    def staged(self, item: SaveItem) -> None:
        """``item``'s route staged it: it is queued for a write slot, its sources read."""
        with self._lock:
            item.phase = Phase.QUEUED
        item.read.set()
        self.advance()
        self.coalesce()
        self.notify()

    def skip(self, item: SaveItem, *, dropped: bool) -> None:
        """``item``'s route did not take it: its ``save()`` returns False."""
        item.skipped = True
        self.end(item, dropped=dropped)

    def end(self, item: SaveItem, *, dropped: bool = False) -> None:
        """An item leaves: committed, failed, dropped or abandoned (idempotent)."""
        with self._lock:
            if item.phase is Phase.DONE:
                return
            item.phase = Phase.DONE
            item.route.release()
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
                finish_request(item.request, item.stats if item.committed else None, item.failure)
            self.advance()
        if threading.get_ident() == self._loop_thread:
            self._flush_deliveries()  # an earlier save that ended uncommitted frees later commits
        self.notify()

    def cancel(self, item: SaveItem) -> None:
        """The caller gave the save up before it returned: nothing is saved for it."""
        with self._lock:  # a queued save's write may start in another's thread
            item.cancelled = True
            item.settled.set()  # after ``cancelled``: the write's thread reads it next
            if item.phase in (Phase.DEFERRED, Phase.QUEUED):
                self.end(item)
            elif item.phase is not Phase.DONE:
                item.route.cancel(item)

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
                item.route.abandon(item)
            else:
                item.route.abandon(item)
                self.end(item)

    # -- the policy --------------------------------------------------------------------

    def coalesce(self) -> None:
        """``"coalesce"``: of the queued saves, keep the newest whose ``save()``
        returned and every newer one (still cancellable); drop the older ones. Keyed by
        call order, not by when a stage finished: concurrent stages finish in any
        order, and an older one finishing last must not stay queued beside a newer."""
        if self.options.policy != "coalesce":
            return
        with self._lock:
            kept = [i.seq for i in self.items if i.phase is Phase.QUEUED and i.returned]
            if not kept:
                return
            newest = max(kept)
            for older in [i for i in self.items if i.phase is Phase.QUEUED and i.seq < newest]:
                self.end(older, dropped=True)

    async def await_save(self, item: SaveItem) -> bool:
        """The caller's side of a save: wait until its route says it may return (staged;
        ``"coalesce"``: queued is enough); False if its route did not take it.
        Cancellation: before that, the save is given up."""
        item.awaited = True
        coalesce = self.options.policy == "coalesce"
        try:
            while True:
                if item.error is not None:
                    raise item.error
                if item.route.returns(item, coalesce=coalesce):
                    break
                if item.phase is Phase.DONE:
                    if item.committed or item.wrote or item.superseded or item.skipped:
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
        self.advance()  # (a route may start its write only once its caller settled)
        return not item.skipped

    # -- a write's end -------------------------------------------------------------------

    async def _write_task(self, item: SaveItem) -> None:
        try:
            outcome = await self._write_outcome(item)
            if isinstance(outcome, BaseException):
                # Caught one frame down, in a frame that has returned: clearing the
                # error's frames then reaches every frame that held the staged copy
                # (an executing frame, this one, cannot be cleared).
                self._record_failure(item, outcome)
            else:
                stats = item.stats = outcome
                if stats is not None:
                    self.rate = stats.bytes_per_second or self.rate
                    # Queued before ``end`` below: ``end`` delivers the later commits that
                    # waited for this save, and this one must go out before them (a later
                    # save's write may end first: saved() saw step 125 before 124).
                    self._undelivered[item.seq] = stats
            del outcome
        finally:
            item.finished.set()  # (the thread's end) later commits need not wait for the loop
            if not item.committed and not self.abandoned:
                await item.route.discard(item)
            self.end(item)
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

    async def _write_outcome(self, item: SaveItem) -> SaveStats | BaseException | None:
        """Run the write: its stats, its failure (returned, not raised), or None when
        its caller gave it up before ``save()`` returned (nothing committed)."""
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

        try:
            return await item.route.write(item, self)
        except GivenUp:
            return None
        except (Exception, CheckpointException) as group:  # noqa: BLE001 - kept for the next save/wait
            return group

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
