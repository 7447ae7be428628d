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

Its streams and events live in ``simulated_stream``, its memory (the slab's allocator,
poison and traps, and the memory a pending operation names) in ``simulated_memory``.

What it cannot show: bandwidth, driver locks, real DMA timing, the real allocator's
block sizes. Its own copies (``copy``) may read any CPU tensor that is not the slab's
as host memory.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from async_stager._core.copy.accelerator import AcceleratorCopier
from async_stager._core.copy.copiers import CpuCopier
from async_stager._core.copy.device import Backend, Copier
from async_stager._core.copy.primitives import POOL_STREAMS, DevicePrimitives
from async_stager._core.copy.simulated_memory import ALIGN, POISON, Block, Slab, UseAfterFree, Where
from async_stager._core.copy.simulated_stream import Event, SimulatedStream
from async_stager._core.memory.arena import Pinner

__all__ = [
    "POISON",
    "SimulatedBackend",
    "SimulatedDevice",
    "SimulatedPinner",
    "SimulatedStream",
    "UseAfterFree",
]

_REDUCED = frozenset(
    {torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2}
    | {getattr(torch, n) for n in ("float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n)}
)


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
        self.capacity = capacity = max(ALIGN, capacity // ALIGN * ALIGN)
        self.cond = threading.Condition(threading.RLock())
        self.closed = False
        #: Errors raised by operations (a device fault); a test asserts it stays empty.
        self.errors: list[BaseException] = []
        #: Streams drawn by ``new_stream`` (the stager's own: one per copier made).
        self.streams_made = 0
        #: Asynchronous copies enqueued.
        self.copies = 0
        #: The device memory (its allocator).
        self.memory = Slab(capacity, self.cond)
        self._streams: list[SimulatedStream] = []
        self._pool: list[SimulatedStream] = []
        self._pool_next = 0
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
        block = self.block_of(t)
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
        where = [Where(self.memory, self.errors, t, write=self.owns(t)) for t in tensors]
        del tensors
        stream = self.current_stream()
        wait = stream.delay(kernel=True)

        def run() -> None:
            if wait:
                time.sleep(wait)
            fn(*(w.view() for w in where))

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
                self.closed = self.memory.closed = True
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

    def record(self, stream: Any) -> Event:
        with self.cond:
            return Event(stream, stream.queued)

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

    @property
    def frees(self) -> int:
        """Blocks freed (poisoned)."""
        return self.memory.frees

    def owns(self, tensor: torch.Tensor) -> bool:
        return self.memory.owns(tensor)

    def empty(self, nbytes: int) -> torch.Tensor:
        arr, block = self.memory.allocate(nbytes, self.current_stream())
        # The block's last tensor died, or ``free`` gave it back (any thread, a GC run
        # included): released in stream order.
        weakref.finalize(arr, self.memory.release, block)
        return torch.from_numpy(arr)[:nbytes]

    def grow(self, base: torch.Tensor) -> None:
        """A new block for ``base``'s storage (freed by ``free``), allocated on the
        current stream, perhaps at another address (as CUDA's ``resize_(n)`` after
        ``resize_(0)``): every view of the storage sees the new memory, whose bytes are
        whatever the block held (poison, or the last user's)."""
        storage = base.untyped_storage()
        if self.memory.block_of(base) is not None:
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
        if self.memory.block_of(base) is None:
            return
        storage = base.untyped_storage()
        dead = torch.from_numpy(self.memory.trap(storage.nbytes())).untyped_storage()
        # The block's memory (its numpy owner) goes to ``dead``'s storage object and
        # dies with it here: the finalizer frees the block in stream order.
        storage._swap_data_ptr_(dead)  # type: ignore[attr-defined]
        del dead

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        block = self.memory.block_of(tensor)
        if block is not None and not block.foreign:  # the allocator's blocks only
            with self.cond:
                block.uses.append((stream, stream.queued))

    def block_of(self, t: torch.Tensor) -> Block | None:
        """The allocation ``t`` views the start of (``None``: not the device's, or not a
        block's start)."""
        return self.memory.block_of(t)

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
            dw, sw = (
                Where(self.memory, self.errors, d, write=True),
                Where(self.memory, self.errors, s, write=False),
            )
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
                dv, sv = dw.view(), sw.view()
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
