"""A stager's internal handle: what the layers above use of a ``Stager`` or a
``DefaultStager`` besides what users call, so the public classes show only that.

Who uses what: ``export_shared`` and the command line, the shared arenas of either
stager (``Internals``); a budgeted ``dcp.save``, the stager's device seam (``lanes``)
and its fence hooks; the node budget's admission, the bytes a stage may reuse; the
Checkpointer and the memory tier, a snapshot point taken now and staged from later
(``StagerInternals``, a ``Stager``'s).

``internals_of(stager)`` finds the handle of either stager (None for any other object);
``aio.stager.stager_internals(stager)`` a ``Stager``'s, typed. A handle never refers to
its stager strongly: the registry holds the stagers weakly, and a stager lives and
dies as it would without one.
"""

from __future__ import annotations

import weakref
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol, TypeVar

from async_stager._core.memory.arena import Arena
from async_stager._core.memory.lease import Lease
from async_stager._core.run.engine import Engine
from async_stager._core.run.lanes import Lanes
from async_stager._core.run.records import Captures
from async_stager.errors import ClosedError

__all__ = ["FenceHook", "Internals", "StagerInternals", "internals_of", "register"]

T = TypeVar("T")

#: A fence hook (``StagerInternals.add_fence_hook``): called at each ``fence()`` call,
#: on the caller's thread (it reads its ordering points then), it returns the wait that
#: the fence awaits.
FenceHook = Callable[[], Callable[[], Awaitable[None]]]


class Internals:
    """The engine's part of a stager's handle: what either stager gives the layers above."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def shared_arenas(self) -> list[Arena]:
        """For ``export_shared``: the open shared-memory arenas of every buffer set."""
        return self.engine.shared_arenas()

    @property
    def reusable_bytes(self) -> int:
        """For the node budget's admission: host bytes of the biggest buffer set that is
        neither leased nor being written, which the next stage may reuse without
        reserving more. A hint: a concurrent stage may take it."""
        return self.engine.sets.largest_free_bytes()

    @property
    def lanes(self) -> Lanes:
        """For a budgeted ``dcp.save``: the stager's device seam for work outside its own
        stages: ``lanes.backend`` (answers the device questions at a call, makes
        copiers), ``lanes.pinner`` (pins as the stager's arenas do, None when it does
        not pin), and copiers and a ring kept from one save to the next
        (``take``/``give_back``; see ``_core.run.lanes``)."""
        return self.engine.lanes


class _Start(Protocol):
    """``Stager._start``: submit a stage now (or from ``at``) and return its coroutine."""

    def __call__(
        self, sd: Any, *, lease: bool, checksums: bool = ..., at: Captures | None = ...
    ) -> Coroutine[Any, Any, Any]: ...


class StagerInternals(Internals):
    """A ``Stager``'s handle: the engine's part, and what the Checkpointer, the memory
    tier and a budgeted ``dcp.save`` do with the stager itself. ``start``: the
    stager's own submission, held weakly (the registry's value must not keep its
    key)."""

    def __init__(self, engine: Engine, start: weakref.WeakMethod[_Start]) -> None:
        super().__init__(engine)
        self._start = start
        #: Waits outside the stager's own stages that its ``fence()`` also awaits.
        self.fence_hooks: list[FenceHook] = []

    def snapshot_point(self, sd: Any) -> Captures:
        """For a save that its caller's policy defers (the Checkpointer, the memory
        tier): the snapshot point of a stage of ``sd`` taken now (an event on the
        caller's current stream of each device, and the generators' states, as
        ``stage()`` takes at its call), for a later ``lease_at(sd, point)`` or budgeted
        save. Raises as ``stage()`` does at its call (ClosedError, UnsupportedError
        while a CUDA graph captures)."""
        if self.engine.closed:
            raise ClosedError("the stager is closed")
        return self.engine.capture(sd)

    def lease_at(
        self, sd: T, at: Captures | None, *, checksums: bool = False
    ) -> Coroutine[Any, Any, Lease[T]]:
        """``Stager.lease(sd, checksums=...)`` from the snapshot point ``at`` taken
        earlier by ``snapshot_point(sd)`` (None: this call, as ``lease``). Raises as
        ``lease`` does at its call."""
        start = self._start()
        if start is None:
            raise ClosedError("the stager is closed")
        coro: Coroutine[Any, Any, Lease[T]] = start(sd, lease=True, checksums=checksums, at=at)
        return coro

    def add_fence_hook(self, hook: FenceHook) -> Callable[[], None]:
        """For a budgeted ``dcp.save``: make the stager's ``fence()`` also wait for work
        outside its own stages. ``hook`` is called at each ``fence()`` call (caller's
        thread: it reads its ordering points then) and returns the wait that the fence
        awaits. Returns the function that removes the hook (idempotent)."""
        self.fence_hooks.append(hook)

        def remove() -> None:
            if hook in self.fence_hooks:
                self.fence_hooks.remove(hook)

        return remove


_HANDLES: weakref.WeakKeyDictionary[object, Internals] = weakref.WeakKeyDictionary()


def register(stager: object, handle: Internals) -> None:
    """Make ``handle`` the one ``internals_of(stager)`` finds (at the stager's
    construction). ``handle`` must not refer to ``stager`` strongly."""
    _HANDLES[stager] = handle


def internals_of(stager: object) -> Internals | None:
    """The handle of a ``Stager`` or ``DefaultStager``; None for any other object."""
    try:
        return _HANDLES.get(stager)
    except TypeError:  # not weakly referenceable (nor hashable): no stager of ours
        return None
