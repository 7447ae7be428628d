"""Leases: an explicit hold on one buffer set, handed from task to task.

A staged result is protected while it is reachable (see ``BufferSet.held``). A lease
adds an explicit hold for consumers the stager cannot see through references: a
writer process that mapped the arena (``export_shared``), a thread pool, code that
wants "released" to be an event rather than a garbage collection. It is also the one
way a buffer set is released: every path that gives a set back (the consumer, a
cancelled stage, a failed callback, ``dcp.save``) calls ``Lease.release``, which is
idempotent and thread-safe.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any, Generic, TypeVar

from ._digest import Checksums
from ._errors import StagingError

__all__ = ["Lease"]

T = TypeVar("T")


class _Token:
    """The releasable part of a lease, shared with its finalizer: it must not refer to
    the Lease itself, or the finalizer would keep the Lease alive forever."""

    __slots__ = ("_give_back", "_lock", "released")

    def __init__(self, give_back: Callable[[], None]) -> None:
        self._give_back = give_back
        self._lock = threading.Lock()
        self.released = False

    def release(self) -> bool:
        with self._lock:
            if self.released:
                return False
            self.released = True
        self._give_back()
        return True


class Lease(Generic[T]):
    """A staged state dict plus a hold on the buffer set it lives in.

    ``state_dict`` is the staged copy; no later stage writes into its buffers until
    ``release()`` (idempotent, callable from any thread). Hand the lease to a writer
    task and let the writer release it::

        lease = await stager.lease(sd)
        task_group.start_soon(write, lease)      # the writer: async with lease as sd: ...

    ``async with lease as staged:`` and ``with lease as staged:`` release on exit. A
    lease that is garbage collected without a release is released then (the staged
    tensors stay protected while they are reachable). After ``release()`` the buffers
    are protected only while the staged tensors are still reachable in this process:
    release only once every consumer that cannot be seen through references (a writer
    process mapping the arena) is done.
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
        if self._token.released:
            raise StagingError("the lease was released: its state dict may be overwritten")
        result: T = self._state_dict
        return result

    def bind(self, state_dict: Any, checksums: Checksums | None = None) -> None:
        """Internal: attach the staged copy this lease protects (and the digests its
        stage computed). Called once by the stager, when the stage completes, before
        the lease is handed to the caller."""
        self._state_dict = state_dict
        self._checksums = checksums

    @property
    def checksums(self) -> Checksums | None:
        """The digests computed while staging (``stager.lease(sd, checksums=True)``),
        else None. They describe the bytes as staged, and stay valid after release."""
        return self._checksums

    @property
    def released(self) -> bool:
        return self._token.released

    def release(self) -> None:
        """Give the buffer set back (idempotent, thread-safe). Later stages may write
        into it as soon as the staged tensors are also unreachable."""
        self._state_dict = None
        self._finalizer.detach()
        self._token.release()

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
