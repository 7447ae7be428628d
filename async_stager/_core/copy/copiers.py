"""The real copiers and backend: host copies on the CPU, a copy stream per CUDA device.

``CpuCopier`` copies in the worker thread (and the host copy pool's helpers, see
``_hostcopy``), the GIL released by torch. ``CudaCopier`` enqueues non-blocking
device-to-host copies on a dedicated stream per device, ordered after the stage's
capture, with a blocking-sync event as its Completion; small storages are gathered in
device scratch first (``ScratchCopier``). ``RealBackend`` makes them; see ``_device``
for the seam and the hazards they handle.
"""

from __future__ import annotations

import contextlib
import weakref
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch

from async_stager._core.checksum.digest import Checksums
from async_stager._core.checksum.wordhash import Tables, hash_layout, make_tables, piece_hashes, raw_bytes
from async_stager._core.copy.device import (
    Backend,
    Completion,
    Copier,
    capturing,
    cuda_context_devices,
    fresh_stream,
    pinning_device,
)
from async_stager._core.copy.hostcopy import MIN_POOL_BYTES, CopyPool, Schedule, hashed_pieces, schedule
from async_stager._core.copy.openmp import omp_threads
from async_stager._core.memory.arena import CudaPinner, Pinner
from async_stager._core.options import AUTO, auto_copy_threads, loop_friendly_threads

__all__ = ["CpuCopier", "CudaCopier", "CudaEvent", "RealBackend", "ScratchCopier"]


class CudaEvent:
    """A CUDA event recorded on ``stream`` now: a Completion, and a capture.

    ``blocking=True``: a host wait (``synchronize``) sleeps instead of spinning a core.
    ``query`` and ``synchronize`` run with the event's device current: CUDA runtime calls
    from a thread without a current context (the event loop's, a worker's) would
    otherwise create one on that thread's device, GPU 0 by default.
    """

    __slots__ = ("event", "index", "keep")

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.index: int = stream.device_index
        self.event = torch.cuda.Event(blocking=True)
        self.event.record(stream)
        #: What must stay alive until the event completes (a stage's CUDA sources).
        self.keep: list[torch.Tensor] = []

    def query(self) -> bool:
        with torch.cuda.device(self.index):
            done = bool(self.event.query())
        if done:
            self.keep = []  # read: an event kept for a later fence must not hold them
        return done

    def synchronize(self) -> None:
        with torch.cuda.device(self.index):
            self.event.synchronize()
        self.keep = []

    def wait(self, stream: torch.cuda.Stream) -> None:
        """Make ``stream``'s future work wait for this event (no host block)."""
        stream.wait_event(self.event)


class CpuCopier(Copier):
    """Copies run in the calling thread; torch releases the GIL for each batch.

    ``threads``: threads copying (None: torch's intra-op thread count). The async
    Stager leaves one core to the event loop (``loop_friendly_threads``): with every
    core copying, the loop's timers fire late; docs/benchmarks.md has the loop lag and
    the bandwidth of both choices. A program of at least ``MIN_POOL_BYTES`` is copied by
    the calling thread and ``threads - 1`` helpers claiming pieces (``_hostcopy``),
    which also hash them when the stage takes checksums; smaller ones by
    ``_foreach_copy_`` with that many torch threads. ``threads="auto"`` (the
    ``Stager`` default): the pool has a helper per other core, and each program
    decides how many join (``auto_copy_threads``); small programs copy with all cores
    but one.

    ``begin`` waits (blocking, in the worker) for the accelerator captures it is given:
    a CPU leaf may be a pinned tensor that a ``non_blocking`` device-to-host copy
    queued on the caller's stream before the call is still filling.
    """

    def __init__(self, device: torch.device, *, threads: int | str | None = None) -> None:
        super().__init__(device)
        #: ``"auto"``: threads decided per program (``auto_copy_threads``).
        self.auto = threads == AUTO
        resolved = loop_friendly_threads() if self.auto else threads
        assert resolved is None or isinstance(resolved, int)
        #: Threads for copies outside the pool (small programs, ``copy``).
        self.threads: int | None = resolved
        n = (
            auto_copy_threads(1, 1)
            if self.auto
            else (resolved if resolved is not None else torch.get_num_threads())
        )
        # One thread copying still goes through the pool (no helpers: it drains on the
        # worker), so checksums are hashed piece by piece as they land.
        self._pool = CopyPool(max(0, n - 1))

    def begin(self, capture: Any) -> None:
        if capture is None:
            return
        for c in capture if isinstance(capture, tuple) else (capture,):
            c.synchronize()

    def copy(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        if not dsts:
            return
        with omp_threads(self.threads):
            torch._foreach_copy_(dsts, srcs)  # type: ignore[arg-type]

    def prepare(self, dsts: Sequence[torch.Tensor]) -> Any:
        wanted = self.threads if self.threads is not None else torch.get_num_threads()
        if self._pool.helpers == 0 and wanted > 1:
            return None  # no helpers to be had (no OpenMP runtime): torch's own threads
        sched = schedule(dsts)
        n_pieces = sum(max(1, parts) for _, _, parts in sched.items)
        return sched if sched.nbytes >= MIN_POOL_BYTES and n_pieces > 1 else None

    def copy_planned(
        self,
        dsts: Sequence[torch.Tensor],
        srcs: Sequence[torch.Tensor],
        layout: Any,
        tick: Callable[[], None],
        checksums: Checksums | None = None,
        first: bool = False,
    ) -> None:
        assert isinstance(layout, Schedule)
        work, tasks = hashed_pieces(layout, dsts, srcs, checksums)
        helpers = None
        if self.auto:
            helpers = auto_copy_threads(layout.cut_bytes, layout.nbytes, first=first) - 1
        self._pool.run(work, tick, tasks, helpers)

    def close(self) -> None:
        self._pool.close()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as a flat uint8 view when it is contiguous, else ``t`` itself."""
    if t.is_contiguous() and t.dtype != torch.uint8:
        return t.reshape(-1).view(torch.uint8)
    return t


def bytewise(
    dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The pairs as bytes where both sides are contiguous and of one dtype.

    Hazard: CUDA's ``_foreach_copy_`` fast path converts bf16/fp16/fp8 through float
    and back, which may change NaN payloads and signs; a uint8 copy cannot. Pairs that
    are not both contiguous keep their dtype (an elementwise same-dtype ``copy_``).
    """
    out_d: list[torch.Tensor] = []
    out_s: list[torch.Tensor] = []
    for d, s in zip(dsts, srcs, strict=True):
        if d.dtype == s.dtype and d.is_contiguous() and s.is_contiguous() and d.shape == s.shape:
            out_d.append(_as_bytes(d))
            out_s.append(_as_bytes(s))
        else:
            out_d.append(d)
            out_s.append(s)
    return out_d, out_s


def _storage_key(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


class ScratchCopier(Copier):
    """A copier that gathers small storages on its device (``batch_small``), and owns
    the device scratch memory that takes.

    A plan keeps its scratch tensors (``scratch``) and their views for good, but their
    storage holds memory only while a run is being copied: it is materialized at the
    run's first gather and freed right after the run's one copy to the host is
    enqueued (in stream order: the allocator hands a block freed on the copy stream
    only to later work on that stream, or back to the driver after a synchronize).
    So a copier holds at most one run's scratch at a time, whatever the number of
    plans and buffer sets, and nothing between stages: the allocator may give it to
    training. ``scratch_budget`` (set from ``scratch_bytes`` by the engine) bounds what
    is materialized at once. A scratch that is over budget or runs out of device
    memory (``torch.OutOfMemoryError``) is not used: that run's storages are copied
    directly to the host instead (the ungathered path), and ``scratch_fallbacks``
    counts it.

    Subclasses implement ``copy_now`` (an enqueue) and may override how scratch memory
    is had and returned (``_alloc_scratch``, ``_grow_scratch``, ``_free_scratch``).
    """

    batch_small = True
    #: Bytes of scratch this copier materializes at once, across every plan (None: no
    #: bound).
    scratch_budget: int | None = None

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        # Every scratch this copier made, by storage (views share it); weak, so a plan
        # that is dropped takes its scratch with it.
        self._bases: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        # Scratch holding memory now.
        self._live: dict[int, torch.Tensor] = {}
        # Gathers of this stage's runs whose scratch could not be had: copied directly
        # at the run's host copy.
        self._direct: dict[int, list[tuple[list[torch.Tensor], list[torch.Tensor]]]] = {}
        #: Runs copied directly because their scratch could not be had.
        self.scratch_fallbacks = 0

    @property
    def scratch_live_bytes(self) -> int:
        """Device bytes of scratch holding memory now."""
        return sum(b.numel() for b in self._live.values())

    # -- the seam ----------------------------------------------------------------------

    @abstractmethod
    def copy_now(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        """Enqueue ``dsts[i].copy_(srcs[i])`` (no scratch routing)."""

    def copy(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        if not dsts:
            return
        key = _storage_key(dsts[0])
        if key in self._bases:
            # A gather into a run's scratch.
            # Bytes, not values: a gather is a bit copy whatever the dtype.
            bd, bs = bytewise(dsts, srcs)
            if key not in self._direct and self._materialize(key):
                self.copy_now(bd, bs)
            else:
                self._direct.setdefault(key, []).append((bd, bs))
            return
        if len(srcs) == 1:
            key = _storage_key(srcs[0])
            if key in self._bases:
                # The run's one copy from its scratch to the host.
                self._finish_run(key, dsts[0])
                return
        self.copy_now(dsts, srcs)

    def scratch(self, nbytes: int) -> torch.Tensor:
        # Plan time, in the worker, outside any stage's enqueueing: scratch still
        # holding memory belongs to no run in progress.
        self.release_scratch()
        base: torch.Tensor | None = None
        if self.scratch_budget is None or nbytes <= self.scratch_budget:
            try:
                base = self._alloc_scratch(nbytes)
            except torch.OutOfMemoryError:
                base = None
        if base is None:
            # Views of it still describe the layout; the run goes direct.
            self.scratch_fallbacks += 1
            base = torch.empty(nbytes, dtype=torch.uint8, device="meta")
        else:
            self._live[_storage_key(base)] = base
        self._bases[_storage_key(base)] = base
        return base

    def prepare(self, dsts: Sequence[torch.Tensor]) -> Any:
        # The plan's runs have made their views: their memory can go until a stage
        # copies them (a reserve() may be the only use for a while).
        self.release_scratch()
        return None

    def end(self) -> Completion | None:
        # A stage cut short (an error, a cancellation) may leave a run's scratch held.
        self.release_scratch()
        return None

    def close(self) -> None:
        self.release_scratch()

    def release_scratch(self) -> None:
        """Free every scratch holding memory (stream-ordered: safe with copies in
        flight) and forget this stage's direct runs."""
        self._direct.clear()
        live, self._live = self._live, {}
        for base in live.values():
            self._free_scratch(base)

    # -- memory ------------------------------------------------------------------------

    def _alloc_scratch(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def _grow_scratch(self, base: torch.Tensor) -> None:
        storage = base.untyped_storage()
        if storage.nbytes() < base.numel():
            storage.resize_(base.numel())

    def _free_scratch(self, base: torch.Tensor) -> None:
        base.untyped_storage().resize_(0)

    # -- runs --------------------------------------------------------------------------

    def _materialize(self, key: int) -> bool:
        if key in self._live:
            return True
        base = self._bases.get(key)
        if base is None or base.is_meta:
            return False
        if self.scratch_budget is not None and self.scratch_live_bytes + base.numel() > self.scratch_budget:
            self.scratch_fallbacks += 1
            return False
        try:
            self._grow_scratch(base)
        except torch.OutOfMemoryError:
            self.scratch_fallbacks += 1
            return False
        self._live[key] = base
        return True

    def _finish_run(self, key: int, span: torch.Tensor) -> None:
        direct = self._direct.pop(key, None)
        if direct is not None:
            base = self._bases[key]
            for views, srcs in direct:
                self.copy_now([_host_piece(span, base, v) for v in views], srcs)
            return
        live = self._live.pop(key, None)
        if live is None:
            return  # nothing was gathered into it
        self.copy_now([span], [live])
        self._free_scratch(live)


def _host_piece(span: torch.Tensor, base: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """The part of a run's host ``span`` that ``view`` (a view of the run's scratch
    ``base``) is copied into by the run's host copy: same bytes, dtype and shape."""
    start = view.storage_offset() * view.element_size() - base.storage_offset() * base.element_size()
    piece = span[start : start + view.numel() * view.element_size()]
    if view.dtype != piece.dtype:
        piece = piece.view(view.dtype)
    return piece.view(view.shape)


class CudaCopier(ScratchCopier):
    """A dedicated copy stream on one CUDA device; completion is a CUDA event.

    ``non_blocking`` False: ``end`` waits for the copies and returns None."""

    def __init__(self, device: torch.device, *, non_blocking: bool) -> None:
        super().__init__(device)
        self.non_blocking = non_blocking
        #: The callers' current streams seen at captures (``cuda_stream``; bounded):
        #: what a stream made later (the hash stream, in the worker) must not be.
        self._callers: set[int] = set()
        # Made on the caller's thread (the first capture): not the caller's stream.
        self.stream = fresh_stream(device)
        self._callers.add(torch.cuda.current_stream(device).cuda_stream)
        self._ctx: contextlib.ExitStack | None = None
        # Made at the first stage that takes checksums; see hash_sources.
        self._hash_stream: torch.cuda.Stream | None = None
        self._tables: Tables | None = None
        self._hashing = False
        self._capture: CudaEvent | None = None
        #: The current stage's CUDA sources, until ``end`` gives them to its event.
        self._held: list[torch.Tensor] = []
        #: Stages whose device hash could not be had (device memory ran out): their
        #: destinations were hashed from the host copy instead.
        self.hash_fallbacks = 0

    def capture(self) -> Any:
        current = torch.cuda.current_stream(self.stream.device_index)
        if len(self._callers) < 64:
            self._callers.add(current.cuda_stream)
        return CudaEvent(current)

    def begin(self, capture: Any) -> None:
        ctx = contextlib.ExitStack()
        ctx.enter_context(torch.cuda.device(self.device))
        ctx.enter_context(torch.cuda.stream(self.stream))
        self._ctx = ctx
        self._capture = capture
        if capture is not None:
            capture.wait(self.stream)
        else:
            # No capture for this device (it had no context at the call, so no source
            # of the call lived there): order after its default stream.
            self.stream.wait_stream(torch.cuda.default_stream(self.device))

    def copy_now(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        if dsts:
            # Bytes, not values: see ``bytewise`` (bf16/fp16/fp8 through float).
            bd, bs = bytewise(dsts, srcs)
            torch._foreach_copy_(bd, bs, non_blocking=self.non_blocking)

    def hash_sources(
        self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], checksums: Checksums
    ) -> None:
        # The hashes run on a second stream, so the SMs hash while the copy engine
        # copies: the hash stream waits for the stage's capture itself (the sources
        # as of the call; not for earlier stages' copies still on the copy stream);
        # end() makes the copy stream wait for the hash stream, so the stage's one
        # completion covers both. Temporaries and the constant tables are made with the
        # hash stream current (used and reused only in its order); the sources are
        # recorded on it (the allocator keeps them until it is done). torch hands
        # streams out from a pool: ``fresh_stream`` keeps it off the copy stream and the
        # callers' streams (another stream of the program may still share it: that
        # serializes, it cannot reorder).
        #
        # A device hash is an optimization: when it cannot be had (device memory runs
        # out), nothing is recorded and the host copy is hashed later instead.
        layout, total = hash_layout(dsts, srcs)
        if not layout:
            return
        if self._hash_stream is None:
            # Neither the copy stream nor a caller's (see ``fresh_stream``).
            self._hash_stream = fresh_stream(self.device, (self.stream.cuda_stream, *self._callers))
        stream = self._hash_stream
        # Pinned (torch's caching host allocator, which keeps the block until the copy
        # into it is done), so the result's copy is asynchronous; the Checksums keep it
        # until it is read.
        host = torch.empty(total, dtype=torch.int64, pin_memory=True)
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            if self._capture is not None:
                self._capture.wait(stream)
            else:
                stream.wait_stream(torch.cuda.default_stream(self.device))
            self._hashing = True
            try:
                if self._tables is None:
                    self._tables = make_tables(self.device)
                out = torch.empty(total, dtype=torch.int64, device=self.device)
                for _, src, start, pieces in layout:
                    src.record_stream(stream)
                    piece_hashes(raw_bytes(src), out[start : start + pieces], self._tables)
                host.copy_(out, non_blocking=True)
            except torch.OutOfMemoryError:
                self.hash_fallbacks += 1
                return
        for d, _, start, _ in layout:
            checksums.add_device(d, host, start)

    def protect(self, srcs: Sequence[torch.Tensor]) -> None:
        # Hazard: ``record_stream`` only tells torch's caching allocator; memory it does
        # not own (a tensor imported through DLPack, a CUDA IPC handle from another
        # process) is freed by its owner when the last tensor on it dies, copy or no
        # copy. So every CUDA source is also held by the stage's completion event
        # until the copies (and device hashes) have read it: ``end`` hands them over.
        for s in srcs:
            if s.device.type == "cuda":
                s.record_stream(self.stream)
                self._held.append(s)

    def end(self) -> Completion | None:
        if self._hashing and self._hash_stream is not None:
            self._hashing = False
            self.stream.wait_stream(self._hash_stream)
        done = CudaEvent(self.stream)
        done.keep, self._held = self._held, []
        self._capture = None
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.close()
        self.release_scratch()
        if not self.non_blocking:
            done.synchronize()
            return None
        return done

    def fence_point(self) -> Any:
        return torch.cuda.current_stream(self.stream.device_index)

    def fence(self, completion: Completion, point: Any) -> None:
        stream = point if point is not None else torch.cuda.current_stream(self.stream.device_index)
        completion.wait(stream)  # type: ignore[attr-defined]

    # Scratch is allocated and re-materialized with the copy stream current, so its
    # blocks belong to that stream and are reused only in its order.

    def _alloc_scratch(self, nbytes: int) -> torch.Tensor:
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def _grow_scratch(self, base: torch.Tensor) -> None:
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            super()._grow_scratch(base)

    def close(self) -> None:
        self.release_scratch()
        # A blocking event, not stream.synchronize(): the wait sleeps.
        CudaEvent(self.stream).synchronize()
        if self._hash_stream is not None:
            CudaEvent(self._hash_stream).synchronize()


class RealBackend(Backend):
    """CPU copies in the worker; CUDA copies on a dedicated stream per device."""

    def __init__(self, *, non_blocking: bool = False, copy_threads: int | str | None = None) -> None:
        self.non_blocking = non_blocking
        self.copy_threads = copy_threads

    @property
    def asynchronous(self) -> bool:
        return bool(torch.cuda.is_available())

    def pinner(self) -> Pinner | None:
        return CudaPinner() if torch.cuda.is_available() else None

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
        # Every device with a context, not only the current one: the first stage from
        # another device must have its snapshot point at the call too.
        return tuple(torch.device("cuda", d) for d in cuda_context_devices())

    def host_device(self) -> torch.device | None:
        return pinning_device()

    def capturing(self, device: torch.device) -> bool:
        if device.type != "cuda":
            return False
        return capturing(device.index if device.index is not None else torch.cuda.current_device())


class _SyncDeviceCopier(Copier):
    def copy(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        if dsts:
            torch._foreach_copy_(list(dsts), list(srcs), non_blocking=False)
