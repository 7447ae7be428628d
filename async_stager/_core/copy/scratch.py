"""``ScratchCopier``: a copier that gathers small storages in device scratch, and
``bytewise`` (copies as bytes, not values). Below the accelerator copier; the
simulated device and the tests' fakes derive from it too.
"""

from __future__ import annotations

import weakref
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

from async_stager._core.copy.device import Completion, Copier

__all__ = ["ScratchCopier", "bytewise"]


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
    are not both contiguous keep their dtype (an elementwise same-dtype ``copy_``), and
    so does a pair with lazy conj/neg bits (its bytes are not its values; the
    accelerator copier resolves such sources on the device before it gets here).
    """
    out_d: list[torch.Tensor] = []
    out_s: list[torch.Tensor] = []
    for d, s in zip(dsts, srcs, strict=True):
        lazy = d.is_conj() or d.is_neg() or s.is_conj() or s.is_neg()
        if not lazy and d.dtype == s.dtype and d.is_contiguous() and s.is_contiguous() and d.shape == s.shape:
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
        """Enqueue ``dsts[i].copy_(srcs[i])`` (no scratch routing), as bytes where
        ``bytewise`` allows (a gather hands its pairs here unconverted)."""

    def copy(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        if not dsts:
            return
        key = _storage_key(dsts[0])
        if key in self._bases:
            # A gather into a run's scratch. Bytes, not values: a gather is a bit copy
            # whatever the dtype (``copy_now`` makes the pairs bytewise itself).
            if key not in self._direct and self._materialize(key):
                self.copy_now(dsts, srcs)
            else:
                self._direct.setdefault(key, []).append(bytewise(dsts, srcs))
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
