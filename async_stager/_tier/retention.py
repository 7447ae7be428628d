"""Which memory snapshots a rank may let go: the tier's promise, kept for the job.

The promise (docs/concepts.md, the memory tier): after a crash the ranks restore a step
that every rank holds complete, and lose at most one step against the newest step
whose ``save()`` had returned on every rank. A rank alone cannot keep it: ranks commit
in the background at their own speeds, so a rank that lets go of step *n-1* as soon as
its own *n* is complete may leave a slower rank (still committing *n*) without a step
in common with it. Hence the rule, checked where the ranks meet:

- A rank lets go of its snapshot of step *s* only once the ranks agreed that every one
  of them holds complete a newer step *c > s* (the job's newest common step), and it
  keeps its newest ``keep`` in any case. Nothing is cut before the snapshot that
  replaces it is complete (the agent's ``BEGIN`` forgets nothing the trainer holds).
- Agreement (``Agreement``): one exchange per memory save call, in call order, so that
  the ranks' collectives match whatever each save did (staged, skipped, refused). An
  exchange starts once that save's snapshot has ended (committed or not) and gathers,
  from every rank, the steps it holds complete in this run; each rank learns the newest
  common one and lets go of what the rule allows. The exchanges run in a thread of
  their own, never waiting for the event loop (see ``Agreement``).
- A save with no buffer set free (``keep + 1`` sets: ``keep`` held, one written) waits
  for the exchanges of the saves before it, which free one unless a rank failed to
  commit a step (refused, agent gone); then the oldest snapshot that is not the common
  one goes (the promise is already broken by that rank's failure, which it logged).

With replication (``replicator``) each rank also reports the steps it holds whose
replica its peer node verified, and what it finished sending: the newest step every
rank replicated is kept too (a lost node restores it), and every rank replicates the
same next step, decided from the same answers.

Why the promise holds: a rank's ``save(n)`` returns only after its own snapshot of
*n-1* ended (one snapshot at a time), so once every rank returned from ``save(n)``,
every rank holds *n-1* complete, and none lets go of it before all hold a newer one.
The views exchanged may be stale (an exchange reports what a rank held when it ran),
which only delays a release: a step is let go only for a newer one that every rank
reported, and a rank lets go of that one only for a still newer one every rank
reported, so the newest common step never disappears.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc

from async_stager._core.aio.waiting import wait_future

__all__ = ["Agreement", "Ticket", "droppable", "forced", "newest_common"]

_log = logging.getLogger("async_stager.checkpoint")


def newest_common(held: Sequence[Sequence[int]]) -> int | None:
    """The newest step in every rank's list (None if they share none)."""
    if not held:
        return None
    common = set(held[0])
    for steps in held[1:]:
        common &= set(steps)
    return max(common) if common else None


def droppable(held: Sequence[int], common: int | None, keep: int) -> list[int]:
    """Of a rank's complete steps ``held`` (oldest first), those it may let go: older
    than the job's newest common step and not among its newest ``keep``."""
    if common is None or len(held) <= keep:
        return []
    return [s for s in held[: len(held) - keep] if s < common]


def forced(held: Sequence[int], common: int | None) -> int | None:
    """The step to let go when no buffer set is free and the ranks' exchanges freed
    none (a rank failed to commit): the oldest that is neither the common step nor the
    newest. None if there is none."""
    for s in held[:-1]:
        if s != common:
            return s
    return None


@dataclass(eq=False)
class Ticket:
    """One memory save's place in the exchanges: ``ready`` (set from the loop, once)
    once its snapshot ended (committed, refused, skipped, abandoned); ``gathered``:
    the exchange's answer, from the exchanges' thread; ``done`` once the loop applied
    it."""

    index: int
    ready: threading.Event = field(default_factory=threading.Event)
    gathered: Future[list[Any]] = field(default_factory=Future)
    done: anyio.Event = field(default_factory=anyio.Event)


class Agreement:
    """The ranks' exchanges of the steps each holds complete (see the module doc).

    ``agree(steps)``: a blocking all-gather of this rank's list on a process group of
    the tier's own; ``published()``: this rank's complete steps now, those of them
    replicated and what its replication reports (read from the exchanges' thread: fresh
    tuples); ``on_common(step, replicated, reports)``: awaited on the loop after each
    exchange with the newest common step, the newest common replicated one (None:
    none) and every rank's report; ``on_broken``:
    the exchange failed (a rank died) or its loop side was cancelled: no more exchanges.

    Hazard: the collectives run in a thread of their own, one ticket after another, as
    soon as a ticket is ready, never waiting for the event loop: a rank whose loop is
    blocked (a training step's synchronous all-reduce, waiting for the other rank)
    must still answer the exchange that the other rank's save waits for, or the two
    would wait for each other for ever."""

    def __init__(
        self,
        agree: Callable[[list[Any]], list[Any]],
        *,
        published: Callable[[], tuple[Sequence[int], Sequence[int], Sequence[int]]],
        on_common: Callable[[int | None, int | None, list[Any]], Awaitable[None]],
        on_broken: Callable[[BaseException], None],
    ) -> None:
        self._agree = agree
        self._published = published
        self._on_common = on_common
        self._on_broken = on_broken
        self._tickets: list[Ticket] = []
        self._queue: queue.SimpleQueue[Ticket | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._issued = 0
        self._done = -1
        self._changed = anyio.Event()
        self.broken: BaseException | None = None
        #: The newest common step of the latest exchange, and the newest step every
        #: rank holds complete with its replica verified on its peer node.
        self.common: int | None = None
        self.replicated: int | None = None

    def ticket(self, tg: anyio.abc.TaskGroup) -> Ticket:
        """A place for the save being called (synchronously, at its call). Its exchange
        runs in the exchanges' thread once the ticket is ready; its answer is applied by
        a task of ``tg``. Set ``ready`` whatever becomes of the save."""
        t = Ticket(self._issued)
        self._issued += 1
        prev = self._tickets[-1] if self._tickets else None
        self._tickets.append(t)
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._exchanges, name="async-stager-tier-agree", daemon=True
            )
            self._thread.start()
        self._queue.put(t)
        tg.start_soon(self._apply, t, prev)
        return t

    def close(self) -> None:
        """No more tickets: the exchanges' thread ends after those queued (a daemon:
        one left waiting for a dead rank does not keep the process)."""
        if self._thread is not None:
            self._queue.put(None)

    def done_through(self, index: int) -> bool:
        """Every exchange up to ticket ``index`` was applied (or they stopped: broken)."""
        return self.broken is not None or self._done >= index

    async def changed(self) -> None:
        """Until the next exchange was applied. Cancellation: only the wait."""
        await self._changed.wait()

    async def settle(self) -> None:
        """Until the exchange of every ticket already ready was applied. Cancellation:
        only the wait."""
        while True:
            pending = [t for t in self._tickets if t.ready.is_set() and not t.done.is_set()]
            if not pending:
                return
            await pending[-1].done.wait()

    def _exchanges(self) -> None:
        """The exchanges' thread: each ticket's collective, in ticket order."""
        failed: BaseException | None = None
        while True:
            t = self._queue.get()
            if t is None:
                return
            t.ready.wait()
            if failed is not None:
                t.gathered.set_exception(failed)
                continue
            try:
                got = self._agree([list(part) for part in self._published()])
            except BaseException as exc:  # noqa: BLE001 - a dead rank: handed to the loop
                failed = exc
                t.gathered.set_exception(exc)
            else:
                t.gathered.set_result(got)

    async def _apply(self, t: Ticket, prev: Ticket | None) -> None:
        try:
            if prev is not None:
                await prev.done.wait()
            got = await wait_future(t.gathered)
            if self.broken is None:
                # Each rank's (held, replicated): its complete steps, and those of them
                # its peer node verified (``replicator``: empty without replication).
                self.common = newest_common([[int(s) for s in g[0]] for g in got])
                self.replicated = newest_common([[int(s) for s in g[1]] for g in got])
                await self._on_common(self.common, self.replicated, [g[2] for g in got])
        except BaseException as exc:  # a dead rank, or this task cancelled
            # An exchange failed, or its answer will not be applied: the ranks' views
            # are out of step from here on: no more exchanges.
            if self.broken is None:
                self.broken = exc
                self._on_broken(exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            self._done = max(self._done, t.index)
            self._tickets.remove(t)
            t.done.set()
            changed, self._changed = self._changed, anyio.Event()
            changed.set()
