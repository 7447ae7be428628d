"""A simulated asynchronous device on the CPU: ``SimulatedDevice`` implements the device
primitives (``primitives``) so the real ``AcceleratorCopier`` runs in the test suite,
and ``SimulatedBackend`` gives it to a stager.

The model (what a GPU does that matters to ordering):
- Streams come from a pool (``pool`` streams, 32 as torch's) handed out round-robin,
  to the stager (``new_stream``, which draws past the default, the caller's and its
  own) and to a test's own work (``stream``) alike: streams collide as CUDA's do.
- Each stream is a queue of operations run in order by its own thread. A copy lands
  after a random delay drawn, at its enqueue, from the stream's generator (seeded from
  ``seed`` and the stream's number): a failure replays with the same seed.
- An event completes when its stream has run everything queued before it; a stream that
  waits on an event runs nothing queued after the wait until the event completes.
- Device memory is one slab. A tensor of the device (``tensor``, ``empty``) is a CPU
  tensor viewing it. When it dies, its block is freed in stream order (once the stream
  that allocated it, and every stream it was recorded on with ``record_stream``, have
  run what they had queued) and at once overwritten with ``POISON`` bytes, as if the
  next allocation had written it. So a copy that reads a source the copier did not
  protect, or runs before its wait, copies wrong bytes; and an operation that touches
  memory freed after its enqueue is recorded in ``errors`` (``UseAfterFree``), even
  when it writes the memory before reading it back.
- Pending operations know where device memory is (an offset), not which tensor, so they
  keep nothing alive, a kernel (``launch``) included; a host destination is written by
  address too (as DMA does).
- ``free``/``grow`` (scratch between stages) give the block back in stream order and
  take a new one, perhaps elsewhere, as CUDA's ``resize_(0)``/``resize_(n)``; between
  them the storage points at a trap (poison; an operation on it is a ``UseAfterFree``).
- The engine sees the device's tensors on ``device`` (``cuda:0``), through
  ``SimulatedBackend.device_of``: its CUDA paths run, and every other CPU tensor is a
  CPU leaf copied by the host copier after its wait for the captures.
- An asynchronous copy between host and device whose source has lazy conj/neg bits
  resolves them on the host right after the enqueue, as ATen does (racing the copy).
- bf16/fp16/fp8 copies pass through float32, as CUDA's ``_foreach_copy_`` fast path.

What it cannot show: bandwidth, driver locks, real DMA timing, the real allocator's
block sizes. Its own copies (``copy``) may read any CPU tensor that is not the slab's
as host memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import random
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from async_stager._core.copy.accelerator import AcceleratorCopier
from async_stager._core.copy.copiers import CpuCopier
from async_stager._core.copy.device import Backend, Copier
from async_stager._core.copy.primitives import POOL_STREAMS, DevicePrimitives
from async_stager._core.memory.arena import Pinner

__all__ = ["POISON", "SimulatedBackend", "SimulatedDevice", "SimulatedStream", "UseAfterFree"]

#: The byte a freed block is overwritten with.
POISON = 0xA5
#: Alignment of device blocks (bytes).
_ALIGN = 64
_REDUCED = frozenset(
    {torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2}
    | {getattr(torch, n) for n in ("float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n)}
)


class SimulatedStream:
    """A queue of operations run in order by its own thread (started at the first
    operation). ``capturing``: a test sets it to play a stream capturing a graph."""

    def __init__(self, sim: SimulatedDevice, name: str, number: int) -> None:
        self.sim = sim
        self.name = name
        self.number = number
        self.capturing = False
        self.queued = 0
        self.finished = 0
        #: ``time.perf_counter()`` when the last operation ended (how late a waiter
        #: saw it is measured against this).
        self.finished_at = 0.0
        self._ops: deque[Callable[[], None]] = deque()
        self._rng = random.Random(sim.seed * 1_000_003 + number)
        self._thread: threading.Thread | None = None

    def delay(self, kernel: bool = False) -> float:
        lo, hi = self.sim.kernel_delay if kernel else self.sim.delay
        return self._rng.uniform(lo, hi) if hi > 0 else 0.0

    def enqueue(self, op: Callable[[], None]) -> int:
        """Queue ``op``; returns its position (done once ``finished`` reaches it)."""
        with self.sim.cond:
            if self.sim.closed:
                raise RuntimeError("the simulated device is closed")
            self._ops.append(op)
            self.queued += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"sim-stream-{self.name}", daemon=True)
                self._thread.start()
            self.sim.cond.notify_all()
            return self.queued

    def _run(self) -> None:
        cond = self.sim.cond
        while True:
            with cond:
                while not self._ops and not self.sim.closed:
                    cond.wait()
                if not self._ops:
                    return
                op = self._ops[0]
            try:
                with torch.no_grad():
                    op()
            except BaseException as e:  # noqa: BLE001 - a device error: recorded, the stream goes on
                self.sim.errors.append(e)
            with cond:
                self._ops.popleft()
                self.finished_at = time.perf_counter()
                self.finished += 1
                self.sim._reap()
                cond.notify_all()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def __repr__(self) -> str:
        return f"<SimulatedStream {self.name!r} {self.finished}/{self.queued}>"


class _Event:
    __slots__ = ("position", "stream")

    def __init__(self, stream: SimulatedStream, position: int) -> None:
        self.stream, self.position = stream, position

    def done(self) -> bool:
        return self.stream.finished >= self.position


class UseAfterFree(RuntimeError):
    """A device operation touched memory freed before it ran (recorded in
    ``SimulatedDevice.errors``; the operation still runs, on whatever the memory holds
    now, as a GPU would)."""


class _Where:
    """Memory written or read by a pending operation: a device tensor by its offset in
    the slab (nothing kept alive; ``block``: the allocation it belonged to at the
    enqueue, checked when the operation runs), a host destination by its address, a
    host source by reference (host memory the test owns)."""

    __slots__ = (
        "block",
        "conj",
        "dtype",
        "kind",
        "nbytes",
        "neg",
        "offset",
        "ref",
        "size",
        "storage_offset",
        "stride",
    )

    def __init__(self, sim: SimulatedDevice, t: torch.Tensor, *, write: bool) -> None:
        self.dtype, self.size, self.stride = t.dtype, tuple(t.shape), t.stride()
        self.storage_offset = t.storage_offset()
        self.conj, self.neg = t.is_conj(), t.is_neg()
        self.ref: torch.Tensor | None = None
        self.block: _Block | None = None
        storage = t.untyped_storage()
        self.nbytes = storage.nbytes()
        if sim.owns(t):
            self.kind = "device"
            self.offset = storage.data_ptr() - sim._base
            self.block = sim._blocks.get(self.offset)
            return
        if sim._trapped(storage.data_ptr()):
            sim.errors.append(
                UseAfterFree(
                    f"a device operation was enqueued on {storage.nbytes()} bytes freed by free() and "
                    "not grown again (on CUDA: an illegal address)"
                )
            )
            self.kind = "trap"  # reads poison, writes are lost
            self.offset = 0
            return
        if write:
            if any(s < 0 for s in self.stride):
                raise RuntimeError("the simulated device writes host memory with non-negative strides")
            self.kind = "host"
            self.offset = storage.data_ptr()
        else:
            self.kind = "ref"
            self.offset = 0
            self.ref = t

    def view(self, sim: SimulatedDevice) -> torch.Tensor:
        if self.ref is not None:
            return self.ref
        if self.kind == "device" and sim._blocks.get(self.offset) is not self.block:
            sim.errors.append(
                UseAfterFree(
                    f"a device operation on {threading.current_thread().name} touched {self.nbytes} bytes "
                    f"at offset {self.offset} after they were freed (a missing record_stream, event "
                    "hold or stream-ordered allocation)"
                )
            )
        if self.nbytes == 0:
            return torch.empty(self.size, dtype=self.dtype)
        if self.kind == "trap":
            poison = torch.full((self.nbytes,), POISON, dtype=torch.uint8).view(self.dtype)
            return poison.as_strided(self.size, self.stride, self.storage_offset)
        if self.kind == "device":
            # as_strided's offset counts from the slab's start (its storage).
            typed = sim._slab_t.view(self.dtype)
            start = self.offset // typed.element_size() + self.storage_offset
            t = typed.as_strided(self.size, self.stride, start)
        else:
            raw = (ctypes.c_uint8 * self.nbytes).from_address(self.offset)
            flat = torch.frombuffer(raw, dtype=torch.uint8)
            t = flat.view(self.dtype).as_strided(self.size, self.stride, self.storage_offset)
        if self.conj:
            t = t.conj()
        if self.neg:
            t = t._neg_view()
        return t

    def physical(self, sim: SimulatedDevice) -> torch.Tensor:
        """The memory without its lazy bits (what a DMA engine reads)."""
        t = self.view(sim)
        if t.is_conj():
            t = t.conj()
        if t.is_neg():
            t = t._neg_view()
        return t


class _Block:
    __slots__ = ("foreign", "nbytes", "owner", "start", "uses")

    def __init__(self, start: int, nbytes: int, owner: SimulatedStream) -> None:
        self.start, self.nbytes, self.owner = start, nbytes, owner
        #: (stream, position) pairs from ``record_stream``.
        self.uses: list[tuple[SimulatedStream, int]] = []
        #: Memory the allocator does not own (``SimulatedDevice.foreign``).
        self.foreign = False


class SimulatedDevice(DevicePrimitives):
    """The simulated device (see the module doc). ``capacity``: bytes of device memory;
    ``seed``, ``delay`` (seconds, low and high of each copy's uniform delay),
    ``kernel_delay`` (the same for a kernel, ``launch``): a failure replays with the
    same values. ``device``: the torch device the engine sees its
    tensors on (``SimulatedBackend.device_of``; default ``cuda:0``, so the engine's
    CUDA paths run; the tensors themselves are CPU tensors viewing its memory, and
    nothing calls ``torch.cuda`` for it). ``pool``: streams in its pool. Use as a
    context manager, or ``close()``: the streams' threads end."""

    def __init__(
        self,
        *,
        seed: int = 0,
        delay: tuple[float, float] = (0.0, 0.002),
        capacity: int = 64 << 20,
        device: torch.device | None = None,
        pool: int = POOL_STREAMS,
        kernel_delay: tuple[float, float] = (0.0, 0.0),
    ) -> None:
        super().__init__(device if device is not None else torch.device("cuda", 0))
        if pool < 1:
            raise ValueError(f"pool must be at least 1 stream, got {pool}")
        #: Streams in the pool (``pool_stream``, ``stream``), handed out round-robin.
        self.pool_size = pool
        self.seed = seed
        self.delay = delay
        #: Seconds (low, high) a kernel (``launch``) takes, drawn as a copy's delay.
        self.kernel_delay = kernel_delay
        self.capacity = capacity = max(_ALIGN, capacity // _ALIGN * _ALIGN)
        self.cond = threading.Condition(threading.RLock())
        self.closed = False
        #: Errors raised by operations (a device fault); a test asserts it stays empty.
        self.errors: list[BaseException] = []
        #: Streams drawn by ``new_stream`` (the stager's own: one per copier made).
        self.streams_made = 0
        #: Asynchronous copies enqueued, and blocks freed (poisoned).
        self.copies = 0
        self.frees = 0
        self._slab = bytearray(capacity)
        self._mv = memoryview(self._slab)
        self._slab_t = torch.frombuffer(self._slab, dtype=torch.uint8)
        self._base = self._slab_t.data_ptr()
        self._free: list[tuple[int, int]] = [(0, capacity)]
        self._blocks: dict[int, _Block] = {}
        self._releases: list[_Block] = []
        self._streams: list[SimulatedStream] = []
        self._pool: list[SimulatedStream] = []
        self._pool_next = 0
        #: Memory that freed scratch points at until it is grown again (never freed).
        self._traps: list[bytearray] = []
        self._trap_ranges: list[tuple[int, int]] = []
        self._default = self._stream("default")
        self._local = threading.local()
        self._pinner = SimulatedPinner()

    def __enter__(self) -> SimulatedDevice:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _stream(self, name: str) -> SimulatedStream:
        s = SimulatedStream(self, name, len(self._streams))
        self._streams.append(s)
        return s

    # -- for tests ---------------------------------------------------------------------

    def stream(self, name: str = "user") -> SimulatedStream:
        """A stream of the pool for a test's own work (training, a producer), as
        ``torch.cuda.Stream()``: round-robin, so once the pool's streams all exist it
        is one that someone else (another test stream, a stager) may be using.
        ``name`` labels a stream drawn for the first time."""
        with self.cond:
            fresh = len(self._pool) < self.pool_size
            s = self.pool_stream()
            if fresh:
                s.name = name
            return s

    def tensor(self, data: torch.Tensor) -> torch.Tensor:
        """A device tensor holding ``data``'s values (contiguous), written now."""
        data = data.detach()
        out = self.empty(max(1, data.numel() * data.element_size()))
        t = out[: data.numel() * data.element_size()].view(data.dtype).view(data.shape)
        t.copy_(data.resolve_conj().resolve_neg())
        return t

    def foreign(self, data: torch.Tensor) -> torch.Tensor:
        """A device tensor holding ``data``'s values in memory the device's allocator
        does not own (a DLPack import, a CUDA IPC handle): ``record_stream`` does
        nothing for it, and its owner frees it (overwritten at once) when its last
        tensor dies, whatever a stream still has queued on it."""
        t = self.tensor(data)
        block = self._block_of(t)
        assert block is not None
        block.foreign = True
        return t

    def launch(self, fn: Callable[..., Any], *tensors: torch.Tensor) -> None:
        """Enqueue ``fn(*tensors)`` (device work: a kernel) on the current stream. A
        kernel holds nothing: each device tensor of ``tensors`` is known by its address
        (``fn`` gets a view of the same memory when it runs), so it is freed, and
        overwritten, as soon as nothing else keeps it; a host tensor is passed as it is.
        (A test's own ``fn()`` that closes over its tensors keeps them, as its own
        training code would.)"""
        where = [_Where(self, t, write=self.owns(t)) for t in tensors]
        del tensors
        stream = self.current_stream()
        wait = stream.delay(kernel=True)

        def run() -> None:
            if wait:
                time.sleep(wait)
            fn(*(w.view(self) for w in where))

        stream.enqueue(run)

    def synchronize(self, timeout: float = 60.0) -> None:
        """Wait until every stream has run what it had queued."""
        with self.cond:
            marks = [(s, s.queued) for s in self._streams]
            if not self.cond.wait_for(lambda: all(s.finished >= q for s, q in marks), timeout):
                raise TimeoutError(f"the simulated device is still busy after {timeout} s")

    def close(self) -> None:
        """Run what is queued, then end the streams' threads (idempotent)."""
        if self.closed:
            return
        try:
            self.synchronize()
        finally:
            with self.cond:
                self.closed = True
                self.cond.notify_all()
            for s in self._streams:
                s.join(10.0)

    # -- streams -----------------------------------------------------------------------

    def current_stream(self) -> SimulatedStream:
        stack: list[SimulatedStream] | None = getattr(self._local, "stack", None)
        return stack[-1] if stack else self._default

    def default_stream(self) -> SimulatedStream:
        return self._default

    def pool_stream(self) -> SimulatedStream:
        with self.cond:
            if len(self._pool) < self.pool_size:
                s = self._stream(f"pool-{len(self._pool)}")
                self._pool.append(s)
                return s
            s = self._pool[self._pool_next % self.pool_size]
            self._pool_next += 1
            return s

    def new_stream(self, avoid: Sequence[Any] = ()) -> SimulatedStream:
        with self.cond:
            self.streams_made += 1
            stream: SimulatedStream = super().new_stream(avoid)
            return stream

    @contextlib.contextmanager
    def using(self, stream: Any) -> Iterator[Any]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        stack.append(stream)
        try:
            yield stream
        finally:
            stack.pop()

    def wait_stream(self, stream: Any, other: Any) -> None:
        self.wait_event(stream, self.record(other))

    # -- events ------------------------------------------------------------------------

    def record(self, stream: Any) -> _Event:
        with self.cond:
            return _Event(stream, stream.queued)

    def query(self, event: Any) -> bool:
        done: bool = event.done()
        return done

    def wait_event(self, stream: Any, event: Any) -> None:
        def wait() -> None:
            with self.cond:
                self.cond.wait_for(lambda: event.done() or self.closed)

        stream.enqueue(wait)

    def capturing(self) -> bool:
        return self.current_stream().capturing

    # -- memory ------------------------------------------------------------------------

    def owns(self, tensor: torch.Tensor) -> bool:
        if tensor.device.type != "cpu":
            return False
        try:
            ptr = tensor.untyped_storage().data_ptr()
        except Exception:  # noqa: BLE001 - a tensor without storage
            return False
        return self._base <= ptr < self._base + self.capacity

    def empty(self, nbytes: int) -> torch.Tensor:
        size = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
        owner = self.current_stream()
        with self.cond:
            for i, (start, n) in enumerate(self._free):
                if n >= size:
                    self._free[i] = (start + size, n - size)
                    if n == size:
                        del self._free[i]
                    break
            else:
                raise torch.OutOfMemoryError(
                    f"simulated device out of memory: {nbytes} bytes asked, capacity {self.capacity}"
                )
            block = self._blocks[start] = _Block(start, size, owner)
        arr = np.frombuffer(self._mv[start : start + size], dtype=np.uint8)
        weakref.finalize(arr, self._dead, block)
        return torch.from_numpy(arr)[:nbytes]

    def grow(self, base: torch.Tensor) -> None:
        """A new block for ``base``'s storage (freed by ``free``), allocated on the
        current stream, perhaps at another address (as CUDA's ``resize_(n)`` after
        ``resize_(0)``): every view of the storage sees the new memory, whose bytes are
        whatever the block held (poison, or the last user's)."""
        storage = base.untyped_storage()
        if self._block_of(base) is not None:
            return  # it has its memory
        fresh = self.empty(storage.nbytes())
        # In place: the storage (and every view of it) now points at the new block;
        # ``fresh`` takes the dead placeholder, dropped with it.
        storage._swap_data_ptr_(fresh.untyped_storage())  # type: ignore[attr-defined]

    def free(self, base: torch.Tensor) -> None:
        """``base``'s block back to the device in stream order (as CUDA's
        ``resize_(0)``): it is reused once the streams that used it are past their
        uses. Meanwhile the storage (and every view of it) points at a trap of the same
        size holding ``POISON`` (host memory never handed out): an operation enqueued
        on it before ``grow`` is a ``UseAfterFree`` in ``errors`` and reads poison (on
        CUDA: an illegal address), not a crash here."""
        if self._block_of(base) is None:
            return
        storage = base.untyped_storage()
        dead = torch.from_numpy(self._trap(storage.nbytes())).untyped_storage()
        # The block's memory (its numpy owner) goes to ``dead``'s storage object and
        # dies with it here: the finalizer frees the block in stream order.
        storage._swap_data_ptr_(dead)  # type: ignore[attr-defined]
        del dead

    def _trap(self, nbytes: int) -> np.ndarray[Any, Any]:
        """``nbytes`` of trap memory (an array of its own over it)."""
        with self.cond:
            for buf in self._traps:
                if len(buf) >= nbytes:
                    break
            else:
                buf = bytearray([POISON]) * max(nbytes, 1 << 16)
                self._traps.append(buf)
                start = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
                self._trap_ranges.append((start, start + len(buf)))
        return np.frombuffer(memoryview(buf)[:nbytes], dtype=np.uint8)

    def _trapped(self, ptr: int) -> bool:
        return any(a <= ptr < b for a, b in self._trap_ranges)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        block = self._block_of(tensor)
        if block is not None and not block.foreign:  # the allocator's blocks only
            with self.cond:
                block.uses.append((stream, stream.queued))

    def _block_of(self, t: torch.Tensor) -> _Block | None:
        if not self.owns(t):
            return None
        return self._blocks.get(t.untyped_storage().data_ptr() - self._base)

    def _dead(self, block: _Block) -> None:
        # The block's last tensor died, or ``free`` gave it back (any thread, a GC run
        # included).
        self._release(block)

    def _release(self, block: _Block) -> None:
        with self.cond:
            if self.closed:
                return
            if block.foreign:
                block.uses = []  # its owner frees it at once, whatever streams still read it
            else:
                block.uses.append((block.owner, block.owner.queued))
            self._releases.append(block)
            self._reap()

    def _reap(self) -> None:
        """Poison (and hand back) every released block whose streams reached it."""
        keep = []
        for block in self._releases:
            if all(s.finished >= p for s, p in block.uses):
                self._mv[block.start : block.start + block.nbytes] = bytes([POISON]) * block.nbytes
                self.frees += 1
                block.uses = []
                if self._blocks.get(block.start) is block:
                    del self._blocks[block.start]
                    self._give(block.start, block.nbytes)
            else:
                keep.append(block)
        self._releases = keep

    def _give(self, start: int, nbytes: int) -> None:
        """Return a range to the free list, merged with its free neighbours."""
        free = sorted([*self._free, (start, nbytes)])
        merged: list[tuple[int, int]] = []
        for a, n in free:
            if merged and merged[-1][0] + merged[-1][1] == a:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((a, n))
        self._free = merged

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def pinner(self) -> Pinner | None:
        return self._pinner

    # -- work --------------------------------------------------------------------------

    def copy(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        pairs = []
        host_fixes: list[Callable[[], Any]] = []
        for d, s in zip(dsts, srcs, strict=True):
            if torch.broadcast_shapes(d.shape, s.shape) != d.shape:
                raise RuntimeError(
                    f"shape mismatch: a source of shape {tuple(s.shape)} does not broadcast to "
                    f"the destination's shape {tuple(d.shape)}"
                )
            dw, sw = _Where(self, d, write=True), _Where(self, s, write=False)
            lazy = s.is_conj() != d.is_conj() or s.is_neg() != d.is_neg()
            if lazy and dw.kind == "host" and sw.kind == "device":
                # ATen: the raw copy is enqueued, the bits resolved on the host now.
                sw.conj = sw.neg = False
                host_fixes.append(d.conj_physical_ if s.is_conj() else d.neg_)
            pairs.append((dw, sw))
        stream = self.current_stream()
        wait = stream.delay()
        self.copies += 1

        def run() -> None:
            if wait:
                time.sleep(wait)
            for dw, sw in pairs:
                dv, sv = dw.view(self), sw.view(self)
                if dv.dtype == sv.dtype and dv.dtype in _REDUCED:
                    dv.copy_(sv.float().to(dv.dtype))
                else:
                    dv.copy_(sv)

        stream.enqueue(run)
        for fix in host_fixes:
            fix()


class SimulatedPinner:
    """Records host registrations (the simulated device's ``cudaHostRegister``)."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.total_registrations = 0

    def register(self, ptr: int, nbytes: int) -> None:
        self.registered[ptr] = nbytes
        self.total_registrations += 1

    def unregister(self, ptr: int) -> None:
        del self.registered[ptr]


class SimulatedBackend(Backend):
    """A backend whose accelerator is ``sim``, as the real backend's is a GPU: tensors
    viewing ``sim``'s memory are on ``sim.device`` (``device_of``; ``cuda:0`` by
    default), copied by the real ``AcceleratorCopier`` over it; every other CPU tensor
    is a CPU leaf, copied by the real host copier (``CpuCopier``, ``copy_threads``
    threads), which first waits on the host for the captures, as on CUDA. The
    engine's accelerator paths (captures per device, device programs first, the
    device guard, ``order_after``'s host waits) run as on a GPU. ``pin``: the stager
    pins with the device's pinner (recorded, nothing locked)."""

    places_tensors = True

    def __init__(
        self, sim: SimulatedDevice, *, non_blocking: bool = True, pin: bool = False, copy_threads: int = 1
    ) -> None:
        self.sim = sim
        self.non_blocking = non_blocking
        self.pin = pin
        self.copy_threads = copy_threads
        #: Accelerator copiers made (one per engine, one per budget lane).
        self.made: list[AcceleratorCopier] = []
        #: Host copiers made (for CPU leaves).
        self.host_made: list[Copier] = []
        #: Devices the worker made current (``device_guard``), in order.
        self.guards: list[torch.device] = []

    def copier(self, device: torch.device) -> Copier:
        if device != self.sim.device:
            if device.type != "cpu":
                raise RuntimeError(f"the simulated backend has no device {device} (only {self.sim.device})")
            host = CpuCopier(device, threads=self.copy_threads)
            self.host_made.append(host)
            return host
        c = AcceleratorCopier(self.sim, non_blocking=self.non_blocking, wait_seconds=60.0)
        self.made.append(c)
        return c

    def device_of(self, t: torch.Tensor) -> torch.device:
        return self.sim.device if self.sim.owns(t) else t.device

    def known_devices(self) -> Sequence[torch.device]:
        return (self.sim.device,)

    def device_guard(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        self.guards.append(device)
        return contextlib.nullcontext()

    def capturing(self, device: torch.device) -> bool:
        return device == self.sim.device and self.sim.capturing()

    @property
    def asynchronous(self) -> bool:
        return True

    def pinner(self) -> Pinner | None:
        return self.sim.pinner() if self.pin else None
