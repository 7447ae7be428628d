"""Fakes of the device seam that re-implement the copier, to inject failures and count
calls (``async_stager.testing`` is their public face; what each does is said there):
``FakeBackend`` and its ``FakeCopier``, ``FakeEvent`` (a completion the test controls),
``FakeStream`` and ``FakeCapture`` (a caller's stream and a capture on it), and
``FakePinner`` (records pin registrations). Beside ``simulated``, which runs the real
accelerator copier on the CPU instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from async_stager._core.checksum.digest import Checksums
from async_stager._core.checksum.wordhash import hash_layout, piece_hashes, raw_bytes
from async_stager._core.copy.copiers import CpuCopier, ScratchCopier, bytewise
from async_stager._core.copy.device import Backend, Copier
from async_stager._core.memory.arena import Pinner
from async_stager.errors import PinningError

__all__ = ["FakeBackend", "FakeCapture", "FakeCopier", "FakeEvent", "FakePinner", "FakeStream"]


class FakeEvent:
    """A completion that the test controls; runs its recorded copies when it fires."""

    def __init__(
        self, ops: list[Callable[[], None]], *, delay: float, polls: int | None, manual: bool
    ) -> None:
        self._ops = ops
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._due = time.perf_counter() + delay
        self._polls_left = polls
        self._manual = manual
        self.queries = 0

    def complete(self) -> None:
        """Fire now: run the recorded copies (idempotent)."""
        with self._lock:
            if self._done.is_set():
                return
            ops, self._ops = self._ops, []
            try:
                with torch.no_grad():
                    for op in ops:
                        op()
            finally:
                self._done.set()

    @property
    def fired(self) -> bool:
        return self._done.is_set()

    def query(self) -> bool:
        self.queries += 1
        if self._done.is_set():
            return True
        if self._manual:
            return False
        if self._polls_left is not None:
            self._polls_left -= 1
            if self._polls_left <= 0:
                self.complete()
                return True
            return False
        if time.perf_counter() >= self._due:
            self.complete()
            return True
        return False

    def synchronize(self) -> None:
        if self._manual:
            self._done.wait()
            return
        self.complete()


class FakeStream:
    """The caller's stream on a fake device: work queued on it (``enqueue``) runs in
    order when something waits for it (a capture, a fence's copies) or ``run()``.

    ``capturing``: a CUDA graph capture is underway on it (captures and fences raise).
    """

    def __init__(self, name: str = "") -> None:
        self.name = name
        self.capturing = False
        self._cond = threading.Condition()
        self._ops: list[Callable[[], object]] = []
        self._running = False
        #: Work queued so far, and work that has run.
        self.queued = 0
        self.finished = 0

    def enqueue(self, op: Callable[[], object]) -> None:
        """Queue ``op`` (it runs when the stream gets that far)."""
        with self._cond:
            self._ops.append(op)
            self.queued += 1

    def wait_for(self, completion: Any) -> None:
        """Queue a wait: later work runs after ``completion`` (its copies land first)."""
        fire = getattr(completion, "complete", None) or completion.synchronize
        self.enqueue(fire)

    def run_until(self, position: int) -> None:
        """Run queued work (in order, one runner at a time) until ``position`` ops have
        run. Waiting does not hold the stream, so work that itself waits for an event
        whose copies wait for an earlier position cannot deadlock."""
        while True:
            with self._cond:
                while self._running and self.finished < position:
                    self._cond.wait()
                if self.finished >= position or not self._ops:
                    return
                op = self._ops.pop(0)
                self._running = True
            try:
                with torch.no_grad():
                    op()
            finally:
                with self._cond:
                    self.finished += 1
                    self._running = False
                    self._cond.notify_all()

    def run(self) -> None:
        """Run everything queued so far."""
        self.run_until(self.queued)

    def __repr__(self) -> str:
        return f"<FakeStream {self.name!r} {self.finished}/{self.queued}>"


class FakeCapture:
    """A capture: the position of ``stream`` at the call. Done once the stream's work
    up to there has run; ``synchronize`` runs it."""

    def __init__(self, stream: FakeStream, number: int) -> None:
        self.stream = stream
        self.position = stream.queued
        self.number = number
        self.synchronized = 0

    def query(self) -> bool:
        return self.stream.finished >= self.position

    def synchronize(self) -> None:
        self.synchronized += 1
        self.stream.run_until(self.position)

    complete = synchronize

    def __repr__(self) -> str:
        return f"<FakeCapture #{self.number} of {self.stream!r} at {self.position}>"


class _Where:
    """A destination as raw memory: address, dtype and layout (no reference to it)."""

    __slots__ = ("dtype", "nbytes", "ptr", "size", "stride")

    def __init__(self, ptr: int, nbytes: int, dtype: torch.dtype, size: Any, stride: Any) -> None:
        self.ptr, self.nbytes, self.dtype, self.size, self.stride = ptr, nbytes, dtype, size, stride

    @classmethod
    def of(cls, t: torch.Tensor) -> _Where:
        if any(st < 0 for st in t.stride()):
            raise RuntimeError("the fake copier takes destinations with non-negative strides")
        extent = 0 if t.numel() == 0 else 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
        return cls(t.data_ptr(), extent * t.element_size(), t.dtype, tuple(t.shape), t.stride())

    def view(self) -> torch.Tensor:
        if not self.nbytes:
            return torch.empty(self.size, dtype=self.dtype)
        raw = (ctypes.c_uint8 * self.nbytes).from_address(self.ptr)
        flat = torch.frombuffer(raw, dtype=torch.uint8).view(self.dtype)
        return flat.as_strided(self.size, self.stride)


def _check_broadcast(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Raise RuntimeError unless ``src`` broadcasts to ``dst``'s shape, as
    ``dst.copy_(src)`` requires (equal sizes or 1 in ``src``, aligned from the right;
    a ``src`` of more dimensions, or merely of the same number of elements, does not)."""
    try:
        ok = torch.broadcast_shapes(dst.shape, src.shape) == dst.shape
    except RuntimeError:
        ok = False
    if not ok:
        raise RuntimeError(
            f"shape mismatch: a source of shape {tuple(src.shape)} does not broadcast to "
            f"the destination's shape {tuple(dst.shape)}"
        )


_REDUCED_FLOATS = frozenset(
    {torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2}
    | {getattr(torch, n) for n in ("float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n)}
)


def _foreach_copy_through_float(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``torch._foreach_copy_`` as CUDA's fast path does it: bf16, fp16 and fp8 pass
    through float32 and back (NaN payloads become the canonical NaN). A copier that
    gathers values instead of bytes is then caught on the CPU."""
    plain_d: list[torch.Tensor] = []
    plain_s: list[torch.Tensor] = []
    for d, src in zip(dsts, srcs, strict=True):
        if d.dtype == src.dtype and d.dtype in _REDUCED_FLOATS:
            d.copy_(src.float().to(d.dtype))
        else:
            plain_d.append(d)
            plain_s.append(src)
    if plain_d:
        torch._foreach_copy_(plain_d, plain_s)


class FakeCopier(ScratchCopier):
    """An 'accelerator' copier over CPU tensors, with deferred, batched copies.

    Its copy stream waits on the capture: when the completion fires, the work queued on
    the captured stream before the call runs first, then the copies. Scratch memory is
    accounted against ``FakeBackend.scratch_limit`` but never really freed (copies
    still pending hold its raw address)."""

    def __init__(self, backend: FakeBackend, device: torch.device) -> None:
        super().__init__(device)
        self._backend = backend
        self._ops: list[Callable[[], None]] = []

    def capture(self) -> Any:
        self._backend.captures += 1
        return FakeCapture(self._backend.stream(self.device), self._backend.captures)

    def begin(self, capture: Any) -> None:
        captures = capture if isinstance(capture, tuple) else () if capture is None else (capture,)
        self._ops = [c.synchronize for c in captures if hasattr(c, "synchronize")]
        self._backend.begun.append(capture)

    def copy_now(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        if not dsts:
            return
        # As the accelerator copier: bytes, not values.
        dsts, srcs = bytewise(dsts, srcs)
        fail_at = self._backend.fail_copy_at
        if fail_at is not None:
            self._backend.copies_seen += len(dsts)
            if self._backend.copies_seen > fail_at:
                raise RuntimeError("injected copy failure")
        bad = self._backend.fail_copy_of
        if bad is not None and bad.numel():
            bad_ptr = bad.untyped_storage().data_ptr()
            if any(t.untyped_storage().data_ptr() == bad_ptr for t in srcs):
                raise RuntimeError("injected copy failure of one source")
        s = list(srcs)
        # Shapes are checked now, like a real enqueue would.
        for a, b in zip(dsts, s):
            _check_broadcast(a, b)
        # Like a DMA engine, a pending copy knows where to write, not which tensor:
        # holding the destination tensors would make a staged result look reachable
        # (see BufferSet.held) for as long as the copy is in flight.
        where = [_Where.of(t) for t in dsts]
        self._backend.launches += 1
        self._ops.append(lambda: _foreach_copy_through_float([w.view() for w in where], s))

    def hash_sources(
        self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], checksums: Checksums
    ) -> None:
        # Like the CUDA copier's hash stream: the hashes run when the completion
        # fires, after the captured stream's work and before the copies (which a
        # real device may overlap with them), into host memory the Checksums keep.
        layout, total = hash_layout(dsts, srcs)
        if not layout:
            return
        host = torch.empty(total, dtype=torch.int64)
        todo = [(src, lo, n) for d, src, lo, n in layout if checksums.add_device(d, host, lo)]
        self._backend.device_hashes += len(todo)

        def run() -> None:
            for src, lo, n in todo:
                piece_hashes(raw_bytes(src), host[lo : lo + n])

        self._ops.append(run)

    def protect(self, srcs: Sequence[torch.Tensor]) -> None:
        # The pending copies already keep their sources alive until they fire (as
        # record_stream does on CUDA); only the count is recorded, for tests.
        self._backend.protected.append(len(srcs))

    def end(self) -> FakeEvent:
        self.release_scratch()
        ev = FakeEvent(
            self._ops, delay=self._backend.delay, polls=self._backend.polls, manual=self._backend.manual
        )
        self._ops = []
        self._backend.events.append(ev)
        return ev

    def fence_point(self) -> Any:
        return self._backend.stream(self.device)

    def fence_point_of(self, capture: Any) -> Any:
        return capture.stream if isinstance(capture, FakeCapture) else None

    def fence(self, completion: Any, point: Any) -> None:
        self._backend.fences.append(completion)
        self._backend.fence_points.append(point)
        if isinstance(point, FakeStream):
            point.wait_for(completion)

    def _alloc_scratch(self, nbytes: int) -> torch.Tensor:
        self._backend._take_scratch(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def _grow_scratch(self, base: torch.Tensor) -> None:
        self._backend._take_scratch(base.numel())

    def _free_scratch(self, base: torch.Tensor) -> None:
        self._backend._give_scratch(base.numel())


class FakeBackend(Backend):
    """Every device is a fake accelerator (see module doc).

    ``delay``: seconds until an event fires by itself; ``polls``: fire after that many
    queries instead; ``manual``: fire only via ``complete()`` or ``complete_all()``.
    ``fail_copy_at``: raise in the copy that would take the total past this count.
    ``fail_copy_of``: raise in every copy that reads this tensor's storage (a fault
    tied to one source, so the error can name its path).
    ``devices``: the fake devices with a context, captured on at every call (the
    caller's current device first; default: the CPU, as a fake accelerator).
    ``host_copies``: CPU leaves are copied by the real host copier (one thread), which
    waits for the captures of ``devices`` first; then ``devices`` should name others
    than the CPU (e.g. ``torch.device("cuda", 0)``: no tensor lives there, its stream is
    where a test queues work that CPU leaves depend on).
    ``scratch_limit``: device bytes for gathering small storages (beyond it, allocating
    scratch raises ``torch.OutOfMemoryError``); None: unlimited.
    ``host_device``: what the worker runs on for pinning when no device is known.
    ``pinner``: the backend's pinner (e.g. a FakePinner); None: it cannot pin, so
    ``pin_memory`` defaults to False (a stager's ``pinner=`` overrides either way).
    """

    def __init__(
        self,
        *,
        delay: float = 0.0,
        polls: int | None = None,
        manual: bool = False,
        fail_copy_at: int | None = None,
        fail_copy_of: torch.Tensor | None = None,
        devices: Sequence[torch.device] | None = None,
        host_copies: bool = False,
        scratch_limit: int | None = None,
        host_device: torch.device | None = None,
        pinner: Pinner | None = None,
    ) -> None:
        self.delay = delay
        self.pinner_ = pinner
        self.polls = polls
        self.manual = manual
        self.fail_copy_at = fail_copy_at
        self.fail_copy_of = fail_copy_of
        self.devices: tuple[torch.device, ...] = (
            tuple(devices) if devices is not None else () if host_copies else (torch.device("cpu"),)
        )
        self.host_copies = host_copies
        self.scratch_limit = scratch_limit
        self.host_device_ = host_device
        self.copies_seen = 0
        self.launches = 0
        #: Sources whose digest was computed on the fake device (``hash_sources``).
        self.device_hashes = 0
        self.captures = 0
        #: What each ``begin`` was ordered after (a capture, a tuple of them, None).
        self.begun: list[Any] = []
        #: The number of sources each ``protect`` kept (one per begin, when ordered).
        self.protected: list[int] = []
        self.events: list[FakeEvent] = []
        self.fences: list[Any] = []
        #: The stream each fence ordered (read at the fence's call).
        self.fence_points: list[Any] = []
        #: Devices the worker made current (``device_guard``), in order.
        self.guards: list[torch.device] = []
        #: Scratch bytes held now, and at most.
        self.scratch_in_use = 0
        self.scratch_peak = 0
        self._streams: dict[torch.device, FakeStream] = {}

    def copier(self, device: torch.device) -> Copier:
        if self.host_copies and device.type == "cpu":
            return CpuCopier(device, threads=1)
        return FakeCopier(self, device)

    def known_devices(self) -> Sequence[torch.device]:
        return self.devices

    def device_guard(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        self.guards.append(device)
        return contextlib.nullcontext()

    def host_device(self) -> torch.device | None:
        return self.host_device_

    def capturing(self, device: torch.device) -> bool:
        return self.stream(device).capturing

    @property
    def asynchronous(self) -> bool:
        return True  # a fake accelerator: completion is the test's

    def pinner(self) -> Pinner | None:
        return self.pinner_

    # -- streams -------------------------------------------------------------------------

    def stream(self, device: torch.device) -> FakeStream:
        """The caller's current stream on ``device`` (its default stream at first)."""
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = FakeStream(f"{device} default")
        return s

    @contextlib.contextmanager
    def use_stream(self, device: torch.device, stream: FakeStream) -> Iterator[FakeStream]:
        """``with torch.cuda.stream(stream):`` for the fake ``device``."""
        prev = self.stream(device)
        self._streams[device] = stream
        try:
            yield stream
        finally:
            self._streams[device] = prev

    def complete_all(self) -> None:
        for ev in list(self.events):
            ev.complete()

    # -- scratch memory ------------------------------------------------------------------

    def _take_scratch(self, nbytes: int) -> None:
        if self.scratch_limit is not None and self.scratch_in_use + nbytes > self.scratch_limit:
            raise torch.OutOfMemoryError(
                f"fake device out of memory: {nbytes} bytes of scratch asked, "
                f"{self.scratch_in_use} of {self.scratch_limit} in use"
            )
        self.scratch_in_use += nbytes
        self.scratch_peak = max(self.scratch_peak, self.scratch_in_use)

    def _give_scratch(self, nbytes: int) -> None:
        self.scratch_in_use -= nbytes


class FakePinner:
    """Records registrations; ``fail`` makes the next registrations raise.
    ``needs_context``: pins as CudaPinner would, needing a device context (the engine
    then pins nothing for a stage with no device in use)."""

    def __init__(self, *, fail: bool = False, needs_context: bool = False) -> None:
        self.fail = fail
        self.needs_context = needs_context
        self.registered: dict[int, int] = {}
        self.total_registrations = 0

    def register(self, ptr: int, nbytes: int) -> None:
        if self.fail:
            raise PinningError(f"injected pinning failure ({nbytes} bytes)")
        self.registered[ptr] = nbytes
        self.total_registrations += 1

    def unregister(self, ptr: int) -> None:
        del self.registered[ptr]
