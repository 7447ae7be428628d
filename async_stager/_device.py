"""Copy streams and events behind one small seam: a Copier per source device.

The engine speaks only to this interface; the real implementations are CpuCopier
(copies run in the calling worker thread, GIL released by torch) and CudaCopier (a
dedicated copy stream per device, non-blocking copies, a completion event). The fake in
``async_stager.testing`` implements the same interface on the CPU, with completion that
the test controls, which is how CPU tests reach the asynchronous logic.

Hazards:
- CUDA ordering: the copy stream first waits on the *capture* event, recorded on the
  caller's current stream at the call, so the copies read the values as of the call and
  after all work already queued there.
- Allocator: the sources are read by another stream; ``protect`` calls
  ``record_stream`` so the caching allocator cannot hand their memory to a new tensor
  (and overwrite it) before the copies have finished (torchrec #4231, #4322).
- The host memory must be pinned for the copy to be asynchronous; into pageable memory
  CUDA silently makes it synchronous (correct, slower).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from ._hostcopy import MIN_POOL_BYTES, CopyPool, Schedule, omp_threads, pieces, schedule

__all__ = ["Backend", "Completion", "Copier", "CpuCopier", "CudaCopier", "RealBackend"]


class Completion(Protocol):
    """Marks the end of enqueued copies (a CUDA event, or a fake one)."""

    def query(self) -> bool:
        """True once every copy enqueued before it has finished; never blocks."""
        ...

    def synchronize(self) -> None:
        """Block the calling thread until ``query()`` would be True."""
        ...


class Copier(ABC):
    """Copies from one source device into host memory.

    Call order for one stage, all on the worker thread except ``capture`` and
    ``fence``: ``begin(capture)``, any number of ``copy``, ``protect``, then ``end()``.
    """

    #: True when ``end()`` returns a Completion that must be waited for.
    asynchronous: bool = False
    #: True when small storages should first be gathered on the device (one fused
    #: kernel) and moved by one copy per contiguous host run.
    batch_small: bool = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def capture(self) -> Any:
        """Mark the snapshot point on the caller's current stream (caller's thread)."""
        return None

    def begin(self, capture: Any) -> None:
        """Order what follows after ``capture``."""

    @abstractmethod
    def copy(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        """Enqueue ``dsts[i].copy_(srcs[i])`` for every i (same shapes and dtypes)."""

    def prepare(self, dsts: Sequence[torch.Tensor]) -> Any:
        """Plan time: a copier-specific layout for copying into ``dsts`` (fixed host
        tensors) with ``copy_planned``, or None to use ``copy`` in chunks."""
        return None

    def copy_planned(
        self,
        dsts: Sequence[torch.Tensor],
        srcs: Sequence[torch.Tensor],
        layout: Any,
        tick: Callable[[], None],
    ) -> None:
        """Like ``copy`` for all of ``dsts`` at once, with ``prepare``'s layout;
        ``tick`` may be called between parts (it raises to cancel)."""
        raise NotImplementedError

    def protect(self, srcs: Sequence[torch.Tensor]) -> None:
        """Keep the sources' memory from being reused until the copies finish."""

    def end(self) -> Completion | None:
        """Finish this stage's enqueueing; None means the copies are already done."""
        return None

    def fence(self, completion: Completion) -> None:
        """Make the caller's current stream wait for ``completion`` (no host block)."""

    def scratch(self, nbytes: int) -> torch.Tensor:
        """Device memory (uint8) for gathering small storages, valid on this copier."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def close(self) -> None:
        """Drop streams and anything held."""


class CpuCopier(Copier):
    """Copies run in the calling thread; torch releases the GIL for each batch.

    ``threads``: threads copying (None: torch's intra-op thread count). The async
    Stager leaves one core to the event loop: with every core copying, a 1 ms timer was
    measured up to 5 ms late on 2 cores (one thread: under 1 ms, at 87-92% of the
    two-thread bandwidth there). A program of at least ``MIN_POOL_BYTES`` is copied by
    the calling thread and ``threads - 1`` helpers claiming pieces (``_hostcopy``);
    smaller ones by ``_foreach_copy_`` with that many torch threads.
    """

    def __init__(self, device: torch.device, *, threads: int | None = None) -> None:
        super().__init__(device)
        self.threads = threads
        n = threads if threads is not None else torch.get_num_threads()
        self._pool = CopyPool(n - 1) if n > 1 else None

    def copy(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        if not dsts:
            return
        with omp_threads(self.threads):
            torch._foreach_copy_(dsts, srcs)  # type: ignore[arg-type]

    def prepare(self, dsts: Sequence[torch.Tensor]) -> Any:
        if self._pool is None or self._pool.helpers == 0:
            return None
        sched = schedule(dsts)
        n_pieces = sum(max(1, parts) for _, _, parts in sched.items)
        return sched if sched.nbytes >= MIN_POOL_BYTES and n_pieces > 1 else None

    def copy_planned(
        self,
        dsts: Sequence[torch.Tensor],
        srcs: Sequence[torch.Tensor],
        layout: Any,
        tick: Callable[[], None],
    ) -> None:
        assert self._pool is not None and isinstance(layout, Schedule)
        self._pool.run(pieces(layout, dsts, srcs), tick)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()


class CudaCopier(Copier):
    """A dedicated copy stream on one CUDA device; completion is a CUDA event."""

    batch_small = True

    def __init__(self, device: torch.device, *, non_blocking: bool) -> None:
        super().__init__(device)
        self.asynchronous = non_blocking
        with torch.cuda.device(device):
            self.stream = torch.cuda.Stream(device=device)
        self._ctx: contextlib.ExitStack | None = None

    def capture(self) -> Any:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def begin(self, capture: Any) -> None:
        ctx = contextlib.ExitStack()
        ctx.enter_context(torch.cuda.device(self.device))
        ctx.enter_context(torch.cuda.stream(self.stream))
        self._ctx = ctx
        if capture is not None:
            self.stream.wait_event(capture)
        else:
            # No capture event (the device was first seen in the worker): order after
            # the device's default stream, the best snapshot point left.
            self.stream.wait_stream(torch.cuda.default_stream(self.device))

    def copy(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        if dsts:
            torch._foreach_copy_(list(dsts), list(srcs), non_blocking=self.asynchronous)

    def protect(self, srcs: Sequence[torch.Tensor]) -> None:
        for s in srcs:
            if s.device.type == "cuda":
                s.record_stream(self.stream)

    def end(self) -> Completion | None:
        ev = torch.cuda.Event()
        ev.record(self.stream)
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.close()
        if not self.asynchronous:
            ev.synchronize()
            return None
        return ev  # type: ignore[no-any-return]

    def fence(self, completion: Completion) -> None:
        torch.cuda.current_stream(self.device).wait_event(completion)  # type: ignore[arg-type]

    def scratch(self, nbytes: int) -> torch.Tensor:
        # Allocated while the copy stream is current, so the block belongs to it and
        # is reused only in that stream's order.
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def close(self) -> None:
        self.stream.synchronize()


class Backend(ABC):
    """Makes the Copier for each source device (and says if pinning is possible)."""

    @abstractmethod
    def copier(self, device: torch.device) -> Copier: ...

    def known_devices(self) -> Sequence[torch.device]:
        """Accelerator devices to capture on at a call (current one, and ones seen)."""
        return ()


class RealBackend(Backend):
    """CPU copies in the worker; CUDA copies on a dedicated stream per device."""

    def __init__(self, *, non_blocking: bool, copy_threads: int | None = None) -> None:
        self.non_blocking = non_blocking
        self.copy_threads = copy_threads

    def copier(self, device: torch.device) -> Copier:
        if device.type == "cpu":
            return CpuCopier(device, threads=self.copy_threads)
        if device.type == "cuda":
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            return CudaCopier(device, non_blocking=self.non_blocking)
        # Other accelerators: copies in the worker thread, synchronous (correct, and
        # the data has landed when they return).
        return _SyncDeviceCopier(device)

    def known_devices(self) -> Sequence[torch.device]:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return (torch.device("cuda", torch.cuda.current_device()),)
        return ()


class _SyncDeviceCopier(Copier):
    def copy(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        if dsts:
            torch._foreach_copy_(list(dsts), list(srcs), non_blocking=False)
