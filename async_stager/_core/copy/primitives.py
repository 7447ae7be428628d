"""The device primitives under the accelerator copier: streams, events, an
asynchronous copy, stream-ordered memory, host registration.

``AcceleratorCopier`` (``_core.copy.accelerator``) holds every ordering rule of a stage
on an accelerator (the copy stream waits on the capture, sources are protected until
read, small storages are gathered in scratch, bytes not values, completion is an
event); it reaches the device only through a ``DevicePrimitives``. Two implement it:

- ``CudaPrimitives`` (``_core.copy.cuda``): ``torch.cuda``, the calls the copier used to
  make itself.
- ``SimulatedDevice`` (``_core.copy.simulated``, exported by ``async_stager.testing``):
  on the CPU, each stream a queue run in order by its own thread, copies that land
  after seeded random delays, freed memory handed out (and overwritten) at once. A
  missing wait or protection then shows up as wrong bytes in the default test suite.

A ``torch.accelerator`` implementation (XPU, out-of-tree backends) would be one more
class: every method maps to a ``torch.Stream``/``torch.Event`` call or a copy with that
stream current.

Streams and events are opaque to the copier (``Any``): it only hands them back.
"""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

from async_stager._core.memory.arena import Pinner
from async_stager.errors import CopyError

__all__ = ["POOL_STREAMS", "DeviceEvent", "DevicePrimitives", "poll_until"]

#: Streams in torch's pool per device (``torch.cuda.Stream()`` hands them out
#: round-robin): drawing one more than this has seen every stream.
POOL_STREAMS = 32


class DevicePrimitives(ABC):
    """One accelerator device's primitives (see the module doc). Thread-safe: the
    caller's thread records captures, the worker enqueues, the event loop queries."""

    #: Streams in this device's pool (``pool_stream`` hands them out round-robin).
    pool_size = POOL_STREAMS

    def __init__(self, device: torch.device) -> None:
        self.device = device

    # -- streams -----------------------------------------------------------------------

    @abstractmethod
    def current_stream(self) -> Any:
        """The calling thread's current stream on this device."""

    @abstractmethod
    def default_stream(self) -> Any:
        """This device's default stream."""

    @abstractmethod
    def pool_stream(self) -> Any:
        """The next stream of the device's pool (``torch.cuda.Stream()``): shared with
        every other user of the device (training, NCCL), handed out round-robin, so it
        may be one of theirs."""

    def new_stream(self, avoid: Sequence[Any] = ()) -> Any:
        """A stream for the stager's own work: never the default stream, the calling
        thread's current stream, nor one of ``avoid``.

        Hazard: the pool (``pool_stream``) hands its ``pool_size`` streams out
        round-robin, so once they all exist the next one is a stream that other code
        (training) may be using, possibly the very stream the copies are ordered after:
        work on it would serialize with training, and a fence (copies ordered before
        that stream's later work) would order a stream after itself. So draw again
        until the stream is none of those (at most one pass over the pool). Drawn once
        per copier, and copiers are kept (the engine's, the lanes'): every draw may
        hand out a stream of someone else's that is not current here."""
        banned = [self.default_stream(), self.current_stream(), *avoid]
        for _ in range(self.pool_size + 1):
            stream = self.pool_stream()
            if not any(stream == b for b in banned):
                return stream
        raise RuntimeError(  # pragma: no cover - needs every pooled stream banned
            f"every pooled stream of {self.device} is in use by the caller or the stager"
        )

    @abstractmethod
    def using(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Make this device and ``stream`` current on the calling thread for a while:
        what is enqueued meanwhile (copies, kernels, allocations) belongs to it."""

    @abstractmethod
    def wait_stream(self, stream: Any, other: Any) -> None:
        """``stream``'s later work waits for what ``other`` has queued so far."""

    # -- events ------------------------------------------------------------------------

    @abstractmethod
    def record(self, stream: Any) -> Any:
        """An event recorded on ``stream`` now (a host wait on it sleeps)."""

    @abstractmethod
    def query(self, event: Any) -> bool:
        """True once the event's stream has reached it; never blocks."""

    @abstractmethod
    def wait_event(self, stream: Any, event: Any) -> None:
        """``stream``'s later work waits for ``event`` (no host block)."""

    # -- memory ------------------------------------------------------------------------

    @abstractmethod
    def empty(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of device memory (uint8), owned by the current stream."""

    def grow(self, base: torch.Tensor) -> None:
        """Give ``base`` (made by ``empty``, freed by ``free``) its memory again."""
        storage = base.untyped_storage()
        if storage.nbytes() < base.numel():
            storage.resize_(base.numel())

    def free(self, base: torch.Tensor) -> None:
        """Free ``base``'s memory in stream order: only later work of the stream that
        owns it may reuse it. ``base`` keeps its shape (``grow`` restores it)."""
        base.untyped_storage().resize_(0)

    @abstractmethod
    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """Keep ``tensor``'s memory from reuse until ``stream``'s work queued so far
        has run (the allocator's protection of a source read by another stream)."""

    @abstractmethod
    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on this device ("is this on the device")."""

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Host memory a copy from the device lands in asynchronously (pinned)."""
        return torch.empty(numel, dtype=dtype)

    def pinner(self) -> Pinner | None:
        """How host memory is registered with this device (None: it cannot be)."""
        return None

    # -- work --------------------------------------------------------------------------

    @abstractmethod
    def copy(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        """Enqueue ``dsts[i].copy_(srcs[i])`` on the current stream, asynchronously."""

    def launch(self, fn: Any, *tensors: torch.Tensor) -> None:
        """Enqueue the device work that ``fn(*tensors)`` launches (kernels reading and
        writing the device tensors ``tensors``) on the current stream.

        A kernel holds nothing: what it reads stays alive only as long as the caller
        (or ``record_stream``, an event's hold) keeps it. So ``fn`` takes every device
        tensor it uses as an argument and must not hold one itself; the simulated
        device passes it views of the same memory made when it runs, and keeps no
        reference to ``tensors`` meanwhile."""
        fn(*tensors)

    def capturing(self) -> bool:
        """True if the calling thread's current stream is capturing a graph."""
        return False


def poll_until(done: Any, timeout: float, what: str) -> None:
    """Wait on the host until ``done()`` is true, at most ``timeout`` seconds: CopyError
    naming ``what`` after that. Polls with a sleep doubling from 0.1 ms up to 1 ms (a
    blocking driver wait cannot be bounded)."""
    if done():
        return
    deadline = time.monotonic() + timeout
    delay = 0.0001
    while not done():
        if time.monotonic() >= deadline:
            raise CopyError(
                f"{what} still not finished after {timeout:g} s: the device looks wedged "
                "(a kernel that never ends, an Xid error); see nvidia-smi"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.001)


class DeviceEvent:
    """An event recorded on ``stream`` now: a capture, and a stage's Completion.

    ``keep``: what must stay alive until the event is seen complete (a stage's device
    sources: memory the allocator does not own, a DLPack import, is freed by its owner
    when its last tensor dies, whatever ``record_stream`` said). ``synchronize`` is
    bounded (``timeout`` seconds, CopyError after). ``stream``: where it was recorded
    (a capture's: the caller's stream at the call, which a later fence orders)."""

    __slots__ = ("event", "keep", "prims", "stream", "timeout")

    def __init__(self, prims: DevicePrimitives, stream: Any, *, timeout: float) -> None:
        self.prims = prims
        self.stream = stream
        self.event = prims.record(stream)
        self.timeout = timeout
        self.keep: list[torch.Tensor] = []

    def query(self) -> bool:
        done = self.prims.query(self.event)
        if done:
            self.keep = []  # read: an event kept for a later fence must not hold them
        return done

    def synchronize(self) -> None:
        poll_until(self.query, self.timeout, f"copies on {self.prims.device}")

    def wait(self, stream: Any) -> None:
        """Make ``stream``'s future work wait for this event (no host block)."""
        self.prims.wait_event(stream, self.event)
