"""Plans: the layout of one state dict in a buffer set, and the check that reuses it.

``make_plan`` (the slow path) groups the leaves by source storage, looks every storage
up in the set's storage cache (allocating exact-size blocks for misses), builds the host
tensor of each leaf with the source's sizes, strides and offset, and compiles the copy
program per device (small storages batched into runs where the copier wants it).
``plan_holds`` (the fast path) decides from a per-leaf fingerprint whether the plan of
the last stage still fits the leaves of this one.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._arena import ALIGN
from ._cache import FINGERPRINT, BufferSet, DeviceProgram, Plan, Run, Unit, fingerprint
from ._device import Copier
from ._options import StagerOptions

__all__ = ["make_plan", "plan_holds", "sources"]


def make_plan(
    copier_for: Callable[[torch.device], Copier],
    options: StagerOptions,
    bufset: BufferSet,
    sig: Any,
    leaves: list[torch.Tensor],
    tick: Callable[[], None],
    *,
    prefault: bool,
) -> tuple[Plan, int, int]:
    uniq: list[torch.Tensor] = []
    leaf_u: list[int] = []
    seen: dict[int, int] = {}
    for t in leaves:
        u = seen.get(id(t))
        if u is None:
            u = seen[id(t)] = len(uniq)
            uniq.append(t)
        leaf_u.append(u)
    # Group by source storage: views and aliases share one host storage.
    groups: dict[int, _Group] = {}
    for u, t in enumerate(uniq):
        st = t.untyped_storage()
        g = groups.get(st._cdata)
        if g is None:
            g = groups[st._cdata] = _Group(st, t.device)
        g.members.append(u)
        if not u % 256:
            tick()
    if bufset.cache.sweep():
        # Blocks went back to the arena and may be handed out again: no other plan
        # of this set may keep writing into them.
        bufset.plans.clear()
    missing: list[_Group] = []
    for g in groups.values():
        g.block = bufset.cache.lookup(g.storage, g.device)
        if g.block is None:
            missing.append(g)
    if bufset.cache.invalidated:
        bufset.cache.invalidated = False
        bufset.plans.clear()
    if missing:
        # Smallest first: small storages land adjacent, so a device can move a run
        # of them with one copy.
        missing.sort(key=lambda g: g.storage.nbytes() > options.small_tensor_bytes)
        blocks = bufset.pool.allocate([g.storage.nbytes() for g in missing], prefault=prefault)
        for g, b in zip(missing, blocks):
            g.block = b
            bufset.cache.insert(g.storage, g.device, b)
    tick()
    host_u: list[Any] = [None] * len(uniq)
    units: list[Unit] = []
    whole_checks: list[tuple[int, int, int]] = []
    member_meta: list[tuple[int, tuple[int, ...], tuple[int, ...], int, int]] = []
    first_leaf = {u: i for i, u in reversed(list(enumerate(leaf_u)))}
    nbytes = 0
    for n, g in enumerate(groups.values()):
        block = g.block
        assert block is not None
        base = block.tensor.untyped_storage()
        for u in g.members:
            t = uniq[u]
            # Also for an empty storage (zero-byte block): an empty view may still sit
            # at a nonzero offset, and set_ keeps it.
            h = torch.empty(0, dtype=t.dtype).set_(base, t.storage_offset(), t.size(), t.stride())
            host_u[u] = _with_math_bits(t, h)
        size = block.nbytes
        nbytes += size
        rep_u = g.members[0]
        t = uniq[rep_u]
        whole = not (
            len(g.members) == 1
            and t.storage_offset() == 0
            and t.numel() * t.element_size() == size
            and t.is_contiguous()
            and not _math_bits(t)
            and t.dtype in _TYPED_COPY_DTYPES
        )
        if size:
            rep = first_leaf[rep_u]
            units.append(
                Unit(
                    rep,
                    block.tensor if whole else host_u[rep_u],
                    size,
                    whole,
                    g.device,
                    block,
                )
            )
            if whole:
                whole_checks.append((rep, g.storage.data_ptr(), size))
                for u in g.members:
                    m = uniq[u]
                    member_meta.append(
                        (
                            first_leaf[u],
                            tuple(m.size()),
                            m.stride(),
                            int(m.storage_offset()),
                            _math_bits(m),
                        )
                    )
        if not n % 256:
            tick()
    wrapped = [_wrap(uniq[u], host_u[u]) for u in range(len(uniq))]
    hosts = [wrapped[u] for u in leaf_u]
    programs = _programs(copier_for, options, units, uniq, leaves)
    plan = Plan(
        signature=sig,
        hosts=hosts,
        programs=programs,
        units=units,
        fingerprint=fingerprint(leaves),
        whole_checks=whole_checks,
        member_meta=member_meta,
        nbytes=nbytes,
        storages=len(groups),
    )
    return plan, len(groups) - len(missing), len(missing)


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
                and cur[-1].block.offset + _align(cur[-1].nbytes) == u.block.offset
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
    __slots__ = ("block", "device", "members", "storage")

    def __init__(self, storage: torch.UntypedStorage, device: torch.device) -> None:
        self.storage = storage
        self.device = device
        self.members: list[int] = []
        self.block: Any = None


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _make_run(copier: Copier, run: list[Unit], start: int, end: int, leaves: list[torch.Tensor]) -> Run:
    arena = run[0].block.arena
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


def plan_holds(plan: Plan, leaves: list[torch.Tensor], tick: Callable[[], None]) -> bool:
    """True when ``leaves`` can be copied with ``plan`` unchanged."""
    n = len(leaves)
    if n != len(plan.hosts):
        return False
    # In chunks, ticking between them: each map over all leaves holds the GIL.
    for lo in range(0, n, _FP_CHUNK):
        chunk = leaves[lo : lo + _FP_CHUNK]
        for f, expected in zip(FINGERPRINT, plan.fingerprint):
            if list(map(f, chunk)) != expected[lo : lo + _FP_CHUNK]:
                return False
        tick()
    for i, ptr, nbytes in plan.whole_checks:
        st = leaves[i].untyped_storage()
        if st.data_ptr() != ptr or st.nbytes() != nbytes:
            return False
    for i, size, stride, offset, mbits in plan.member_meta:
        t = leaves[i]
        if (
            tuple(t.size()) != size
            or t.stride() != stride
            or t.storage_offset() != offset
            or _math_bits(t) != mbits
        ):
            return False
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


def _math_bits(t: torch.Tensor) -> int:
    """A view's lazy conjugate (1) and negative (2) bits. Hazard: a byte-for-byte copy
    of its storage does not apply them, so the host view must carry them too, or the
    staged values come out silently conjugated or negated."""
    return int(t.is_conj()) | (int(t.is_neg()) << 1)


def _with_math_bits(src: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    bits = _math_bits(src)
    if bits & 1:
        host = host.conj()
    if bits & 2:
        host = torch._neg_view(host)
    return host


#: Leaves per fingerprint chunk (about 0.2 ms of GIL-holding work each).
_FP_CHUNK = 512


def _wrap(src: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    """The host tensor as the source's type: Parameter, subclass, requires_grad."""
    cls = type(src)
    if cls is torch.Tensor:
        if src.requires_grad:
            host.requires_grad_(True)
        return host
    if isinstance(src, torch.nn.Parameter):
        return torch.Tensor._make_subclass(cls, host, src.requires_grad)
    out = host.as_subclass(cls)
    if src.requires_grad:
        out.requires_grad_(True)
    return out
