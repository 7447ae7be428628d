"""The memory tier used alone (``MemoryTier.save``: a tool, a test; the Checkpointer's
memory route drives the tier's steps itself): one snapshot at a time, staged on the
caller's call, its commit a task of the tier's task group.

It drives the tier through its public steps (``ticket``, ``prepare``, ``commit``,
``not_taken``), and keeps what only a save of its own needs: the busy slot (one
snapshot staged or committed at a time) and the phase of the one in flight.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Coroutine
from typing import Any, Literal, Protocol

import anyio
import anyio.abc
import anyio.lowlevel

from async_stager._core.aio.stager import Stager, stager_internals
from async_stager._core.memory.lease import Lease
from async_stager._core.run.records import Captures
from async_stager._tier.retention import Ticket
from async_stager._tier.stats import TierProgress

__all__ = ["SoloSaves", "SoloTier"]


class SoloTier(Protocol):
    """What ``SoloSaves`` uses of the tier (``MemoryTier``)."""

    policy: Literal["wait", "skip"]

    @property
    def available(self) -> bool: ...

    @property
    def room(self) -> bool: ...

    @property
    def stager(self) -> Stager: ...

    @property
    def task_group(self) -> anyio.abc.TaskGroup: ...

    def ticket(self) -> Ticket | None: ...

    def not_taken(self) -> None: ...

    async def prepare(self, step: int, ticket: Ticket | None) -> bool: ...

    async def commit(self, lease: Lease[Any], step: int, staged: float) -> bool: ...


class SoloSaves:
    """``tier``'s snapshots of ``save``: the busy slot and the snapshot in flight."""

    def __init__(self, tier: SoloTier) -> None:
        self._tier = tier
        #: Set while a snapshot is being staged or committed (the busy slot).
        self._busy: anyio.Event | None = None
        #: The snapshot in flight (step, phase, called, staged seconds).
        self._progress: tuple[int, str, float, float | None] | None = None

    @property
    def busy(self) -> bool:
        """A snapshot is being staged or committed."""
        return self._busy is not None

    async def idle(self) -> None:
        """Until no snapshot is staged or committed. Cancellation: only the wait."""
        while self._busy is not None:
            await self._busy.wait()

    def in_flight(self) -> list[TierProgress]:
        """The snapshot being staged or committed, if any (no I/O)."""
        if self._progress is None:
            return []
        step, phase, called, staged = self._progress
        return [TierProgress(step, phase, time.monotonic() - called, staged)]

    def save(self, sd: dict[str, Any], step: int) -> Coroutine[Any, Any, bool]:
        """``MemoryTier.save``: the snapshot point is this call (see there)."""
        tier = self._tier
        ticket = tier.ticket()
        if not tier.available or (tier.policy == "skip" and (self._busy is not None or not tier.room)):
            return self._skip(ticket)
        point = stager_internals(tier.stager).snapshot_point(sd)
        coro = self._alone(point, sd, step, time.monotonic(), ticket)
        if ticket is not None:  # never awaited: the ranks' exchanges must not wait for it
            weakref.finalize(coro, ticket.ready.set)
        return coro

    async def _skip(self, ticket: Ticket | None) -> bool:
        if ticket is not None:
            ticket.ready.set()
        self._tier.not_taken()
        await anyio.lowlevel.checkpoint()
        return False

    async def _alone(
        self, point: Captures, sd: dict[str, Any], step: int, called: float, ticket: Ticket | None
    ) -> bool:
        tier = self._tier
        handed = False
        busy: anyio.Event | None = None
        try:
            while self._busy is not None:
                await self._busy.wait()
            busy = self._busy = anyio.Event()
            if not await tier.prepare(step, ticket):
                tier.not_taken()
                return False
            self._progress = (step, "memory-staging", called, None)
            lease = await stager_internals(tier.stager).lease_at(sd, point)
            staged = time.monotonic() - called
            self._progress = (step, "memory-committing", called, staged)
            tier.task_group.start_soon(self._commit_alone, lease, step, staged, busy, ticket)
            handed = True
            return True
        finally:
            if not handed:
                self._end(busy, ticket)

    async def _commit_alone(
        self, lease: Lease[Any], step: int, staged: float, busy: anyio.Event, ticket: Ticket | None
    ) -> None:
        try:
            await self._tier.commit(lease, step, staged)
        finally:
            self._end(busy, ticket)

    def _end(self, busy: anyio.Event | None, ticket: Ticket | None) -> None:
        self._progress = None
        if self._busy is busy:
            self._busy = None
        for event in (busy, ticket.ready if ticket is not None else None):
            if event is not None:
                event.set()
