"""One accepted ``save`` call of a Checkpointer (``SaveItem``), and clearing the frames
an error holds: what the save policy (``saves``), the write (``write``), the node budget
and the progress view all read, below all of them so none imports another's module.
"""

from __future__ import annotations

import enum
import threading
import traceback
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio

if TYPE_CHECKING:
    from async_stager._core.aio.lease import Lease
    from async_stager._dcp.budget import BudgetedJob, BudgetStats

__all__ = ["Phase", "SaveItem", "clear_frames"]


class Phase(enum.Enum):
    """Where a save is; ``value`` is the phase ``SaveProgress`` shows (public strings).

    The queue's phases: ``DEFERRED`` (waits for a buffer set, or for a write slot when
    it streams), ``STAGING``, ``QUEUED`` (staged, waits for a write slot), ``WRITING``
    (holds a write slot until its thread ends), ``DONE``. Within ``WRITING`` a save's
    progress shows ``WRITING`` (its files) or ``COMMITTING`` (waits for the earlier
    saves, then commits). A memory snapshot shows ``MEMORY_STAGING`` or
    ``MEMORY_COMMITTING``."""

    DEFERRED = "deferred"
    STAGING = "staging"
    QUEUED = "queued"
    WRITING = "writing"
    COMMITTING = "committing"
    DONE = "done"
    MEMORY_STAGING = "memory-staging"
    MEMORY_COMMITTING = "memory-committing"


@dataclass(eq=False)
class SaveItem:
    """One accepted ``save`` call. ``phase``: see ``Phase``. ``read`` is set once its sources were read (or it
    ended without reading them); ``done`` once it is committed, failed or dropped."""

    seq: int
    step: int
    read: anyio.Event
    done: anyio.Event
    phase: Phase = Phase.DEFERRED
    #: Within ``WRITING``: ``WRITING`` (its files) or ``COMMITTING`` (waits for the
    #: earlier saves, then commits). Set by the write's thread.
    phase_detail: Phase | None = None
    #: What its commit waits for beyond the earlier saves (a reader of the step it
    #: replaces), for a person; "" when nothing. Set by the write's thread.
    waiting_for: str = ""
    #: Its tensor bytes, once known (at its write).
    bytes: int | None = None
    #: The resolved state, until its stage is submitted (or its pipeline built).
    sd: dict[str, Any] | None = None
    #: The submitted stage (``stager.lease`` coroutine), until it is awaited.
    stage: Coroutine[Any, Any, Lease[dict[str, Any]]] | None = None
    lease: Lease[dict[str, Any]] | None = None
    #: Its snapshot point, taken at the ``save`` call on the caller's streams
    #: (``Stager.snapshot_point``): a deferred save stages from it, whenever it stages.
    point: Any = None
    #: A budgeted save: its ``dcp.save`` job (``BudgetedJob``), run by its write's
    #: thread; and the wait that its fence points, read at the call, order.
    job: BudgetedJob | None = None
    fence_wait: Callable[[], Awaitable[None]] | None = None
    #: Its write's loop-side tasks were started (a write a thread started, when an
    #: earlier one ended, gets them at the loop's next turn).
    tasks: bool = False
    digests: dict[str, dict[str, Any]] = field(default_factory=dict)
    budget: list[BudgetStats] = field(default_factory=list)
    queued: float = 0.0
    staged: float = 0.0
    #: The write's own cancel scope (shielded from outer scopes): cancelled only to
    #: drop a budgeted save whose caller was cancelled, or at a missed exit deadline.
    scope: anyio.CancelScope = field(default_factory=lambda: anyio.CancelScope(shield=True))
    #: The stage task's scope: cancelled when the caller cancels the save while staging.
    stage_scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    committed: bool = False
    #: When ``save`` was called (monotonic seconds).
    called: float = 0.0
    #: The caller awaited the save's coroutine / gave it up / its stage failed.
    awaited: bool = False
    cancelled: bool = False
    #: Dropped by ``"coalesce"``: a newer save replaced it before its write.
    superseded: bool = False
    #: Its ``save()`` returned (the caller can no longer give it up): only then does it
    #: replace older queued saves (``"coalesce"``), so a save cancelled before it
    #: returned never drops the one it would have replaced.
    returned: bool = False
    #: The SaveRequest this save answers (``save_if_requested``), and its outcome.
    request: Any = None
    stats: Any = None
    failure: BaseException | None = None
    error: BaseException | None = None
    #: Its write started (a budgeted save's pipeline, or a staged copy's write).
    wrote: bool = False
    #: Set once it ended (by its write's thread, or on the loop): a thread event, so a
    #: later save's thread waits for it without the loop (commits in call order).
    finished: threading.Event = field(default_factory=threading.Event)
    #: Set once its caller can no longer give it up: ``save()`` returned, was
    #: cancelled, was never awaited when its write started, or the save ended. Its
    #: write's thread waits for it before it commits, so a save whose caller was
    #: cancelled while its write had already started is never committed.
    settled: threading.Event = field(default_factory=threading.Event)
    #: The ``finished`` events of the saves called before it, taken when its write
    #: starts (every one of them is writing or ended then).
    earlier: list[threading.Event] = field(default_factory=list)
    #: Node budget (``node_budget``): its largest tensor item's bytes (checked at
    #: ``save()``); its admission is being decided (it counts as a buffer set's
    #: holder meanwhile); how it met the budget (``Admission.path``) and the seconds it
    #: waited for it; ``stream``: it streams through the budgeted pipeline.
    largest: int = 0
    admitting: bool = False
    admission: str | None = None
    node_wait: float = 0.0
    stream: bool = False
    #: A staged save's write, started in its thread (``Writer.start``), until awaited;
    #: and the event its thread sets once the staged copy is free.
    future: Future[Any] | None = None
    freed: anyio.Event | None = None
    #: Sets ``freed`` from any thread (made on the loop once it is staged).
    on_freed: Callable[[], None] | None = None
    #: A given-up budgeted save's wait for its thread (cancelled at a missed exit
    #: deadline: the thread is then left to the process's end).
    thread_wait: anyio.CancelScope | None = None

    @property
    def ended(self) -> bool:
        """It left the queue (committed, failed, dropped or abandoned); read after an
        await, where the phase may have changed meanwhile."""
        return self.phase is Phase.DONE

    def readers_hold(self, pids: list[int] | None) -> None:
        """(Its write's thread) its commit waits for readers of the step it replaces, by
        pid where known (``holds.exclusive``); None: it no longer does."""
        if pids is None:
            self.waiting_for = ""
            return
        who = (
            f"pid {pids[0]}"
            if len(pids) == 1
            else f"pids {', '.join(map(str, pids))}"
            if pids
            else "a process"
        )
        self.waiting_for = (
            f"waits for a reader of step {self.step} to finish ({who} holds it: a restore reading it)"
        )

    def wait_earlier(self) -> None:
        """Block until every earlier save ended (from a write's thread)."""
        for event in self.earlier:
            event.wait()

    def release(self) -> None:
        """Give its staged copy back (idempotent)."""
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.release()
        self.sd = None
        stage, self.stage = self.stage, None
        if stage is not None:
            stage.close()  # never awaited: no warning; the stager abandons its job


def clear_frames(exc: BaseException) -> None:
    """Clear the locals of every frame an error's tracebacks reach: they hold the staged
    copy (``torch.save``'s and DCP's locals), and a handler or caller keeping the error
    must not keep the buffer set held. Walks causes, contexts, exception groups and
    DCP's ``CheckpointException.failures`` (per rank: an error or an (error, stack)
    pair), each error once."""
    todo: list[Any] = [exc]
    seen: set[int] = set()
    while todo:
        e = todo.pop()
        if isinstance(e, tuple):
            todo.extend(e)
            continue
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)
        todo.extend((e.__cause__, e.__context__))
        todo.extend(getattr(e, "exceptions", ()) or ())
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo.extend(failures.values())
