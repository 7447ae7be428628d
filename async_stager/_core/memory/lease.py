"""Leases: an explicit hold on one buffer set, handed from task to task.

A staged result is protected while it is reachable (see ``BufferSet.held``). A lease
adds an explicit hold for consumers the stager cannot see through references: a
writer process that mapped the arena (``export_shared``), a thread pool, code that
wants "released" to be an event rather than a garbage collection. It is also the one
way a buffer set is released: every path that gives a set back (the consumer, a
cancelled stage, a failed callback, ``dcp.save``) calls ``Lease.release``, which is
idempotent and thread-safe.

The release rule: an explicit release (``release()``, the end of ``async with lease``,
``with lease`` or ``async with stager.snapshot(sd)``) is the consumer saying "done".
It empties the staged copy's top level (``empty_released``) before it gives the set
back, so a name still bound to it (the ``as`` target after the block, a writer's
local) reaches no staged tensor and cannot keep the set held; what is still reachable
by another route (a tensor, nested dict, view or numpy array taken out of it) is an
ordinary staged result from then on: it keeps its snapshot values and holds the set
while reachable. Nothing is rebound in place (``set_()``): a DLPack capsule taken from
a staged tensor holds that tensor itself and its raw address, so after a rebinding no
count the stager reads would show it, and it would read bytes a later stage writes;
and the staged tensors are the plan's own host tensors, reused from stage to stage.
"""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any, Generic, TypeVar

from async_stager._core.checksum.digest import Checksums
from async_stager.errors import StagingError

__all__ = ["Lease", "bind", "empty_released"]

T = TypeVar("T")

#: The mutable containers the walk builds (``_tree.Walk``: always new objects, never a
#: source's), which release empties. Exact types only: a subclass may be an object the
#: walk returned as it was (one whose reduce names a global), i.e. the caller's own.
_EMPTIED: frozenset[type] = frozenset({dict, collections.OrderedDict, collections.defaultdict, list, set})


def empty_released(result: Any) -> None:
    """Empty the top level of a released staged copy, in place: a dict, list or set is
    cleared; a tuple or namedtuple (immutable) is looked through, recursively, and each
    such container in it is cleared. Anything else (a tensor, another object) is left
    as it is. Cost: one ``clear()`` per container emptied (C speed; what dropping the
    copy would free anyway), plus one Python step per item of the tuples looked
    through. Containers below the top level are not visited: they die with it unless
    referenced elsewhere, and then they are results of their own."""
    stack = [result]
    while stack:
        obj = stack.pop()
        cls = type(obj)
        if cls in _EMPTIED:
            obj.clear()
        elif cls is tuple or (
            # The walk rebuilds exactly these (``_tree_objects.ObjectWalk._other``).
            issubclass(cls, tuple) and hasattr(cls, "_fields") and hasattr(cls, "_make")
        ):
            stack.extend(obj)


class _Token:
    """The releasable part of a lease, shared with its finalizer: it must not refer to
    the Lease itself, or the finalizer would keep the Lease alive forever."""

    __slots__ = ("_give_back", "_lock", "released")

    def __init__(self, give_back: Callable[[], None]) -> None:
        self._give_back = give_back
        self._lock = threading.Lock()
        self.released = False

    def claim(self) -> bool:
        """Mark released; True for exactly one caller (any thread), which must then
        call ``give_back``."""
        with self._lock:
            if self.released:
                return False
            self.released = True
            return True

    def give_back(self) -> None:
        self._give_back()

    def release(self) -> bool:
        """``claim`` and ``give_back`` (the finalizer's path: nothing to empty)."""
        if not self.claim():
            return False
        self._give_back()
        return True


class Lease(Generic[T]):
    """A staged state dict plus a hold on the buffer set it lives in.

    ``state_dict`` is the staged copy; no later stage writes into its buffers until
    ``release()`` (idempotent, callable from any thread). Hand the lease to a writer
    task and let the writer release it::

        lease = await stager.lease(sd)
        task_group.start_soon(write, lease)      # the writer: async with lease as sd: ...

    ``async with lease as staged:`` and ``with lease as staged:`` release on exit.

    Release means "done": it empties the staged copy's top level (the dict, list or
    set, or those inside a top-level tuple, are cleared: ``staged == {}`` after the
    block) and gives the buffer set back at once, so the name ``staged`` left bound
    after the block holds nothing. A tensor, nested container, view or numpy array
    taken out of the copy and still referenced is an ordinary staged result: it keeps
    its values and keeps the set held (a later stage uses another set, or waits) until
    it is dropped. A result whose top level cannot be emptied (a tensor, a tuple of
    tensors, another object) is the same: held while reachable. Release only once
    every consumer is done, including those references cannot show (a writer process
    mapping the arena).

    A lease that is garbage collected without a release is released then, without
    emptying anything (the staged tensors stay protected while they are reachable).
    """

    __slots__ = ("__weakref__", "_checksums", "_finalizer", "_state_dict", "_token")

    def __init__(self, give_back: Callable[[], None]) -> None:
        self._token = _Token(give_back)
        self._state_dict: Any = None
        self._checksums: Checksums | None = None
        self._finalizer = weakref.finalize(self, self._token.release)

    @property
    def state_dict(self) -> T:
        """The staged copy this lease protects (the caller owns it, the stager owns
        its buffers). Raises StagingError once released, so a use-after-release is an
        error rather than a read of buffers that a later stage may be writing."""
        # Read before the flag: release sets the flag first, so a None read here
        # always comes with the flag set (a release on another thread).
        result: T = self._state_dict
        if self._token.released:
            raise StagingError("the lease was released: its state dict may be overwritten")
        return result

    @property
    def checksums(self) -> Checksums | None:
        """The digests computed while staging (``stager.lease(sd, checksums=True)``),
        else None. They describe the bytes as staged, and stay valid after release."""
        return self._checksums

    @property
    def released(self) -> bool:
        return self._token.released

    def release(self) -> None:
        """Done with the staged copy (idempotent, thread-safe): empty its top level
        (see the class doc) and give the buffer set back. A later stage may write into
        the set as soon as nothing taken out of the copy is still reachable: at once
        when nothing was. A stage waiting for a set is woken."""
        if not self._token.claim():
            return
        result, self._state_dict = self._state_dict, None
        self._finalizer.detach()
        try:
            # Before the set is given back: a stage woken by the release must find the
            # references the copy held gone.
            empty_released(result)
        finally:
            del result
            self._token.give_back()

    def __enter__(self) -> T:
        return self.state_dict

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    async def __aenter__(self) -> T:
        return self.state_dict

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # Synchronous: leaving the block releases even when cancelled.
        self.release()

    def __repr__(self) -> str:
        return f"<Lease {'released' if self.released else 'held'}>"


def bind(lease: Lease[Any], state_dict: Any, checksums: Checksums | None = None) -> None:
    """Attach the staged copy ``lease`` protects (and the digests its stage computed).
    Called once by the stager, when the stage completes, before the lease is handed to
    the caller: not a method, so a Lease shows its users only what they call."""
    lease._state_dict = state_dict
    lease._checksums = checksums
