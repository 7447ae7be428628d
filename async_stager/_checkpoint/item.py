"""A save's core record (``SaveItem``), the interface of the routes a save travels
(``Route``, and ``Lane``: what the save queue lends a route), and clearing the frames
an error holds. Below the queue (``saves``), the writer (``write``), the routes
(``routes``) and the progress view, so none of them imports another's module.

A save is one record and one route. The record is what every save has: its call order
(``seq``), its step, its phase, its timings, its events and its outcome. The route owns
everything that depends on how the save travels (a lease and its staged copy, a
budgeted job, the node budget's admission, the hand-over to the memory agent) and the
steps that move it; the queue only orders saves and applies the policy, through the
``Route`` methods, never asking which route a save takes.
"""

from __future__ import annotations

import abc
import enum
import threading
import traceback
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import anyio

if TYPE_CHECKING:
    from collections.abc import Callable

    import anyio.abc

    from async_stager._checkpoint.options import SaveStats

__all__ = ["Lane", "Phase", "Route", "SaveItem", "clear_frames"]


class Phase(enum.Enum):
    """Where a save is; ``value`` is the phase ``SaveProgress`` shows (public strings).

    The queue's phases: ``DEFERRED`` (waits for a buffer set, its admission, or a write
    slot when it streams), ``STAGING``, ``QUEUED`` (staged, waits for a write slot),
    ``WRITING`` (holds a write slot until its thread ends), ``DONE``. Within ``WRITING``
    a route shows ``WRITING`` (its files) or ``COMMITTING`` (waits for the earlier
    saves, then commits); a memory snapshot shows ``MEMORY_STAGING`` or
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
    """One accepted ``save`` call: the core record every route shares. ``read`` is set
    once its sources were read (or it ended without reading them); ``done`` once it
    is committed, failed or dropped."""

    seq: int
    step: int
    route: Route
    #: When ``save`` was called (monotonic seconds).
    called: float
    phase: Phase = Phase.DEFERRED
    read: anyio.Event = field(default_factory=anyio.Event)
    done: anyio.Event = field(default_factory=anyio.Event)
    #: Seconds from the call to its stage (or its write, when it streams), and that
    #: its stage (or its last piece) took.
    queued: float = 0.0
    staged: float = 0.0
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
    #: The caller awaited the save's coroutine / its ``save()`` returned (only then does
    #: it replace older queued saves: a save cancelled before it returned never drops
    #: the one it would have replaced) / the caller gave it up.
    awaited: bool = False
    returned: bool = False
    cancelled: bool = False
    #: Its write started; its loop-side tasks were started (a write a thread started,
    #: when an earlier one ended, gets them at the loop's next turn).
    wrote: bool = False
    tasks: bool = False
    #: What its commit waits for beyond the earlier saves (a reader of the step it
    #: replaces), for a person; "" when nothing. Set by the write's thread.
    waiting_for: str = ""
    #: The outcome: committed; dropped (by ``"coalesce"``: a newer save replaced it before
    #: its write; its step is listed in ``dropped``); not taken by its route (its
    #: ``save()`` returns False); a refusal or stage failure for its caller (``error``);
    #: its write's failure (``failure``); the commit's stats; the SaveRequest it answers.
    committed: bool = False
    superseded: bool = False
    skipped: bool = False
    error: BaseException | None = None
    failure: BaseException | None = None
    stats: SaveStats | None = None
    request: Any = None

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


class Lane(Protocol):
    """What the save queue lends a route: its callbacks, on the loop (``end`` also from a
    write's thread, under the queue's lock)."""

    @property
    def abandoned(self) -> bool:
        """The exit deadline passed: nothing more is started or waited for."""

    def advance(self) -> None:
        """Move the saves forward (a buffer set or a write slot may be free)."""

    def notify(self) -> None:
        """Wake the callers waiting on the saves' state."""

    def end(self, item: SaveItem) -> None:
        """``item`` leaves the queue (idempotent)."""

    def staged(self, item: SaveItem) -> None:
        """``item`` is staged (``QUEUED``): the policy may apply (``"coalesce"``)."""

    def skip(self, item: SaveItem, *, dropped: bool) -> None:
        """``item``'s route did not take it (its ``save()`` returns False); ``dropped``:
        its step is listed in ``dropped`` (no other route saves it)."""


class Route(abc.ABC):
    """How one save travels from ``save()`` to its commit: the state it owns and the
    steps that move it. The queue calls these, in its own order and policy; each
    answers for this route only. Every method runs on the loop unless it says
    otherwise.

    Common to every route: its write's thread (``future``), the write's own cancel
    scope (shielded from outer scopes; cancelled to give up a save before its sources
    were read, or at a missed exit deadline), and what a progress view shows of the
    write (``bytes`` once known, ``writing``: ``WRITING`` or ``COMMITTING``, set by
    the write's thread)."""

    def __init__(self) -> None:
        self.future: Future[SaveStats] | None = None
        self.scope = anyio.CancelScope(shield=True)
        self.bytes: int | None = None
        self.writing = Phase.WRITING

    # -- accepting and buffer sets ---------------------------------------------------

    def accept(self, item: SaveItem) -> bool:
        """At ``submit``: prepare what must be read at the call. False: refused
        (``item.error`` is raised to the caller; it is never queued)."""
        return True

    def holds_set(self, item: SaveItem) -> bool:
        """It holds one of the queue's buffer sets, or is about to."""
        return False

    def wants_set(self, item: SaveItem) -> bool:
        """``DEFERRED`` and waiting for a buffer set to move on."""
        return False

    def take_set(self, item: SaveItem, lane: Lane, tg: anyio.abc.TaskGroup) -> None:
        """A buffer set is free for it (``wants_set``): start its stage (or what
        decides how it stages), in a task of ``tg``."""
        raise AssertionError(f"{type(self).__name__} takes no buffer set")

    # -- the write ----------------------------------------------------------------------

    @abc.abstractmethod
    def writable(self, item: SaveItem, *, in_thread: bool = False) -> bool:
        """It may take a write slot now (its turn in call order is the queue's);
        ``in_thread``: asked from a write's thread that just ended, off the loop."""

    def prepare_write(self, item: SaveItem) -> bool:
        """Just before its write starts (under the queue's lock): False if it cannot
        (``item.error`` is set; the queue ends it)."""
        return True

    @abc.abstractmethod
    def start_write(self, item: SaveItem, then: Callable[[], None]) -> None:
        """Start its write now (under the queue's lock, on the loop or in the thread of
        a write that just ended): a thread of its own sets ``future`` and calls
        ``then`` in that thread once it ended; a write on the loop runs in
        ``wait_write``."""

    def shown(self, item: SaveItem) -> Phase:
        """The phase a progress view shows for it."""
        return self.writing if item.phase is Phase.WRITING else item.phase

    def start_tasks(self, item: SaveItem, lane: Lane, tg: anyio.abc.TaskGroup) -> None:
        """The loop-side tasks of its started write, besides the queue's own (its end,
        its progress records)."""

    @abc.abstractmethod
    async def wait_write(self, item: SaveItem, lane: Lane) -> SaveStats | None:
        """Wait for its write (inside ``scope``): its stats (None: nothing for
        ``on_saved``), or its error raised (``GivenUp`` when its caller gave it up in
        time)."""

    async def write(self, item: SaveItem, lane: Lane) -> SaveStats | None:
        """Its write, inside its shielded ``scope``; None if the scope was cancelled
        (given up before its sources were read, or at a missed exit deadline)."""
        with self.scope:  # shielded: outer cancellation does not stop a write
            return await self.wait_write(item, lane)
        return None

    # -- its caller, cancelling, leaving -----------------------------------------------

    @abc.abstractmethod
    def returns(self, item: SaveItem, *, coalesce: bool) -> bool:
        """Its caller's ``save()`` may return now (what "staged" means on this route);
        ``coalesce``: the policy lets a queued save return."""

    def cancel(self, item: SaveItem) -> None:
        """Its caller gave it up while it was ``STAGING`` or ``WRITING`` (``cancelled``
        and ``settled`` are set): stop what may stop. A started write's thread sees
        ``cancelled`` before it writes, and again before it commits."""

    def abandon(self, item: SaveItem) -> None:
        """The exit deadline passed: cancel every wait of its own."""
        self.scope.cancel()

    def release(self) -> None:
        """It left the queue: give back what it holds (idempotent)."""

    async def discard(self, item: SaveItem) -> None:
        """Remove what its write left after it failed or was given up. Cancellation:
        deferred until it is removed."""


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
