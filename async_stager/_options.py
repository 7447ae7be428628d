"""Options and their machine-dependent defaults.

Options are resolved once, at construction, into a frozen StagerOptions: ``None`` means
"what this machine supports" (pinning and non-blocking copies need CUDA). Asking
explicitly for a CUDA-only feature on a machine without CUDA is an UnsupportedError
there and then, not a surprise at the first checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from ._errors import UnsupportedError

__all__ = ["StagerOptions", "cuda_available", "resolve_options"]

#: Source storages up to this many bytes are batched on an accelerator: gathered on the
#: device by one fused kernel per dtype, then moved to the host by one copy per run.
DEFAULT_SMALL_TENSOR_BYTES = 64 * 1024
#: Upper bound of the device scratch memory (bytes) kept per plan for that batching.
DEFAULT_SCRATCH_BYTES = 256 * 1024 * 1024


def loop_friendly_threads() -> int:
    """Copy threads that leave one core to the event loop (at least one)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(torch.get_num_threads(), cores - 1))


def cuda_available() -> bool:
    """True when torch was built with CUDA and a device is visible."""
    return bool(torch.cuda.is_available())


@dataclass(frozen=True)
class StagerOptions:
    """How a stager stages; built by :func:`resolve_options`, never changed afterwards.

    - ``pin_memory``: host arenas are registered with CUDA (one registration per arena),
      so device-to-host copies run at full bandwidth and can be asynchronous.
    - ``share_memory``: host arenas live in shared memory (one memfd per arena), so a
      writer process can map the staged tensors without a copy (see ``export``).
    - ``non_blocking``: device-to-host copies are enqueued on a dedicated stream and
      completion is found by polling an event; False copies synchronously.
    - ``max_buffer_sets``: how many independent sets of host buffers a stager may hold;
      a stage never writes into a set that is leased (see ``Stager.snapshot``).
    - ``small_tensor_bytes``: storages up to this size (bytes) are batched on a device.
    - ``scratch_bytes``: device scratch memory (bytes) per plan for that batching (a
      buffer set keeps up to four plans, one per state dict layout).
    - ``yield_interval``: the longest the event loop should wait for the GIL while the
      worker runs Python (seconds); applied as the interpreter's switch interval during
      staging (see docs/concepts.md).
    - ``worker_nice``: niceness added to the worker thread (Linux), 0 to leave it; the
      event loop then preempts host copies at once (see docs/concepts.md).
    - ``copy_threads``: threads for host-to-host copies, the worker and ``n - 1``
      helpers (see ``_hostcopy``); None: torch's intra-op thread count.
    """

    pin_memory: bool
    share_memory: bool
    non_blocking: bool
    max_buffer_sets: int = 2
    small_tensor_bytes: int = DEFAULT_SMALL_TENSOR_BYTES
    scratch_bytes: int = DEFAULT_SCRATCH_BYTES
    yield_interval: float = 0.0002
    worker_nice: int = 5
    copy_threads: int | None = None

    def replace(self, **changes: object) -> StagerOptions:
        """A copy with some fields changed (validated again)."""
        new = dataclasses.replace(self, **changes)  # type: ignore[arg-type]
        new.validate()
        return new

    def validate(self) -> None:
        if self.max_buffer_sets < 1:
            raise UnsupportedError(f"max_buffer_sets must be >= 1, got {self.max_buffer_sets}")
        if self.small_tensor_bytes < 0 or self.scratch_bytes < 0:
            raise UnsupportedError("small_tensor_bytes and scratch_bytes must be >= 0")
        if not (0.0 < self.yield_interval <= 1.0):
            raise UnsupportedError(f"yield_interval must be in (0, 1] seconds, got {self.yield_interval}")


def resolve_options(
    *,
    pin_memory: bool | None = None,
    share_memory: bool = False,
    non_blocking: bool | None = None,
    max_buffer_sets: int = 2,
    small_tensor_bytes: int = DEFAULT_SMALL_TENSOR_BYTES,
    scratch_bytes: int = DEFAULT_SCRATCH_BYTES,
    yield_interval: float = 0.0002,
    worker_nice: int = 5,
    copy_threads: int | None = None,
    seam: bool = False,
    pinner_given: bool = False,
) -> StagerOptions:
    """Resolve ``None`` to what the machine supports; reject what it cannot do.

    ``seam``: a device backend or pinner was passed in (a fake, in tests). It stands in
    for the accelerator, so its features count as available, and pinning defaults to
    whether a pinner came (``pinner_given``).
    """
    has_cuda = True if seam else cuda_available()
    if pin_memory is None and seam:
        pin_memory = pinner_given
    if pin_memory is None:
        pin_memory = has_cuda
    elif pin_memory and not has_cuda:
        raise UnsupportedError("pin_memory=True needs CUDA, and no CUDA device is available")
    if non_blocking is None:
        non_blocking = has_cuda
    elif non_blocking and not has_cuda:
        raise UnsupportedError("non_blocking=True needs CUDA, and no CUDA device is available")
    if share_memory and not hasattr(os, "memfd_create") and not os.path.isdir("/dev/shm"):
        raise UnsupportedError("share_memory=True needs memfd_create or /dev/shm")
    opts = StagerOptions(
        pin_memory=bool(pin_memory),
        share_memory=bool(share_memory),
        non_blocking=bool(non_blocking),
        max_buffer_sets=max_buffer_sets,
        small_tensor_bytes=small_tensor_bytes,
        scratch_bytes=scratch_bytes,
        yield_interval=yield_interval,
        worker_nice=worker_nice,
        copy_threads=copy_threads,
    )
    opts.validate()
    return opts
