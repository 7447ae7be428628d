"""Host views of a staged tensor: its layout on a storage, with its lazy bits.

A tensor's conjugate and negative bits (``is_conj()``, ``is_neg()``) are not in its
bytes: a staged copy, an exported handle or a rebuilt view without them reads ``z``
where the source was ``z.conj()`` and ``x`` where it was ``-x``. Every place that
records or rebuilds such a view (the plan's host views, the sharing handles, the
torch.multiprocessing reducers) goes through these two functions, so the encoding and
its order (conjugate first, then negative) have one home.
"""

from __future__ import annotations

import torch

__all__ = ["CONJ", "NEG", "lazy_bits", "view_on", "with_lazy_bits"]

#: Bit flags of ``lazy_bits``; the order ``with_lazy_bits`` applies them in is fixed.
CONJ = 1
NEG = 2


def lazy_bits(t: torch.Tensor) -> int:
    """The tensor's lazy bits as ``CONJ | NEG`` flags (0 for a plain tensor)."""
    return int(t.is_conj()) * CONJ | int(t.is_neg()) * NEG


def with_lazy_bits(t: torch.Tensor, bits: int) -> torch.Tensor:
    """``t`` as a view with the lazy bits ``bits`` set (``t`` itself when 0). The view
    shares ``t``'s memory; nothing is copied."""
    if bits & CONJ:
        t = t.conj()
    if bits & NEG:
        t = torch._neg_view(t)
    return t


def view_on(
    storage: torch.UntypedStorage,
    dtype: torch.dtype,
    storage_offset: int,
    size: tuple[int, ...] | torch.Size,
    stride: tuple[int, ...],
    bits: int = 0,
) -> torch.Tensor:
    """A tensor of ``dtype`` over ``storage`` at ``storage_offset`` (elements) with
    ``size`` and ``stride``, with the lazy bits ``bits``. ``storage`` stays owned by
    whoever owns it; the view keeps it alive."""
    t = torch.empty(0, dtype=dtype).set_(storage, storage_offset, size, stride)
    return with_lazy_bits(t, bits)
