"""A DCP save within a host-memory budget: stage each write item just ahead of the
writer, into a ring of at most ``host_budget_bytes``, and reuse a piece's memory as
soon as the writer has written it.

The pieces follow DCP's own plan. A DCP ``SavePlanner`` is asked for each write item's
data by the storage writer (``resolve_data``) right before that item is written; the
``FileSystemWriter`` configured here (one thread, ``per_thread_copy_ahead=0``: its
serial loader) asks for the non-tensor items first, then for the tensor items in the
plan's order, one at a time, writing each before asking for the next. So:

- a copier thread walks the final local plan (``write_data``'s) in that order: it
  serializes the non-tensor items at once, then copies each tensor item's data (what
  DCP's default planner would resolve: the tensor, a DTensor's local shard) into the
  next piece of the ring, waiting while the ring is full (blocked seconds: the
  back-pressure), and
- ``resolve_data`` of item k+1 releases item k's piece (the writer has written it) and
  returns item k+1's piece once its copy has landed.

Copy of piece k+1 overlaps the write of piece k; with a budget of one piece they
alternate. The snapshot point is the call: sources must not change until every copy
is enqueued, which is what the fence waits for (``Pipeline.fence``).

Limits of DCP's public API (documented in docs/concepts.md):
- The order in which a storage writer asks for items is not part of DCP's interface;
  it is the ``FileSystemWriter`` behaviour above. ``resolve_data`` checks every request
  against the expected order and fails with UnsupportedError rather than deadlock.
- The writer holds each written tensor until its file is closed, and clones a tensor
  whose storage is bigger than itself: hence one arena and pieces with exact storages
  (``_ring``).
- Non-tensor values (``BYTE_IO`` items) are serialized up front and held until written:
  their bytes are outside the ring (``object_bytes`` in the stats).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType

from ._copiers import CpuCopier, CudaEvent
from ._digest import chunk_key, tensor_digest
from ._errors import BudgetTooSmallError, StagingError, UnsupportedError
from ._ring import Ring, padded
from ._waiting import wait_future

if TYPE_CHECKING:
    import io

    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future as TorchFuture

__all__ = ["BudgetStats", "Pipeline", "PipelinePlanner", "PipelineWriter", "SaveAborted"]


@dataclass(frozen=True)
class BudgetStats:
    """What one budgeted save did (``dcp.save(..., on_budget_stats=...)``).

    Bytes: ``budget_bytes`` (asked), ``arena_bytes`` (allocated: the budget, or less
    when the state's tensors need less), ``peak_bytes`` (most ring bytes held at once,
    padding included), ``tensor_bytes`` (copied), ``object_bytes`` (serialized
    non-tensor values, held outside the ring until written). Seconds:
    ``blocked_seconds`` (the copier waiting for ring space: how much longer the sources
    had to stay unchanged because of the budget), ``writer_wait_seconds`` (the writer
    waiting for a copy), ``fence_seconds`` (from the call until the last copy was
    enqueued: when ``fence()`` may return), ``total_seconds`` (until the save returned).
    """

    budget_bytes: int
    arena_bytes: int
    peak_bytes: int
    pieces: int
    tensor_bytes: int
    object_bytes: int
    blocked_seconds: float
    writer_wait_seconds: float
    fence_seconds: float
    total_seconds: float


class SaveAborted(StagingError):
    """Raised inside DCP's writer when a budgeted save is cancelled: DCP then fails the
    save (on every rank) before writing the checkpoint's metadata."""


def _item_nbytes(item: WriteItem) -> int:
    assert item.tensor_data is not None
    n = 1
    for s in item.tensor_data.chunk.sizes:
        n *= int(s)
    return n * torch.empty((), dtype=item.tensor_data.properties.dtype).element_size()


class Pipeline:
    """One budgeted save's copier thread, ring and bookkeeping.

    Threads: ``start``/``take``/``finish`` run in DCP's save thread (the writer),
    ``_copy_all`` in the copier thread, ``fence``/``abort`` on the event loop.
    ``copy_threads``: torch threads for host copies (the stager's ``copy_threads``: by
    default one core is left, here to the writer). ``captures``: per CUDA device index, the event recorded on the caller's stream at
    the call; the copy stream of each device waits on it, CPU copies wait for all.
    """

    def __init__(
        self,
        budget: int,
        *,
        captures: dict[int, CudaEvent],
        t0: float,
        copy_threads: int | None = None,
        digests: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        self.budget = budget
        #: The save's coroutine has started (``_budget_save.abandon`` leaves it alone).
        self.started = False
        #: With checksums: each tensor chunk's manifest entry, hashed from its piece as
        #: it lands (the copier thread; the writer thread for a device's piece, once
        #: its copy is done), before the writer writes it.
        self.digests = digests
        self.copy_threads = copy_threads
        self.captures = captures
        self.t0 = t0
        self.enqueued: Future[None] = Future()
        self.source: Callable[[WriteItem], Any] | None = None
        self._ring: Ring | None = None
        self._cond = threading.Condition()
        self._items: list[WriteItem] = []
        self._ready: dict[int, tuple[torch.Tensor, CudaEvent | None]] = {}
        self._objects: dict[Any, io.BytesIO] = {}
        self._next = 0  # position in _items of the next tensor the writer asks for
        self._error: BaseException | None = None
        self._stop = False
        self._thread: threading.Thread | None = None
        self._last_events: dict[int, CudaEvent] = {}
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._writer_wait = 0.0
        self._tensor_bytes = 0
        self._object_bytes = 0
        self._fence_at: float | None = None

    # -- writer thread -------------------------------------------------------------------

    def start(self, plan: SavePlan) -> None:
        """Begin copying the final local plan's items, in the writer's order."""
        objects = [it for it in plan.items if it.type == WriteItemType.BYTE_IO]
        self._items = [it for it in plan.items if it.type != WriteItemType.BYTE_IO]
        need = max((padded(max(_item_nbytes(it), 1)) for it in self._items), default=0)
        if need > self.budget:
            raise _too_small(self._items, self.budget)
        total = sum(padded(max(_item_nbytes(it), 1)) for it in self._items)
        # Pinned (exact size) when CUDA is in use: device copies into it are asynchronous.
        self._ring = Ring(min(self.budget, max(total, 1)), pin=bool(self.captures))
        assert self.source is not None
        for it in objects:  # the snapshot of non-tensor values: taken before the fence
            data = self.source(it)
            self._objects[it.index] = data
            self._object_bytes += len(data.getbuffer())
        self._thread = threading.Thread(target=self._copy_all, name="async-stager-dcp-budget", daemon=True)
        self._thread.start()

    def take(self, item: WriteItem) -> Any:
        """What the writer writes for ``item``; releases the previous tensor's piece."""
        if item.type == WriteItemType.BYTE_IO:
            return self._objects.pop(item.index)
        ring = self._ring
        assert ring is not None
        pos = self._next
        if pos >= len(self._items) or self._items[pos].index != item.index:
            raise UnsupportedError(
                f"the storage writer asked for {item.index.fqn!r} out of the plan's order; "
                "a budgeted save needs FileSystemWriter(thread_count=1, per_thread_copy_ahead=0)"
            )
        if pos > 0:
            ring.release_oldest()  # the writer has written item pos - 1
        t0 = time.perf_counter()
        with self._cond:
            while pos not in self._ready and self._error is None and not self._stop:
                self._cond.wait(0.05)
            got = self._ready.pop(pos, None)
        if got is None:
            if self._error is not None:
                raise self._error  # the copy of this item failed
            raise SaveAborted("the budgeted save was cancelled")
        dst, done = got
        if done is not None:
            done.synchronize()
            self._hash(item, dst)
        self._writer_wait += time.perf_counter() - t0
        self._next = pos + 1
        return dst

    def _hash(self, item: WriteItem, piece: torch.Tensor) -> None:
        if self.digests is None:
            return
        offsets = [int(o) for o in item.index.offset] if item.index.offset is not None else [0] * piece.dim()
        self.digests[chunk_key(item.index.fqn, offsets)] = {
            "fqn": item.index.fqn,
            "offsets": offsets,
            "shape": list(piece.shape),
            "dtype": str(piece.dtype).removeprefix("torch."),
            "digest": tensor_digest(piece),
        }

    def finish(self) -> None:
        """The writer is done (or failed): stop the copier, wait for it, free the ring."""
        self.abort()
        if self._thread is not None:
            self._thread.join()
        for ev in self._last_events.values():
            ev.synchronize()  # no copy may still land in memory about to be unregistered
        if self._ring is not None:
            self._ring.close()
        self._settle()

    # -- copier thread -------------------------------------------------------------------

    def _copy_all(self) -> None:
        ring = self._ring
        assert ring is not None and self.source is not None
        # The device seam's host copier, without its helper pool (one piece at a time).
        cpu = CpuCopier(torch.device("cpu"), threads=1)
        cpu.threads = self.copy_threads
        try:
            with torch.no_grad():
                waited_host = False
                for pos, item in enumerate(self._items):
                    src = self.source(item).detach()
                    nbytes = src.numel() * src.element_size()
                    start = ring.alloc(nbytes, stop=lambda: self._stop)
                    if start is None:
                        return
                    dst = ring.view(start, nbytes, src.dtype, src.shape)
                    event: CudaEvent | None = None
                    if src.device.type == "cuda":
                        event = self._copy_cuda(dst, src)
                    else:
                        if not waited_host:
                            for cap in self.captures.values():
                                cap.synchronize()
                            waited_host = True
                        cpu.copy([dst], [src])
                        self._hash(item, dst)
                    del src
                    self._tensor_bytes += nbytes
                    with self._cond:
                        self._ready[pos] = (dst, event)
                        self._cond.notify_all()
            self._fence_at = time.perf_counter()
        except BaseException as e:  # noqa: BLE001 - handed to the writer
            with self._cond:
                self._error = e
                self._cond.notify_all()
        finally:
            cpu.close()
            self._settle()

    def _copy_cuda(self, dst: torch.Tensor, src: torch.Tensor) -> CudaEvent:
        index = src.device.index if src.device.index is not None else torch.cuda.current_device()
        with torch.cuda.device(index):
            stream = self._streams.get(index)
            if stream is None:
                stream = self._streams[index] = torch.cuda.Stream(device=index)
                cap = self.captures.get(index)
                if cap is not None:
                    cap.wait(stream)
                else:
                    stream.wait_stream(torch.cuda.default_stream(index))
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            # The caching allocator must not hand the source's memory to a new tensor
            # (which could overwrite it) before this copy has read it.
            src.record_stream(stream)
            event = CudaEvent(stream)
        self._last_events[index] = event
        return event

    # -- event loop -----------------------------------------------------------------------

    def _settle(self) -> None:
        if not self.enqueued.done():
            try:
                self.enqueued.set_result(None)
            except Exception:  # noqa: BLE001 - set concurrently by another thread
                pass

    def abort(self) -> None:
        """Stop copying; a writer waiting for a piece raises SaveAborted. Idempotent."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._ring is not None:
            self._ring.wake()

    def fence(self) -> Callable[[], Awaitable[None]]:
        """``Stager.fence``'s hook: reads the caller's current CUDA streams now; the
        returned wait returns once every copy is enqueued (or the save stopped), then
        makes those streams wait for the last copy of each device (no host block)."""
        points = {i: torch.cuda.current_stream(i) for i in self.captures}

        async def wait() -> None:
            await wait_future(self.enqueued)
            for index, event in list(self._last_events.items()):
                point = points.get(index)
                if point is not None:
                    event.wait(point)

        return wait

    def stats(self, total_seconds: float) -> BudgetStats:
        ring = self._ring
        fence_at = self._fence_at
        return BudgetStats(
            budget_bytes=self.budget,
            arena_bytes=ring.capacity if ring is not None else 0,
            peak_bytes=ring.peak if ring is not None else 0,
            pieces=len(self._items),
            tensor_bytes=self._tensor_bytes,
            object_bytes=self._object_bytes,
            blocked_seconds=ring.blocked_seconds if ring is not None else 0.0,
            writer_wait_seconds=self._writer_wait,
            fence_seconds=(fence_at - self.t0) if fence_at is not None else total_seconds,
            total_seconds=total_seconds,
        )


def _too_small(items: Sequence[WriteItem], budget: int) -> BudgetTooSmallError:
    item = max(items, key=_item_nbytes)
    need = padded(_item_nbytes(item))
    return BudgetTooSmallError(
        f"write item {item.index.fqn!r} takes {need} bytes of host memory, more than "
        f"host_budget_bytes={budget}; pass host_budget_bytes >= {need}",
        needed_bytes=need,
    )


class PipelinePlanner(DefaultSavePlanner):
    """DCP's default save planner whose ``resolve_data`` hands out staged pieces."""

    def __init__(self, pipeline: Pipeline) -> None:
        super().__init__()
        self._pipeline = pipeline
        pipeline.source = self._source

    def _source(self, item: WriteItem) -> Any:
        return DefaultSavePlanner.resolve_data(self, item)

    def resolve_data(self, write_item: WriteItem) -> Any:
        return self._pipeline.take(write_item)


class PipelineWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` with one thread and its serial loader (the order
    ``Pipeline`` stages in), starting and finishing the pipeline around the write."""

    def __init__(self, path: Any, pipeline: Pipeline, **kwargs: Any) -> None:
        super().__init__(path, thread_count=1, per_thread_copy_ahead=0, **kwargs)
        self._pipeline = pipeline

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> TorchFuture[list[WriteResult]]:
        try:
            self._pipeline.start(plan)
            return super().write_data(plan, planner)
        finally:
            self._pipeline.finish()
