"""The device seam: a Backend makes one Copier per source device; a Completion marks
the end of enqueued copies.

The engine speaks only to this interface. The real implementations are in
``_copiers`` (CpuCopier: copies in the worker thread and its helpers, GIL released by
torch; CudaCopier: a dedicated copy stream per device, non-blocking copies, a completion
event). The fakes in ``async_stager.testing`` implement the same interface on the CPU,
with completion that the test controls, which is how CPU tests reach the asynchronous
logic. This module also holds the CUDA queries the seam needs (which devices have a
context, graph capture).

Hazards:
- CUDA ordering: at the call, a *capture* event is recorded on the caller's current
  stream of every CUDA device that has a context in this process (a source can only
  live on such a device); the copy stream of each device first waits on that device's
  capture, so the copies read the values as of the call, after all work already queued
  there. Host copies of CPU leaves first wait (on the host) for every capture: a pinned
  CPU tensor may still be the target of a ``non_blocking`` copy queued on the caller's
  stream.
- CUDA graphs: an event cannot be recorded for use outside a stream that is capturing
  a graph; the engine asks ``Backend.capturing`` first and refuses with
  UnsupportedError (``graph_capture_error``).
- Contexts: event queries and host waits run with the event's device current, and the
  worker runs with a device that already has a context: a thread that never used CUDA
  would otherwise create a context on GPU 0 (for every rank).
- Allocator: the sources are read by another stream; ``protect`` calls
  ``record_stream`` so the caching allocator cannot hand their memory to a new tensor
  (and overwrite it) before the copies have finished (torchrec #4231, #4322). Memory
  the allocator does not own (DLPack imports, CUDA IPC handles) is freed by its owner
  when its last tensor dies, whatever ``record_stream`` said: the stage's completion
  event holds every CUDA source until it is observed complete.
- Scratch (``ScratchCopier``): device memory for gathering small storages holds real
  memory only from a run's gather to its host copy (freed in stream order right after),
  within a budget per copier; when it cannot be had, the run is copied directly.
- The host memory must be pinned for the copy to be asynchronous; into pageable memory
  CUDA silently makes it synchronous (correct, slower).
"""

from __future__ import annotations

import contextlib
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from async_stager._core.checksum.digest import Checksums
from async_stager._core.memory.arena import Pinner
from async_stager.errors import UnsupportedError

__all__ = [
    "Backend",
    "Completion",
    "Copier",
    "caller_cuda_device",
    "capturing",
    "cuda_context_devices",
    "graph_capture_error",
    "order_after",
    "pinning_device",
]


class Completion(Protocol):
    """Marks the end of enqueued copies (a CUDA event, or a fake one)."""

    def query(self) -> bool:
        """True once every copy enqueued before it has finished; never blocks."""
        ...

    def synchronize(self) -> None:
        """Block the calling thread until ``query()`` would be True."""
        ...


# -- CUDA queries -----------------------------------------------------------------------


def cuda_context_devices() -> list[int]:
    """CUDA devices that have a (primary) context in this process, the calling thread's
    current device first; empty before CUDA is initialised. Creates no context.

    A tensor can only live on such a device, so these are the devices a stage may read
    from. Cost: a driver query per device (microseconds)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return []
    current = torch.cuda.current_device()
    has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    if has_context is None:  # pragma: no cover - every CUDA build of torch 2.x has it
        return [current]
    devices = [d for d in range(torch.cuda.device_count()) if has_context(d)]
    if current in devices:
        devices.remove(current)
        devices.insert(0, current)
    return devices


def caller_cuda_device() -> int | None:
    """The calling thread's CUDA device for work done on its behalf in another thread:
    its current device if that has a context, else the first device that has one, else
    None (CUDA unused). Never names a device without a context (which would create one
    there, typically on GPU 0)."""
    devices = cuda_context_devices()
    return devices[0] if devices else None


def pinning_device() -> torch.device | None:
    """Where a worker that must pin host memory runs when no device has a context yet
    (a CPU-only state dict before CUDA is initialised): pinning needs a context, and
    the thread's default device is GPU 0 for every rank. Taken: the first device with a
    context, else ``LOCAL_RANK`` (modulo the visible devices; what torchrun-launched
    ranks pass to ``torch.cuda.set_device``), else device 0."""
    if not torch.cuda.is_available():
        return None
    devices = cuda_context_devices()
    if devices:
        return torch.device("cuda", devices[0])
    count = torch.cuda.device_count()
    if count <= 0:
        return None
    local = os.environ.get("LOCAL_RANK", "")
    index = int(local) % count if local.isdigit() else 0
    return torch.device("cuda", index)


#: How to stage next to CUDA graphs; part of every graph-capture refusal.
_GRAPH_CAPTURE_HINT = (
    "stage (and fence) outside the capture: before torch.cuda.graph(...) is entered or "
    "after it exits, e.g. between the replays of a captured training step; a graph "
    "captured in another thread while stages are in flight should use "
    'torch.cuda.graph(..., capture_error_mode="thread_local"): the stager\'s worker and '
    "event loop make CUDA calls that a global-mode capture forbids in every thread"
)


def graph_capture_error(what: str, device: Any) -> UnsupportedError:
    """The error for ``what`` (``stage()``, ``fence()``) called while the caller's
    current stream on ``device`` is capturing a CUDA graph."""
    return UnsupportedError(
        f"{what} was called while the current CUDA stream of {device} is capturing a CUDA "
        "graph: an event recorded or waited for inside a capture belongs to the graph, "
        f"so the copies could not be ordered with it; {_GRAPH_CAPTURE_HINT}"
    )


def capturing(index: int) -> bool:
    """True if the calling thread's current stream on device ``index`` is capturing a
    CUDA graph (any capture mode). Creates no context."""
    if torch.cuda.current_device() == index:
        return bool(torch.cuda.is_current_stream_capturing())
    with torch.cuda.device(index):
        return bool(torch.cuda.is_current_stream_capturing())


def order_after(device: torch.device, captures: Mapping[torch.device, Any]) -> Any:
    """What ``Copier.begin`` takes for a program on ``device``: that device's capture;
    for the CPU (no capture of its own), the captures of every accelerator device,
    which the host copies wait for; None when there is none."""
    capture = captures.get(device)
    if capture is not None:
        return capture
    if device.type == "cpu":
        others = tuple(c for d, c in captures.items() if c is not None and d != device)
        return others or None
    return None


# -- the seam ---------------------------------------------------------------------------


class Copier(ABC):
    """Copies from one source device into host memory.

    Call order for one stage, all on the worker thread except ``capture`` and
    ``fence_point`` (the caller's thread, at the call) and ``fence`` (any thread):
    ``begin(capture)``, ``hash_sources`` (a stage taking checksums), any number of
    ``copy``, ``protect``, then ``end()``.
    """

    #: True when small storages should first be gathered on the device (one fused
    #: kernel) and moved by one copy per contiguous host run.
    batch_small: bool = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def capture(self) -> Any:
        """Mark the snapshot point on the caller's current stream (caller's thread;
        the engine has checked that it is not capturing a CUDA graph)."""
        return None

    def begin(self, capture: Any) -> None:
        """Order what follows after ``capture`` (``order_after``: this device's
        capture, or for the CPU a tuple of every accelerator's captures)."""

    @abstractmethod
    def copy(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        """Enqueue ``dsts[i].copy_(srcs[i])`` for every i (same shapes and dtypes)."""

    def prepare(self, dsts: Sequence[torch.Tensor]) -> Any:
        """Plan time: a copier-specific layout for copying into ``dsts`` (fixed host
        tensors) with ``copy_planned``, or None to use ``copy`` in chunks. Called once
        per program, after every ``scratch`` of the plan."""
        return None

    def copy_planned(
        self,
        dsts: Sequence[torch.Tensor],
        srcs: Sequence[torch.Tensor],
        layout: Any,
        tick: Callable[[], None],
        checksums: Checksums | None = None,
        first: bool = False,
    ) -> None:
        """Like ``copy`` for all of ``dsts`` at once, with ``prepare``'s layout;
        ``tick`` may be called between parts (it raises to cancel). ``checksums``: a
        copier whose copies have landed when this returns (``end()`` gives None) may
        hash destinations into it as they land; the engine hashes the rest.
        ``first``: the destinations were just mapped (their pages fault as they are
        written), which more threads absorb faster."""
        raise NotImplementedError

    def hash_sources(
        self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], checksums: Checksums
    ) -> None:
        """Enqueue, on the device, the WSUM64 digest (``_wordhash``) of every source
        that a device can hash before it is copied (``device_pairs``), recorded in
        ``checksums`` for its destination ``dsts[i]``; the digests land in host memory
        by the time ``end()``'s completion fires. Called right after ``begin``, so the
        hashes read the values as of the capture, like the copies. Default: nothing
        (the destinations are hashed from the host copy later)."""

    def protect(self, srcs: Sequence[torch.Tensor]) -> None:
        """Keep the sources' memory from being reused until the copies finish."""

    def end(self) -> Completion | None:
        """Finish this stage's enqueueing; None means the copies are already done."""
        return None

    def fence_point(self) -> Any:
        """The caller's current stream (caller's thread, at the call): what ``fence``
        will order."""
        return None

    def fence_point_of(self, capture: Any) -> Any:
        """The fence point of the stream ``capture`` (this copier's ``capture()``) was
        taken on: what ``fence_point`` returned at that call, for a fence whose call was
        the capture's (a save that builds its pipeline later). None: not known (the
        fence then orders the current stream of the thread applying it)."""
        return None

    def fence(self, completion: Completion, point: Any) -> None:
        """Make ``point`` (``fence_point``'s stream; None: the current stream of the
        calling thread) wait for ``completion``, without blocking the host."""

    def scratch(self, nbytes: int) -> torch.Tensor:
        """Device memory (uint8) for gathering small storages, valid on this copier."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def close(self) -> None:
        """Drop streams and anything held."""


class Backend(ABC):
    """Makes the Copier for each source device, and answers the engine's questions
    about devices: which to capture on at a call (``known_devices``), how to make one
    current (``device_guard``), where a pinning worker runs (``host_device``) and
    whether a stream is capturing a CUDA graph (``capturing``); and declares what it can
    do: non-blocking copies (``asynchronous``) and pinning (``pinner``: the ``Pinner``
    of ``_arena`` it pins with)."""

    @abstractmethod
    def copier(self, device: torch.device) -> Copier: ...

    #: True when ``device_of`` may differ from a tensor's own ``device`` (the engine
    #: then asks it for each source storage; otherwise it reads ``t.device``).
    places_tensors = False

    def device_of(self, t: torch.Tensor) -> torch.device:
        """The device whose copier copies source ``t``: its own ``t.device``. A
        simulated device says its own for the CPU tensors viewing its memory, so the
        engine's accelerator paths run for them and plain CPU tensors go to the host
        copier, as on CUDA (``places_tensors``)."""
        return t.device

    def known_devices(self) -> Sequence[torch.device]:
        """Accelerator devices to capture on at a call: every device a source may live
        on (the caller's current device first)."""
        return ()

    def device_guard(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        """Make ``device`` the calling thread's current device for a while."""
        if device.type == "cuda":
            return torch.cuda.device(device)
        return contextlib.nullcontext()

    def host_device(self) -> torch.device | None:
        """The device a worker that pins host memory would run on when the stage names
        none (no device has a context yet); None: any. The engine no longer pins then
        with a pinner that needs a context (``Engine._skips_pinning``), so it makes no
        device current for such a stage."""
        return None

    def capturing(self, device: torch.device) -> bool:
        """True if the calling thread's current stream on ``device`` is capturing a
        CUDA graph (checked at every call before anything is recorded there)."""
        return False

    # -- capabilities (read once, when a stager's options are resolved) ----------------

    @property
    def asynchronous(self) -> bool:
        """Whether device copies can be enqueued without waiting for them (what a
        ``non_blocking`` stager needs; its default)."""
        return False

    def pinner(self) -> Pinner | None:
        """The Pinner that registers host arenas for fast device copies, or None when
        this backend cannot pin (``pin_memory`` then defaults to False, and True is
        refused)."""
        return None
