"""The fast path's question: does the last stage's plan still hold for these leaves?

``plan_holds`` compares the leaves with the plan's fingerprint (``_layout.FINGERPRINT``:
everything a staged tensor carries but its values), in chunks so the GIL is handed over
between them; the slow path also asks it whether the leaves of its second walk still fit
the plan made from its first. The memory helpers (``reads_in_pool``, ``overlaps``) tell
whether a stage reads memory of its own buffer set (an earlier result staged again),
which its destinations must never overlap.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from async_stager._core.memory.arena import Block, HostPool
from async_stager._core.memory.storage_cache import StorageCache
from async_stager._core.plan.layout import FINGERPRINT, HOST_MARKS, Plan, identity_layout
from async_stager._core.walk.objects import Interrupt
from async_stager.errors import StagingError

__all__ = ["hosts_intact", "overlaps", "plan_holds", "reads_in_pool", "repeats", "take_over"]

#: Leaves per fingerprint chunk (each chunk's maps hold the GIL; ticks come between).
_FP_CHUNK = 512

#: What a caller may attach to a host tensor handed out in a result: a gradient (None
#: unless set), hooks (None, or empty once every hook was removed).
_GRAD = operator.attrgetter("_grad")
_HOOKS = (operator.attrgetter("_backward_hooks"), operator.attrgetter("_post_accumulate_grad_hooks"))

#: The dtypes a conj bit can be set on.
_COMPLEX = frozenset({torch.complex32, torch.complex64, torch.complex128})


def plan_holds(
    plan: Plan,
    leaves: list[torch.Tensor],
    tick: Callable[[], None],
    *,
    planned: list[torch.Tensor] | None = None,
    pool: HostPool | None = None,
) -> bool:
    """True when ``leaves`` can be copied with ``plan`` unchanged, and the result it
    builds is what a new plan would build (see ``FINGERPRINT``).

    With ``planned``, the leaves the plan was made from (the slow path's first walk,
    ``leaves`` being its second), and the ``pool`` of the plan's buffer set, their
    memory may differ: an object whose ``__getstate__`` makes new tensors each call
    gives new ones to each walk, and the copies read the second walk's. The layout may
    not: the same fingerprint but for the data pointers, the same tensors repeated,
    the same leaves sharing a storage, storages of the same sizes, and no new memory
    that the plan writes. A state dict changed between the walks does not fit.
    """
    if _fingerprint_holds(plan, leaves, tick):
        return True
    if planned is None or pool is None or len(leaves) != len(planned):
        return False
    if not _fingerprint_holds(plan, leaves, tick, skip=1):
        return False
    if _aliasing(planned) != _aliasing(leaves):
        return False
    seen = {t.untyped_storage()._cdata for t in planned}
    new = [st for st in (t.untyped_storage() for t in leaves) if st._cdata not in seen]
    reads = reads_in_pool(pool, new)
    return not (reads and any(overlaps(u.block, reads) for u in plan.units))


def hosts_intact(plan: Plan, tick: Callable[[], None]) -> bool:
    """The plan's host tensors are as the plan made them (``HOST_MARKS``: layout, memory,
    dtype, requires_grad, class) with nothing attached (a gradient, hooks): a caller
    that changed a tensor of an earlier result in place (``unsqueeze_``,
    ``requires_grad_``, ``.grad =``) made it unfit to be handed out again, and the plan
    is then made anew (its memory found again in the storage cache). In chunks, ticking
    between them, as ``plan_holds``."""
    hosts = plan.hosts
    marks = plan.host_marks
    if len(marks) != len(HOST_MARKS):
        return False
    for lo in range(0, len(hosts), _FP_CHUNK):
        chunk = hosts[lo : lo + _FP_CHUNK]
        for f, expected in zip(HOST_MARKS, marks):
            if f(chunk) != expected[lo : lo + _FP_CHUNK]:
                return False
        if any(map(operator.is_not, map(_GRAD, chunk), itertools.repeat(None))):
            return False
        if any(any(map(get, chunk)) for get in _HOOKS):
            return False
        del chunk
        tick()
    return True


def _fingerprint_holds(
    plan: Plan, leaves: list[torch.Tensor], tick: Callable[[], None], *, skip: int = 0
) -> bool:
    """The leaves have the plan's fingerprint (without its first ``skip`` entries, the
    data pointers with 1) and, with the pointers, the storages of whole-storage units."""
    n = len(leaves)
    if n != len(plan.hosts):
        return False
    dtypes = plan.fingerprint[1]
    real = len(FINGERPRINT) - 1  # entries but the last (the conj bit)
    # In chunks, ticking between them: each map over all leaves holds the GIL.
    for lo in range(0, n, _FP_CHUNK):
        chunk = leaves[lo : lo + _FP_CHUNK]
        hi = len(FINGERPRINT) if not _COMPLEX.isdisjoint(dtypes[lo : lo + _FP_CHUNK]) else real
        for f, expected in zip(FINGERPRINT[skip:hi], plan.fingerprint[skip:hi]):
            if f(chunk) != expected[lo : lo + _FP_CHUNK]:
                return False
        tick()
    if skip:
        return True
    for i, ptr, nbytes in plan.whole_checks:
        st = leaves[i].untyped_storage()
        if st.data_ptr() != ptr or st.nbytes() != nbytes:
            return False
    repeats = plan.repeats
    if repeats is not None:
        idx, same = repeats
        got = operator.itemgetter(*idx)(leaves) if len(idx) > 1 else (leaves[idx[0]],)
        if _first_of_same(idx, got) != same:
            return False
    return True


def repeats(ptrs: list[Any], leaf_u: list[int]) -> tuple[list[int], list[int]] | None:
    """``Plan.repeats`` of leaves with data pointers ``ptrs`` and unique-tensor
    indices ``leaf_u``."""
    if len(set(ptrs)) == len(ptrs):
        return None
    count = collections.Counter(ptrs)
    idx = [i for i, p in enumerate(ptrs) if count[p] > 1]
    first: dict[int, int] = {}
    return idx, [first.setdefault(leaf_u[i], i) for i in idx]


def _first_of_same(idx: list[int], tensors: Sequence[torch.Tensor]) -> list[int]:
    first: dict[int, int] = {}
    return [first.setdefault(id(t), i) for i, t in zip(idx, tensors)]


def _aliasing(leaves: list[torch.Tensor]) -> list[tuple[int, int, int]]:
    """Per leaf: which tensor (first index of the same object), which storage (first
    index of a leaf on it) and its size in bytes."""
    tensors: dict[int, int] = {}
    storages: dict[int, int] = {}
    out = []
    for i, t in enumerate(leaves):
        st = t.untyped_storage()
        out.append((tensors.setdefault(id(t), i), storages.setdefault(st._cdata, i), st.nbytes()))
    return out


def reads_in_pool(pool: HostPool, storages: Iterable[torch.UntypedStorage]) -> list[tuple[int, int]]:
    """The byte ranges of ``storages`` that lie in one of ``pool``'s arenas, sorted and
    merged (usually none: only a staged result, staged again, lives there)."""
    arenas = sorted((a.base, a.base + a.nbytes) for a in list(pool.arenas))
    if not arenas:
        return []
    lo, hi = arenas[0][0], max(end for _, end in arenas)
    starts = [a for a, _ in arenas]
    found = []
    for st in storages:
        p = st.data_ptr()
        if lo <= p < hi:
            n = st.nbytes()
            if n and p < arenas[bisect.bisect_right(starts, p) - 1][1]:
                found.append((p, p + n))
    found.sort()
    merged: list[tuple[int, int]] = []
    for a, b in found:
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
        else:
            merged.append((a, b))
    return merged


def overlaps(block: Block, reads: list[tuple[int, int]]) -> bool:
    """Whether ``block`` overlaps one of ``reads`` (sorted, disjoint ranges)."""
    if not block.nbytes:
        return False
    lo = block.tensor.data_ptr()
    hi = lo + block.nbytes
    k = bisect.bisect_left(reads, (hi,)) - 1  # the last range starting below ``hi``
    return k >= 0 and reads[k][1] > lo


def take_over(
    plan: Plan, leaves: list[torch.Tensor], cache: StorageCache, pool: HostPool, tick: Callable[[], None]
) -> bool:
    """The fast path for new tensors: True when ``leaves`` are other tensors than the
    plan's (new storages, data pointers of their own) laid out exactly as the plan's
    were, whose predecessors have all died; the plan's memory is then handed to them
    (``StorageCache.take_over``) and the plan updated to their data pointers, so the
    stage copies with the plan as it is: no walk again, no allocation, no pinning.

    "Laid out exactly": the fingerprint but for data pointers, the same tensors
    repeated, the same leaves sharing a storage, storages of the same sizes, and no
    new storage inside this buffer set's memory (an earlier result staged again).
    Anything unexpected (a leaf whose layout cannot even be read) is a False: the
    slow path then checks and reports it.
    """
    identity = plan.identity
    if identity is None or len(leaves) != len(plan.hosts):
        return False
    try:
        if not _fingerprint_holds(plan, leaves, tick, skip=1):
            return False
        same_tensor, same_storage, nbytes, storages = identity_layout(leaves)
        if same_tensor != identity[0] or same_storage != identity[1] or nbytes != identity[2]:
            return False
        if _inside(pool, storages, nbytes):
            return False
        pairs = [(storages[i], leaves[i].device, block) for i, block in plan.groups]
    except (Interrupt, StagingError):
        raise  # a cancelled job or a closed stager (the tick): not a layout question
    except Exception:  # noqa: BLE001 - the slow path validates and names the leaf
        return False
    if not cache.take_over(pairs):
        return False
    ptrs = list(map(torch.Tensor.data_ptr, leaves))
    plan.fingerprint[0] = ptrs
    plan.whole_checks = [(i, storages[i].data_ptr(), n) for i, _, n in plan.whole_checks]
    plan.repeats = repeats(ptrs, same_tensor)
    return True


def _inside(pool: HostPool, storages: list[torch.UntypedStorage], nbytes: list[int]) -> bool:
    """Whether any of ``storages`` may lie in ``pool``'s arenas (a C-speed bound
    first; the exact ranges only when it cannot rule it out)."""
    arenas = [(a.base, a.base + a.nbytes) for a in list(pool.arenas)]
    if not arenas or not storages:
        return False
    lo = min(a for a, _ in arenas)
    hi = max(b for _, b in arenas)
    ptrs = list(map(torch.UntypedStorage.data_ptr, storages))
    if min(ptrs) >= hi or max(map(operator.add, ptrs, nbytes)) <= lo:
        return False
    return bool(reads_in_pool(pool, storages))
