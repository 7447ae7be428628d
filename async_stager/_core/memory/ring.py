"""A fixed host arena handed out as a ring of pieces, first in first out.

The memory of a budgeted DCP save (``_budget``): one allocation of at most the budget,
made once per save, carved into one piece per write item in the order the writer
consumes them, and freed piece by piece in that same order. A piece that does not fit
waits (the back-pressure) until the oldest pieces are released.

Hazard (why one arena, not one tensor per piece): DCP's ``FileSystemWriter`` keeps a
reference to every tensor it has written until the file is closed (its per-file
``tensor_dict``), so memory allocated per piece would only be freed once the whole
file is written: the budget would not hold. A piece of a fixed arena is reused however
long such a reference lives; the writer never reads it again.

Each piece is a tensor whose storage is exactly the piece (``torch.frombuffer`` on a
slice of the arena): DCP clones a tensor whose storage is larger than the tensor
(``storage().size() != nbytes``), which would copy every piece a second time and hold
the clones too.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from async_stager._core.memory.arena import ALIGN, Pinner, pin

__all__ = ["ALIGN", "Ring", "padded"]


def padded(nbytes: int) -> int:
    """``nbytes`` rounded up to ``ALIGN`` (what a piece takes of the ring)."""
    return -(-nbytes // ALIGN) * ALIGN


class Ring:
    """``capacity`` bytes of host memory, allocated FIFO (thread-safe).

    ``pinner``: registers the arena (exact size, so device copies into it are
    asynchronous) through the arenas' pinning path (``arena.pin``: a ``CudaPinner`` on
    CUDA); a failed registration raises PinningError, never leaves the ring silently
    unpinned (its copies would then be synchronous). Unregistered by ``close`` (or when
    the ring is collected). Owner: the pipeline of one save; pieces handed out stay
    valid memory while referenced, but their bytes are overwritten once released and
    reallocated.
    """

    def __init__(self, capacity: int, *, pinner: Pinner | None = None) -> None:
        self.capacity = capacity
        self._mem = torch.empty(max(capacity, 1), dtype=torch.uint8)
        self._np = self._mem.numpy()
        self._unpinner: weakref.finalize[Any, Any] | None = None
        if pinner is not None:
            self._unpinner = pin(pinner, self, self._mem.data_ptr(), self._mem.numel())
        self._live: deque[tuple[int, int]] = deque()  # (start, padded size), oldest first
        self._tail = 0
        self._cond = threading.Condition()
        self.used = 0
        self.peak = 0
        self.blocked_seconds = 0.0
        self._closed = False

    def _fit(self, size: int) -> int | None:
        if not self._live:
            return 0 if size <= self.capacity else None
        head = self._live[0][0]
        tail = self._tail
        if tail > head:  # not wrapped: free space after tail and before head
            if tail + size <= self.capacity:
                return tail
            return 0 if size <= head else None
        return tail if tail + size <= head else None

    def alloc(self, nbytes: int, *, stop: Callable[[], bool]) -> int | None:
        """The offset of a new piece of ``nbytes`` bytes (padded to ``ALIGN``), waiting
        while the ring is full; None if ``stop()`` became true meanwhile. Time spent
        waiting adds to ``blocked_seconds``."""
        size = padded(max(nbytes, 1))
        if size > self.capacity:
            raise ValueError(f"a piece of {size} bytes cannot fit a ring of {self.capacity} bytes")
        with self._cond:
            start = self._fit(size)
            if start is None:
                t0 = time.perf_counter()
                while start is None and not stop() and not self._closed:
                    self._cond.wait(0.05)
                    start = self._fit(size)
                self.blocked_seconds += time.perf_counter() - t0
            return None if start is None else self._take(start, size)

    def try_alloc(self, nbytes: int) -> int | None:
        """``alloc`` without waiting: None when the piece does not fit now."""
        size = padded(max(nbytes, 1))
        with self._cond:
            start = self._fit(size) if size <= self.capacity else None
            return None if start is None else self._take(start, size)

    def _take(self, start: int, size: int) -> int:
        """Under the lock: the piece ``[start, start + size)`` is live; returns ``start``."""
        self._live.append((start, size))
        self._tail = start + size
        self.used += size
        self.peak = max(self.peak, self.used)
        return start

    def view(self, start: int, nbytes: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """The piece at ``start`` as a contiguous tensor of ``shape`` and ``dtype`` whose
        storage is exactly ``nbytes`` bytes of the arena."""
        if nbytes == 0:
            return torch.empty(tuple(shape), dtype=dtype)
        flat = torch.frombuffer(self._np[start : start + nbytes], dtype=dtype)
        return flat.view(tuple(shape))

    def release_oldest(self) -> None:
        """Give back the oldest live piece (its bytes may be overwritten from now on)."""
        with self._cond:
            if self._live:
                _, size = self._live.popleft()
                self.used -= size
                if not self._live:
                    self._tail = 0
                self._cond.notify_all()

    def release_all(self) -> None:
        with self._cond:
            self._live.clear()
            self._tail = 0
            self.used = 0
            self._cond.notify_all()

    def reset(self) -> None:
        """Empty the ring for another save: every piece released, figures from zero
        (the memory and its registration are kept)."""
        with self._cond:
            self._live.clear()
            self._tail = 0
            self.used = 0
            self.peak = 0
            self.blocked_seconds = 0.0
            self._closed = False
            self._cond.notify_all()

    def wake(self) -> None:
        """Wake a waiting ``alloc`` so it re-checks its ``stop``."""
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        """Release every piece and unregister the arena from CUDA; the memory itself is
        freed once the last piece tensor is dropped."""
        self.release_all()
        with self._cond:
            self._closed = True
        if self._unpinner is not None:
            self._unpinner()  # unregister, once (PinningError if that fails)

    @property
    def pinned(self) -> bool:
        """Whether the arena is registered with the pinner now."""
        return self._unpinner is not None and self._unpinner.alive
