"""Plans: the layout of one state dict in a buffer set, and the check that reuses it.

``make_plan`` (the slow path) groups the leaves by source storage, looks every storage
up in the set's storage cache (allocating exact-size blocks for misses), builds the host
tensor of each leaf with the source's sizes, strides and offset, and compiles the copy
program per device (small storages batched into runs where the copier wants it).
``plan_holds`` (the fast path) decides from a per-leaf fingerprint whether the plan of
the last stage still fits the leaves of this one, and (the slow path) whether the leaves
of its second walk still fit the plan made from its first.

Hazard: a source may be memory of this very buffer set (an earlier result staged
again), and blocks go back to the arena (storages that died, a cache entry that no
longer matches) just before new ones are handed out. No destination of a stage may
overlap one of its sources: the copies would write into memory that others still
read (``_keep_apart``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from async_stager._core.copy.device import Copier
from async_stager._core.memory.arena import Block, align
from async_stager._core.memory.buffer_sets import BufferSet
from async_stager._core.options import StagerOptions
from async_stager._core.plan.layout import (
    DeviceProgram,
    Plan,
    Run,
    Unit,
    fingerprint,
    host_marks,
    identity_layout,
)
from async_stager._core.plan.reuse import overlaps, reads_in_pool, repeats
from async_stager._core.plan.views import lazy_bits, with_lazy_bits
from async_stager._core.walk.tree import wrap_like

__all__ = ["make_plan", "sources"]


def make_plan(
    copier_for: Callable[[torch.device], Copier],
    options: StagerOptions,
    bufset: BufferSet[Plan],
    sig: Any,
    leaves: list[torch.Tensor],
    tick: Callable[[], None],
    *,
    prefault: bool,
    preflight: Callable[[list[int]], None] | None = None,
    device_of: Callable[[torch.Tensor], torch.device] | None = None,
) -> tuple[Plan, int, int]:
    """The slow path: a new plan for ``leaves`` (in walk order) in ``bufset``; returns
    it with the number of cache hits and misses (source storages).

    Steps: unique tensors and their source storages (views and aliases share one host
    storage); a host block per storage from the set's storage cache, allocating
    exact-size blocks for misses and keeping every destination apart from this stage's
    sources (``_reserve``); a host tensor per leaf with its source's sizes, strides,
    offset, class and lazy bits, and a copy unit per storage (``_hosts_and_units``);
    the copy program per device (``_programs``). ``prefault``: touch new host memory
    now (``reserve()``, so the first real stage pays no page faults). ``preflight``:
    the host-limit check, run before anything is allocated. ``tick`` is the job's
    cancellation check, called every few hundred storages. ``device_of``: the device
    whose copier copies a source (``Backend.device_of``; None: its own ``device``).
    """
    uniq, leaf_u = _unique(leaves)
    groups = _by_storage(uniq, tick, device_of)
    misses = _reserve(bufset, list(groups.values()), options, prefault=prefault, preflight=preflight)
    tick()
    host_u, units, whole_checks, nbytes = _hosts_and_units(groups, uniq, leaf_u, tick)
    wrapped = [wrap_like(uniq[u], host_u[u]) for u in range(len(uniq))]
    plan = Plan(
        signature=sig,
        hosts=[wrapped[u] for u in leaf_u],
        programs=_programs(copier_for, options, units, uniq, leaves),
        units=units,
        fingerprint=fingerprint(leaves),
        whole_checks=whole_checks,
        nbytes=nbytes,
        storages=len(groups),
    )
    plan.repeats = repeats(plan.fingerprint[0], leaf_u)
    same_tensor, same_storage, st_bytes, _ = identity_layout(leaves)
    plan.identity = (same_tensor, same_storage, st_bytes)
    first_leaf = {u: i for i, u in reversed(list(enumerate(leaf_u)))}
    plan.groups = [(first_leaf[g.members[0]], g.block) for g in groups.values() if g.block is not None]
    plan.host_marks = host_marks(plan.hosts)
    return plan, len(groups) - misses, misses


def _unique(leaves: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """The distinct tensor objects of ``leaves`` (first occurrence order) and, per
    leaf, the index of its tensor among them (a tensor repeated is one host)."""
    uniq: list[torch.Tensor] = []
    leaf_u: list[int] = []
    seen: dict[int, int] = {}
    for t in leaves:
        u = seen.get(id(t))
        if u is None:
            u = seen[id(t)] = len(uniq)
            uniq.append(t)
        leaf_u.append(u)
    return uniq, leaf_u


def _by_storage(
    uniq: list[torch.Tensor],
    tick: Callable[[], None],
    device_of: Callable[[torch.Tensor], torch.device] | None = None,
) -> dict[int, _Group]:
    """The unique tensors grouped by source storage (keyed by StorageImpl address),
    each with the device whose copier copies it (``device_of``)."""
    groups: dict[int, _Group] = {}
    for u, t in enumerate(uniq):
        st = t.untyped_storage()
        g = groups.get(st._cdata)
        if g is None:
            g = groups[st._cdata] = _Group(st, t.device, device_of(t) if device_of is not None else t.device)
        g.members.append(u)
        if not u % 256:
            tick()
    return groups


def _reserve(
    bufset: BufferSet[Plan],
    groups: list[_Group],
    options: StagerOptions,
    *,
    prefault: bool,
    preflight: Callable[[list[int]], None] | None,
) -> int:
    """A host block for every group (``_Group.block``): the cached one while it is
    still the same memory, else a new exact-size block; returns the misses. Plans of
    the set that may write into blocks handed back here are forgotten. ``preflight``,
    if given, is called with every unique storage's size (bytes) before anything is
    allocated, and may raise (``_preflight``)."""
    if bufset.cache.sweep():
        # Blocks went back to the arena and may be handed out again: no other plan
        # of this set may keep writing into them.
        bufset.forget_plans()
    missing: list[_Group] = []
    for g in groups:
        g.block = bufset.cache.lookup(g.storage, g.device)
        if g.block is None:
            missing.append(g)
    if bufset.cache.take_invalidated():
        bufset.forget_plans()
    # Taken after the sweep and the lookups (arenas they emptied are gone, and memory
    # still viewed there is never handed out again), before any allocation (a new
    # arena is fresh memory).
    reads = reads_in_pool(bufset.pool, [g.storage for g in groups])
    if preflight is not None and missing:
        preflight([g.storage.nbytes() for g in groups])
    if missing:
        # Smallest first: small storages land adjacent, so a device can move a run
        # of them with one copy.
        missing.sort(key=lambda g: g.storage.nbytes() > options.small_tensor_bytes)
        blocks = bufset.pool.allocate([g.storage.nbytes() for g in missing], prefault=prefault)
        for g, b in zip(missing, blocks):
            g.block = b
        bufset.cache.insert_many([(g.storage, g.device, b) for g, b in zip(missing, blocks)])
    if reads and _keep_apart(bufset, groups, reads, prefault=prefault):
        bufset.forget_plans()
    return len(missing)


def _hosts_and_units(
    groups: dict[int, _Group], uniq: list[torch.Tensor], leaf_u: list[int], tick: Callable[[], None]
) -> tuple[list[Any], list[Unit], list[tuple[int, int, int]], int]:
    """Per unique tensor its host view (the source's layout on the group's block, with
    its conj/neg bits); per non-empty storage its copy unit (typed when one plain
    contiguous leaf covers it exactly, else the whole storage as bytes); the
    whole-storage checks for the fingerprint; and the host bytes.

    Hazard: a byte-for-byte copy of a storage does not apply a view's lazy conjugate
    and negative bits, so the host view must carry them too (conj first, then neg), or
    the staged values come out silently conjugated or negated."""
    host_u: list[Any] = [None] * len(uniq)
    units: list[Unit] = []
    whole_checks: list[tuple[int, int, int]] = []
    first_leaf = {u: i for i, u in reversed(list(enumerate(leaf_u)))}
    nbytes = 0
    for n, g in enumerate(groups.values()):
        block = g.block
        assert block is not None
        size = block.nbytes
        base_t = block.tensor
        base: torch.UntypedStorage | None = None
        rep_bits = 0
        for u in g.members:
            t = uniq[u]
            bits = lazy_bits(t)
            if u == g.members[0]:
                rep_bits = bits
            dtype = t.dtype
            es = t.element_size()
            if size and not size % es:
                # The block's bytes typed, then the source's layout on them: half the
                # cost of a new tensor set_ on the storage (two small allocations per
                # tensor add up at tens of thousands of tensors).
                typed = base_t if dtype is torch.uint8 else base_t.view(dtype)
                h = typed.as_strided(t.size(), t.stride(), t.storage_offset())
            else:
                # An empty storage (zero-byte block): an empty view may still sit at a
                # nonzero offset, and set_ keeps it; or bytes that are no whole number
                # of elements.
                if base is None:
                    base = base_t.untyped_storage()
                h = torch.empty(0, dtype=dtype).set_(base, t.storage_offset(), t.size(), t.stride())
            host_u[u] = with_lazy_bits(h, bits)
        nbytes += size
        rep_u = g.members[0]
        t = uniq[rep_u]
        whole = not (
            len(g.members) == 1
            and t.storage_offset() == 0
            and t.numel() * t.element_size() == size
            and t.is_contiguous()
            and not rep_bits
            and t.dtype in _TYPED_COPY_DTYPES
        )
        if size:
            rep = first_leaf[rep_u]
            units.append(Unit(rep, block.tensor if whole else host_u[rep_u], size, whole, g.copied_by, block))
            if whole:
                # The members' sizes, strides and offsets are in the fingerprint.
                whole_checks.append((rep, g.storage.data_ptr(), size))
        if not n % 256:
            tick()
    return host_u, units, whole_checks, nbytes


def _programs(
    copier_for: Callable[[torch.device], Copier],
    options: StagerOptions,
    units: list[Unit],
    uniq: list[torch.Tensor],
    leaves: list[torch.Tensor],
) -> list[DeviceProgram]:
    by_dev: dict[torch.device, DeviceProgram] = {}
    for unit in units:
        prog = by_dev.get(unit.device)
        if prog is None:
            prog = by_dev[unit.device] = DeviceProgram(unit.device)
        prog.direct.append(unit)
    budget = options.scratch_bytes
    for prog in by_dev.values():
        copier = copier_for(prog.device)
        if not copier.batch_small:
            continue
        small = [u for u in prog.direct if u.nbytes <= options.small_tensor_bytes]
        small.sort(key=lambda u: (id(u.block.arena), u.block.offset))
        runs: list[list[Unit]] = []
        for u in small:
            cur = runs[-1] if runs else None
            if (
                cur is not None
                and cur[-1].block.arena is u.block.arena
                and cur[-1].block.offset + align(cur[-1].nbytes) == u.block.offset
            ):
                cur.append(u)
            else:
                runs.append([u])
        batched: set[int] = set()
        for run in _split_runs(runs, cap=max(1 << 20, options.scratch_bytes // 8)):
            if len(run) < 2:
                continue
            start = run[0].block.offset
            end = run[-1].block.offset + run[-1].nbytes
            if end - start > budget:
                continue
            budget -= end - start
            prog.runs.append(_make_run(copier, run, start, end, leaves))
            batched.update(id(u) for u in run)
        prog.direct = [u for u in prog.direct if id(u) not in batched]
    for prog in by_dev.values():
        prog.freeze()
        prog.direct_layout = copier_for(prog.device).prepare(prog.direct_dsts)
    return list(by_dev.values())


def _split_runs(runs: list[list[Unit]], *, cap: int) -> list[list[Unit]]:
    """Runs cut into pieces spanning at most ``cap`` bytes each, so a long run of small
    storages still gets batched piecewise when the scratch budget cannot take it whole
    (20k storages of 16 KiB would otherwise become 20k separate copies)."""
    out: list[list[Unit]] = []
    for run in runs:
        piece: list[Unit] = []
        for u in run:
            if piece and u.block.offset + u.nbytes - piece[0].block.offset > cap:
                out.append(piece)
                piece = []
            piece.append(u)
        if piece:
            out.append(piece)
    return out


class _Group:
    __slots__ = ("block", "copied_by", "device", "members", "storage")

    def __init__(self, storage: torch.UntypedStorage, device: torch.device, copied_by: torch.device) -> None:
        self.storage = storage
        #: The storage's own device (the storage cache's key).
        self.device = device
        #: The device whose copier copies it (its program's).
        self.copied_by = copied_by
        self.members: list[int] = []
        self.block: Any = None


def _make_run(copier: Copier, run: list[Unit], start: int, end: int, leaves: list[torch.Tensor]) -> Run:
    arena = run[0].block.arena
    assert arena is not None  # runs hold nonzero-byte blocks only
    span = arena.tensor[start:end]
    scratch = copier.scratch(end - start)
    by_dtype: dict[torch.dtype, tuple[list[torch.Tensor], list[Unit]]] = {}
    for u in run:
        rel = u.block.offset - start
        piece = scratch[rel : rel + u.nbytes]
        if u.whole:
            view = piece
        else:
            t = leaves[u.rep]
            view = piece.view(t.dtype).view(t.size())
        views, members = by_dtype.setdefault(view.dtype, ([], []))
        views.append(view)
        members.append(u)
    return Run(span=span, scratch=scratch, groups=list(by_dtype.values()))


def sources(units: Sequence[Unit], leaves: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if not any(u.whole for u in units):
        if len(units) == 1:
            return [leaves[units[0].rep]]
        return list(operator.itemgetter(*[u.rep for u in units])(leaves))
    out = []
    for u in units:
        t = leaves[u.rep]
        if u.whole:
            # The whole source storage, as bytes (made per stage: holding it in the
            # plan would keep the source memory alive).
            t = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
        out.append(t)
    return out


def _keep_apart(
    bufset: BufferSet[Plan],
    groups: list[_Group],
    reads: list[tuple[int, int]],
    *,
    prefault: bool,
) -> bool:
    """Give every group whose destination block overlaps a source of this stage
    (``reads``) a block that does not; returns whether any block was replaced.

    Such a block is memory this stage reads: an earlier result staged again whose
    cache entry was just swept (its source died) and handed out anew, or the cached
    block of a live source that the earlier result still views. The replaced blocks
    stay allocated until every group has a block that fits, so none is handed out
    again in between; then they go back to the arena.
    """
    clash = [g for g in groups if overlaps(g.block, reads)]
    if not clash:
        return False
    old: list[Block] = []
    while clash:
        old.extend(g.block for g in clash)
        blocks = bufset.pool.allocate([g.storage.nbytes() for g in clash], prefault=prefault)
        for g, b in zip(clash, blocks):
            g.block = b
            bufset.cache.insert(g.storage, g.device, b)
        clash = [g for g in clash if overlaps(g.block, reads)]
    bufset.pool.free(old)
    return True


#: Dtypes copied as typed tensors. CUDA's fused ``_foreach_copy_`` (the small-tensor
#: gather) covers the standard types, half, bfloat16, bool and the float8 formats; for
#: any other dtype (uint16/32/64, complex32, MX/float4 formats, ...) it raises "not
#: implemented", so such storages are copied as raw bytes instead.
_TYPED_COPY_DTYPES = frozenset(
    getattr(torch, name)
    for name in (
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "complex64",
        "complex128",
        "bool",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
    )
    if hasattr(torch, name)
)
