"""A DCP save within a host-memory budget: stage each write item just ahead of the
writer, into a ring of at most ``host_budget_bytes``, and reuse a piece's memory as
soon as the writer has written it.

The pieces follow DCP's own plan. A DCP ``SavePlanner`` is asked for each write item's
data by the storage writer (``resolve_data``) right before that item is written; the
``FileSystemWriter`` configured here (one thread, ``per_thread_copy_ahead=0``: its
serial loader) asks for the non-tensor items (DCP's *bytes items*) first, in the plan's
order, then for the tensor items in the plan's order, one at a time, writing each
before asking for the next. So a copier thread walks the final local plan
(``write_data``'s) in that order:

- each bytes item (an int, a list, a dataclass, any value that is not a tensor or a
  container DCP walks into, with the tensors inside it) is serialized exactly as DCP
  would (``torch.save`` of the value) into a sink (``pickling.RingSink``) whose writes
  go to the ring: small ones gathered across items into one piece of up to ``_SMALL``
  bytes (a small value costs one handover per batch, not one per value), larger ones
  cut into pieces. ``torch.save`` hands a CPU tensor's storage to the sink as a view of
  the source memory, so a tensor inside an object is copied into the ring piecewise,
  never whole. ``resolve_data`` returns a stand-in (``streaming.Streamed``) and the
  file stream of the writer (from its file system, ``streaming``) writes the item's
  segments of those pieces as they land, releasing each piece once written;
- each tensor item's data (what DCP's default planner would resolve: the tensor, a
  DTensor's local shard) is copied into the next piece of the ring, waiting while the
  ring is full (blocked seconds: the back-pressure), and ``resolve_data`` of item k+1
  releases item k's piece (the writer has written it) and returns item k+1's piece
  once its copy has landed.

Copy of piece k+1 overlaps the write of piece k; with a budget of one piece they
alternate. The snapshot point is the call: sources must not change until every copy
is enqueued (every bytes item serialized too), which is what the fence waits for
(``Pipeline.fence``).

Every tensor copy goes through the device seam (``copies``): the copier of the
source's device from the save's lane (``_core.run.lanes``), whose ``capture()`` at the
call is the snapshot point; small items a batch per stage. So the budgeted copies have
the stager's ordering and bounded waits, and the simulated device drives them on the
CPU.

What ``torch.save`` builds whole, outside the ring, for one bytes item at a time: the
item's pickle (the value without its CPU tensors' data), and a host copy of each
device tensor's storage inside the value (``storage.cpu()``). Each is checked against
the budget (``pickling.checked_pickle_module``): BudgetTooSmallError, naming the
value, when either is bigger, since neither can be cut into pieces. ``dcp.save``
checks what it can see at the call (``survey``).

Limits of DCP's public API (documented in docs/design.md):
- The order in which a storage writer asks for items is not part of DCP's interface;
  it is the ``FileSystemWriter`` behaviour above. ``resolve_data`` checks every request
  against the expected order and fails with UnsupportedError rather than deadlock.
- The writer holds each written tensor until its file is closed, and clones a tensor
  whose storage is bigger than itself: hence one arena and pieces with exact storages
  (``_core.memory.ring``).
- The writer writes a bytes item as ``stream.write(data.getbuffer())`` on the stream
  its file system opened (``streaming``): anything else fails the save with
  UnsupportedError before any metadata is written; it never writes a wrong item.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from async_stager._core.aio.waiting import wait_future
from async_stager._core.checksum.digest import chunk_key, tensor_digest
from async_stager._core.copy.device import Completion
from async_stager._core.memory.arena import Pinner
from async_stager._core.memory.buffer_sets import HOST_WAIT_SECONDS
from async_stager._core.memory.ring import ALIGN, Ring, padded
from async_stager._core.run.lanes import Lane, Lanes
from async_stager._dcp.budget.copies import RingCopies
from async_stager._dcp.budget.pickling import ObjectStream, Segment, Stopped
from async_stager._dcp.budget.records import Marker, SaveAborted, Streamed, item_nbytes, too_small
from async_stager._dcp.budget.share import BudgetStats, reserve_share
from async_stager._dcp.budget.survey import Seen
from async_stager.errors import CopyError, StagingError, UnsupportedError

if TYPE_CHECKING:
    from async_stager._core.memory.ledger import NodeLedger, Reservation

__all__ = ["BudgetStats", "Pipeline", "SaveAborted"]

#: Writes to a bytes item's sink up to this size (bytes) are gathered before they take
#: a piece of the ring (a ``torch.save`` makes many small writes: zip headers, records).
_SMALL = 64 * 1024
#: Largest piece a bytes item's data is cut into (bytes): one file write, one memcpy.
_CHUNK_MAX = 8 * 1024 * 1024
#: Tensor items of at most this many bytes are copied in batches (one stage, one event).
_BATCH_ITEM = 64 * 1024 - 1
#: Bytes of one batch of small tensor items at most.
_BATCH_BYTES = 1 << 20
#: Ring bytes assumed per bytes item when the call saw none (``Seen.object_bytes``):
#: about what ``torch.save`` of a small value writes.
_ITEM_BYTES = 2048


class Pipeline:
    """One budgeted save's copier thread, ring and bookkeeping.

    Threads: ``start``/``take``/``pump``/``finish`` run in DCP's save thread (the
    writer), ``_copy_all`` in the copier thread, ``fence``/``abort`` on the event loop.
    ``lanes``/``lane``: the stager's lanes (``_core.run.lanes``) and the one this save
    took at the call: its copiers (those of the devices in ``captures`` made on the
    caller's thread; a device first seen in the copier thread gets one from
    ``lanes.backend``, on the real one the CPU's, with the stager's ``copy_threads``)
    and its ring, kept for the next save (given back by ``finish``). ``pinner``: pins
    the ring (None: pageable). ``seen``: what the call's ``survey`` saw of the bytes
    items (their estimated size, paths, generators, whether they may hold CPU tensors;
    None: nothing seen, so they may). ``captures``: per device, its copier's ``capture()`` at the call (the snapshot
    point on the caller's stream); each piece's copy is ordered after it
    (``order_after``: a host copy, and the serialization of bytes items, after all).
    ``ledger``: a node budget (``NodeLedger``) the ring's capacity is
    reserved from before the ring is allocated (waiting at most ``ledger_wait`` seconds
    in the node's ticket order) and given back when the ring is freed (``finish``: at
    the end of this rank's ``write_data``, before DCP's last collectives, so a rank
    waiting for its share never waits for a rank that waits for it); closed by
    ``finish`` when ``owns_ledger``.
    """

    def __init__(
        self,
        budget: int,
        *,
        captures: Mapping[torch.device, Any],
        t0: float,
        lanes: Lanes,
        lane: Lane,
        pinner: Pinner | None = None,
        seen: Seen | None = None,
        digests: dict[str, dict[str, Any]] | None = None,
        ledger: NodeLedger | None = None,
        ledger_wait: float | None = None,
        owns_ledger: bool = False,
    ) -> None:
        self.budget = budget
        self.ledger = ledger
        self.ledger_wait = ledger_wait
        self._owns_ledger = owns_ledger
        self._reservation: Reservation | None = None
        self._node_wait = 0.0
        #: The freed ring's figures (``finish`` drops the ring itself: its memory must
        #: be gone when its node reservation is given back).
        self._ring_stats: tuple[int, int, float] = (0, 0, 0.0)
        #: The save has started (``BudgetedJob.forget`` leaves it alone).
        self.started = False
        #: With checksums: each tensor chunk's manifest entry, hashed from its piece as
        #: it lands (the copier thread; the writer thread for a device's piece, once
        #: its copy is done), before the writer writes it.
        self.digests = digests
        #: The tensor copies, through the device seam (``copies``).
        self.copies = RingCopies(captures, backend=lanes.backend, copiers=lane.copiers)
        self._lanes = lanes
        self._lane: Lane | None = lane
        self._seen = seen if seen is not None else Seen()
        #: Pins the ring (the arenas' path, ``arena.pin``); None: the ring is pageable.
        self.pinner = pinner
        self.t0 = t0
        self.enqueued: Future[None] = Future()
        #: What DCP's default planner resolves for a tensor item; the value of a bytes
        #: item (before DCP's ``torch.save``). Set by ``PipelinePlanner``.
        self.source: Callable[[WriteItem], Any] | None = None
        self.lookup: Callable[[WriteItem], Any] | None = None
        #: DCP's flattened name -> its path in the state dict (the planner's, once set).
        self.path_of: Callable[[str], tuple[Any, ...]] = lambda fqn: self._seen.paths.get(fqn, (fqn,))
        self._ring: Ring | None = None
        self._chunk = ALIGN
        self._cond = threading.Condition()
        self._items: list[WriteItem] = []
        self._objects: list[WriteItem] = []
        # Per tensor item position: its piece and the completion of its copy (None:
        # landed, and hashed).
        self._ready: dict[int, tuple[torch.Tensor, Completion | None]] = {}
        self._segments: deque[Segment] = deque()
        # Copier thread: bytes items' small writes gathered across items (at most
        # ``_SMALL`` bytes, outside the ring) into one piece, with their segments.
        self._next = 0  # position in _items of the next tensor the writer asks for
        self._next_object = 0  # position in _objects of the next bytes item asked for
        self._streaming: int | None = None  # a bytes item handed out, not yet written
        self._error: BaseException | None = None
        self._stop = False
        self._thread: threading.Thread | None = None
        self._writer_wait = 0.0
        self._tensor_bytes = 0
        self._object_bytes = 0
        self._fence_at: float | None = None

    @property
    def error(self) -> BaseException | None:
        """The copier's failure, if it failed (DCP reports it wrapped; ``entry``
        raises a StagingError of ours as itself)."""
        return self._error

    # -- writer thread -------------------------------------------------------------------

    def start(self, plan: SavePlan) -> None:
        """Begin serializing and copying the final local plan's items, in the writer's
        order."""
        self._objects = [it for it in plan.items if it.type == WriteItemType.BYTE_IO]
        self._items = [it for it in plan.items if it.type != WriteItemType.BYTE_IO]
        need = max((padded(max(item_nbytes(it), 1)) for it in self._items), default=0)
        if need > self.budget:
            raise too_small(self._items, self.budget, self.path_of)
        total = sum(padded(max(item_nbytes(it), 1)) for it in self._items)
        if self._objects:
            hint = self._seen.object_bytes
            hint = hint if hint is not None else _ITEM_BYTES * len(self._objects)
            total += padded(hint) + _SMALL
        capacity = min(self.budget, max(total, ALIGN))
        if self.ledger is not None:
            capacity = self._reserve_share(max(need, ALIGN), capacity)
        # Two pieces of a bytes item fit the ring at once: its copy overlaps its write.
        self._chunk = min(_CHUNK_MAX, max(ALIGN, capacity // 2 // ALIGN * ALIGN))
        # Pinned (exact size) when CUDA is in use: device copies into it are asynchronous.
        # A failed registration (PinningError) fails the save as itself.
        try:
            assert self._lane is not None
            # The lane's ring again when it fits (no allocation, no registration).
            self._ring = self._lane.ring_for(capacity, self.budget, self.pinner)
        except StagingError as e:
            self._error = e
            raise
        self._thread = threading.Thread(target=self._copy_all, name="async-stager-dcp-budget", daemon=True)
        self._thread.start()

    def _reserve_share(self, need: int, capacity: int) -> int:
        """Writer thread, before the ring exists: its bytes from the node ledger
        (``share.reserve_share``); returns the capacity granted. A failure is
        the save's (raised as itself); a cancelled save stops the wait."""
        assert self.ledger is not None

        def stop() -> None:
            if self._stop:
                raise SaveAborted("the budgeted save was cancelled while it waited for the node budget")

        try:
            largest = max(self._items, key=item_nbytes).index.fqn if self._items else ""
            self._reservation, self._node_wait = reserve_share(
                self.ledger, need, capacity, timeout=self.ledger_wait, stop=stop, path=self.path_of(largest)
            )
        except BaseException as e:
            self._fail_with(e)
            raise
        return self._reservation.nbytes

    def _fail_with(self, error: BaseException) -> BaseException:
        with self._cond:
            if self._error is None:
                self._error = error
        return error

    def take(self, item: WriteItem) -> Any:
        """What the writer writes for ``item``: a bytes item's stand-in (streamed by
        ``pump``), or a tensor item's piece; releases the previous tensor's piece."""
        self._check_streamed()
        if item.type == WriteItemType.BYTE_IO:
            at = self._next_object
            if at >= len(self._objects) or self._objects[at].index != item.index:
                raise self._out_of_order(item)
            self._next_object = at + 1
            self._streaming = at
            return Streamed(Marker(at), item.index.fqn)
        ring = self._ring
        assert ring is not None
        pos = self._next
        if (
            self._next_object < len(self._objects)
            or pos >= len(self._items)
            or self._items[pos].index != item.index
        ):
            raise self._out_of_order(item)
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
            try:
                landed = self.copies.landed(item.index.fqn, done, lambda: self._stop)
            except StagingError as e:
                self._fail(e)
                raise
            if not landed:
                raise SaveAborted("the budgeted save was cancelled")
            self._hash(item, dst)
        self._writer_wait += time.perf_counter() - t0
        self._next = pos + 1
        return dst

    def _fail(self, error: BaseException) -> None:
        """Record the save's first failure (raised by ``entry`` as itself) and
        stop the copier."""
        with self._cond:
            if self._error is None:
                self._error = error
            self._stop = True
            self._cond.notify_all()
        if self._ring is not None:
            self._ring.wake()

    def _out_of_order(self, item: WriteItem) -> UnsupportedError:
        return UnsupportedError(
            f"the storage writer asked for {item.index.fqn!r} out of the plan's order; "
            "a budgeted save needs FileSystemWriter(thread_count=1, per_thread_copy_ahead=0)"
        )

    def _check_streamed(self) -> None:
        if self._streaming is not None:
            fqn = self._objects[self._streaming].index.fqn
            raise UnsupportedError(
                f"the storage writer did not write the bytes item {fqn!r} as "
                "stream.write(data.getbuffer()); a budgeted save streams it and needs "
                "FileSystemWriter(thread_count=1, per_thread_copy_ahead=0)"
            )

    def pump(self, marker: Marker, out: Any) -> int:
        """Write the bytes item of ``marker`` to the file ``out`` as its segments land,
        releasing each piece once written; returns the bytes written."""
        if marker.pos != self._streaming:
            raise UnsupportedError("a bytes item's stand-in was written twice or out of order")
        ring = self._ring
        assert ring is not None
        written = 0
        t0 = time.perf_counter()
        while True:
            with self._cond:
                while not self._segments and self._error is None and not self._stop:
                    self._cond.wait(0.05)
                if self._stop and self._error is None:
                    raise SaveAborted("the budgeted save was cancelled")  # pieces left unwritten
                if not self._segments:
                    assert self._error is not None
                    raise self._error  # serializing this item failed
                pos, data, last, release = self._segments.popleft()
            if pos != marker.pos:  # pragma: no cover - the copier follows the plan's order
                raise UnsupportedError("bytes items were streamed out of the plan's order")
            self._writer_wait += time.perf_counter() - t0
            if data is not None and len(data):
                written += out.write(data)
            del data
            if release:
                ring.release_oldest()  # the oldest piece: the one just written
            if last:
                break
            t0 = time.perf_counter()
        self._streaming = None
        return written

    def check_written(self) -> None:
        """After the writer's ``write_data``: every bytes item went through ``pump``
        (else the file holds a stand-in's empty buffer: fail before the metadata)."""
        self._check_streamed()
        if self._next_object != len(self._objects):
            fqn = self._objects[self._next_object].index.fqn
            raise UnsupportedError(f"the storage writer never asked for the bytes item {fqn!r}")

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
        """The writer is done (or failed): stop the copier, wait for it (bounded), make
        sure no copy may still land in the ring, and give the lane back (its ring kept
        for the next save, unless a node budget reserved it). Idempotent."""
        self.abort()
        thread = self._thread
        joined = True
        if thread is not None:
            thread.join(HOST_WAIT_SECONDS)
            joined = not thread.is_alive()
        with self._cond:
            self._segments.clear()
            self._ready.clear()
        # No copy may still land in memory about to be reused or unregistered: every
        # copy the writer did not take, and the latest of each device, are waited for
        # (bounded); a failing one stops neither the others nor the ring's release.
        failed, over = self.copies.settle()
        if not joined:
            failed = failed or CopyError(
                f"the budgeted save's copier thread did not stop within {HOST_WAIT_SECONDS:.0f} s"
            )
        with self._cond:
            if failed is not None and self._error is None:
                self._error = failed
        ring = self._ring
        if ring is not None:
            self._ring_stats = (ring.capacity, ring.peak, ring.blocked_seconds)
        # The pipeline lets go of the ring; with a node budget the lane drops it (its
        # memory goes with its last reference: pieces the writer held were dropped with
        # its files), and only then is the share given back, so the node never holds
        # more than the ledger shows. A lane whose copies may still land is kept,
        # unused (``Lanes.give_back``).
        self._ring = None
        del ring
        lane, self._lane = self._lane, None
        try:
            if lane is not None:
                error = self._lanes.give_back(
                    lane, settled=over and joined, keep_ring=self._reservation is None
                )
                with self._cond:
                    if error is not None and self._error is None:
                        self._error = error
        finally:
            self._settle()
            reservation, self._reservation = self._reservation, None
            if reservation is not None:
                reservation.release()
            if self._owns_ledger and self.ledger is not None:
                self.ledger.close()

    # -- copier thread -------------------------------------------------------------------

    def _copy_all(self) -> None:
        ring = self._ring
        assert ring is not None and self.source is not None
        try:
            with torch.no_grad():
                if self._objects:
                    # Values are read as of the call: after every capture, a device
                    # tensor inside one on the copy stream (``RingCopies.serializing``).
                    with self.copies.serializing(host_wait=self._seen.host_tensors):
                        self._serialize_objects()
                self._copy_tensors(ring)
            self._fence_at = time.perf_counter()
        except Stopped:
            pass  # aborted: the writer raises SaveAborted
        except BaseException as e:  # noqa: BLE001 - handed to the writer
            with self._cond:
                if self._error is None:
                    self._error = e
                self._cond.notify_all()
        finally:
            self._settle()

    def _copy_tensors(self, ring: Ring) -> None:
        """Each tensor item's source into its piece of the ring, in the writer's order.
        Consecutive small items of one device (``_BATCH_ITEM`` bytes at most, up to
        ``_BATCH_BYTES`` in all) that fit the ring now are copied as one stage (one
        event, one wait). A piece that must wait for ring space first enqueues the
        batch gathered so far: the writer may be waiting for it."""
        assert self.source is not None
        batch: list[tuple[int, WriteItem, torch.Tensor, torch.Tensor]] = []
        batch_bytes = 0
        for pos, item in enumerate(self._items):
            src = self.source(item).detach()
            nbytes = src.numel() * src.element_size()
            small = nbytes <= _BATCH_ITEM
            if batch and (
                not small or batch_bytes + nbytes > _BATCH_BYTES or src.device != batch[0][3].device
            ):
                self._enqueue(batch)
                batch, batch_bytes = [], 0
            start = ring.try_alloc(nbytes) if batch else None
            if start is None:
                self._enqueue(batch)  # the writer may be waiting for these
                batch, batch_bytes = [], 0
                start = ring.alloc(nbytes, stop=lambda: self._stop)
                if start is None:
                    return
            batch.append((pos, item, ring.view(start, nbytes, src.dtype, src.shape), src))
            batch_bytes += nbytes
            self._tensor_bytes += nbytes
            del src
            if not small:
                self._enqueue(batch)
                batch, batch_bytes = [], 0
        self._enqueue(batch)

    def _enqueue(self, batch: list[tuple[int, WriteItem, torch.Tensor, torch.Tensor]]) -> None:
        if not batch:
            return
        done = self.copies.copy(
            [item.index.fqn for _, item, _, _ in batch], [d for _, _, d, _ in batch], [s for *_, s in batch]
        )
        if done is None:
            for _, item, dst, _ in batch:
                self._hash(item, dst)  # landed: hashed here, before the writer
        with self._cond:
            for pos, _, dst, _ in batch:
                self._ready[pos] = (dst, done)
            self._cond.notify_all()
        batch.clear()

    def _serialize_objects(self) -> None:
        """``torch.save`` of each bytes item's value, as DCP's planner does, into the
        ring (``pickling.ObjectStream``). Raises Stopped if the save was aborted."""
        assert self.lookup is not None
        stream = ObjectStream(
            self.budget,
            chunk=self._chunk,
            small=_SMALL,
            piece=self._piece,
            hand=self._hand,
            where=self._path_of,
            generators=self._seen.generators,
        )
        for at, item in enumerate(self._objects):
            value = self.lookup(item)
            stream.serialize(at, value)
            del value
        stream.flush()

    def _path_of(self, at: int) -> tuple[Any, ...]:
        return self.path_of(self._objects[at].index.fqn)

    def _piece(self, n: int) -> np.ndarray[Any, Any]:
        ring = self._ring
        assert ring is not None
        start = ring.alloc(n, stop=lambda: self._stop)
        if start is None:
            raise Stopped
        self._object_bytes += n
        piece: np.ndarray[Any, Any] = ring.view(start, n, torch.uint8, (n,)).numpy()
        return piece

    def _hand(self, segments: list[Segment]) -> None:
        with self._cond:
            self._segments.extend(segments)
            self._cond.notify_all()

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

    def fence(self, *, at_call: bool = False) -> Callable[[], Awaitable[None]]:
        """``Stager.fence``'s hook (caller's thread; ``Engine.fence`` has refused a
        capturing stream): reads each copier's ``fence_point`` (the caller's current
        stream) now; the returned wait returns once every copy is enqueued (or the save
        stopped), then has each copier order its point after that device's last copy
        (``Copier.fence``: no host block). A device first seen after the call: the
        current stream of the thread applying it. ``at_call``: the streams current at
        the save's call instead (its captures' streams), from any thread at any time:
        the Checkpointer's own fence of a save, whose pipeline a node budget's
        admission may build on the loop long after the call.

        Cancellation: only the wait is cancelled; no ordering was added."""
        points = self.copies.fence_points(at_call=at_call)

        async def wait() -> None:
            await wait_future(self.enqueued)
            self.copies.apply_fence(points)

        return wait

    def stats(self, total_seconds: float) -> BudgetStats:
        ring = self._ring
        capacity, peak, blocked = (
            (ring.capacity, ring.peak, ring.blocked_seconds) if ring is not None else self._ring_stats
        )
        fence_at = self._fence_at
        return BudgetStats(
            budget_bytes=self.budget,
            arena_bytes=capacity,
            peak_bytes=peak,
            pieces=len(self._items),
            tensor_bytes=self._tensor_bytes,
            object_bytes=self._object_bytes,
            blocked_seconds=blocked,
            writer_wait_seconds=self._writer_wait,
            fence_seconds=(fence_at - self.t0) if fence_at is not None else total_seconds,
            total_seconds=total_seconds,
            node_wait_seconds=self._node_wait,
        )
