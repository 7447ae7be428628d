"""The real copiers and backend: host copies on the CPU, a copy stream per accelerator.

``CpuCopier`` copies in the worker thread (and the host copy pool's helpers, see
``_hostcopy``), the GIL released by torch. On CUDA, ``AcceleratorCopier`` (``accelerator``)
over ``CudaPrimitives`` (``cuda``) enqueues non-blocking device-to-host copies on a
dedicated stream per device, ordered after the stage's capture, with an event as its
Completion; small storages are gathered in device scratch first (``ScratchCopier``).
``RealBackend`` makes them; see ``device`` for the seam and the hazards they handle.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from async_stager._core.checksum.digest import Checksums
from async_stager._core.copy.accelerator import AcceleratorCopier
from async_stager._core.copy.cuda import CudaPrimitives
from async_stager._core.copy.device import (
    Backend,
    Copier,
    capturing,
    cuda_context_devices,
    pinning_device,
)
from async_stager._core.copy.hostcopy import MIN_POOL_BYTES, CopyPool, Schedule, hashed_pieces, schedule
from async_stager._core.copy.openmp import omp_threads
from async_stager._core.copy.scratch import ScratchCopier, bytewise
from async_stager._core.memory.arena import CudaPinner, Pinner
from async_stager._core.options import AUTO, auto_copy_threads, loop_friendly_threads

__all__ = ["CpuCopier", "CudaCopier", "RealBackend", "ScratchCopier", "bytewise"]


class CudaCopier(AcceleratorCopier):
    """The accelerator copier on one CUDA device (``CudaPrimitives``)."""

    def __init__(self, device: torch.device, *, non_blocking: bool) -> None:
        super().__init__(CudaPrimitives(device), non_blocking=non_blocking)


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
