"""Source storage -> host block, validated on every hit; plans; buffer sets and leases.

A BufferSet is one generation of host buffers: its own arenas (HostPool), its storage
cache and its plans. A stage writes into exactly one set; a set that is leased (a
consumer holds its result) or still has copies in flight is never written.

The storage cache is keyed by the source storage's identity (its StorageImpl address,
kept unique by a weak reference that pins the impl, not the data) and re-validated on
each hit by data pointer, size and device. An entry whose storage died is dropped at
the next slow-path stage and its block goes back to the arena (never a stale hit, and
memory does not grow across checkpoints of fresh tensors).

A Plan remembers one state dict's layout (the host tensor of each leaf and the copy
program) plus a fingerprint of its leaves (everything a staged tensor carries but its
values: see FINGERPRINT); when the next state dict's leaves have the same fingerprint
the engine reuses it without touching the cache (the fast path).
"""

from __future__ import annotations

import operator
import sys
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ._arena import Block, HostPool, Pinner
from ._device import Completion

__all__ = ["BufferSet", "CacheEntry", "Plan", "Run", "StorageCache", "Unit"]

#: References held to a StorageImpl (tensors viewing it, Python storage objects).
_use_count = torch._C._storage_Use_Count

#: Plans kept per buffer set (several state dicts staged in turn, e.g. model and optim).
MAX_PLANS = 4


@dataclass(eq=False)
class CacheEntry:
    weak: StorageWeakRef
    ptr: int
    nbytes: int
    device: torch.device
    block: Block


class StorageCache:
    """Maps live source storages to their host blocks in one HostPool."""

    def __init__(self, pool: HostPool) -> None:
        self.pool = pool
        self._entries: dict[int, CacheEntry] = {}
        #: Set when a lookup freed a block; the plan maker then drops the set's plans.
        self.invalidated = False

    def __len__(self) -> int:
        return len(self._entries)

    def take_invalidated(self) -> bool:
        """Whether a lookup freed a block since the last call (the plans writing into
        it are then stale); clears the flag."""
        invalidated, self.invalidated = self.invalidated, False
        return invalidated

    def lookup(self, storage: torch.UntypedStorage, device: torch.device) -> Block | None:
        """The block of ``storage`` if it is cached and still the same memory."""
        e = self._entries.get(storage._cdata)
        if e is None:
            return None
        if (
            e.weak.expired()
            or e.ptr != storage.data_ptr()
            or e.nbytes != storage.nbytes()
            or e.device != device
        ):
            # Same impl, other memory (moved, resized, reallocated): never a stale hit.
            del self._entries[storage._cdata]
            self.pool.free([e.block])
            # The block may be handed out again: plans that write into it are stale.
            self.invalidated = True
            return None
        return e.block

    def insert(self, storage: torch.UntypedStorage, device: torch.device, block: Block) -> None:
        self._entries[storage._cdata] = CacheEntry(
            StorageWeakRef(storage), storage.data_ptr(), storage.nbytes(), device, block
        )

    def sweep(self) -> int:
        """Drop entries whose source storage died; free their blocks. Returns how many."""
        dead = [k for k, e in self._entries.items() if e.weak.expired()]
        if dead:
            blocks = [self._entries.pop(k).block for k in dead]
            self.pool.free(blocks)
        return len(dead)

    def blocks(self) -> list[Block]:
        """Every cached block that has memory."""
        return [e.block for e in self._entries.values() if e.block.nbytes]

    def clear(self) -> None:
        self.pool.free([e.block for e in self._entries.values()])
        self._entries.clear()


@dataclass(eq=False)
class Unit:
    """One source storage's copy: leaf ``rep`` (or its whole storage) -> ``dst``.

    ``whole`` False: the leaf covers its storage exactly and is copied typed, as is.
    ``whole`` True: the storage is copied as bytes (views, aliases, partial coverage).
    """

    rep: int
    dst: torch.Tensor
    nbytes: int
    whole: bool
    device: torch.device
    block: Block


@dataclass(eq=False)
class Run:
    """Small units whose host blocks are adjacent: gathered on the device into
    ``scratch`` (one fused copy per dtype), then moved by one copy into ``span``."""

    span: torch.Tensor
    scratch: torch.Tensor
    # Per dtype: scratch views and the units feeding them.
    groups: list[tuple[list[torch.Tensor], list[Unit]]]


@dataclass(eq=False)
class DeviceProgram:
    """What to copy from one source device, in order."""

    device: torch.device
    direct: list[Unit] = field(default_factory=list)
    runs: list[Run] = field(default_factory=list)
    # Derived from ``direct`` once (by ``freeze``), so a stage does no per-unit Python.
    direct_dsts: list[torch.Tensor] = field(default_factory=list)
    direct_reps: list[int] = field(default_factory=list)
    direct_whole: bool = False
    # The copier's plan for copying into ``direct_dsts`` at once (Copier.prepare), or
    # None: copied in chunks.
    direct_layout: Any = None

    def freeze(self) -> None:
        self.direct_dsts = [u.dst for u in self.direct]
        self.direct_reps = [u.rep for u in self.direct]
        self.direct_whole = any(u.whole for u in self.direct)


@dataclass(eq=False)
class Plan:
    """A state dict's layout in one buffer set, reusable while its fingerprint holds."""

    signature: Any
    hosts: list[Any]
    programs: list[DeviceProgram]
    units: list[Unit]
    # Fingerprint of the leaves: one list per FINGERPRINT attribute.
    fingerprint: list[list[Any]]
    # For whole-storage units: (leaf index, storage ptr, storage nbytes) of the rep
    # (the members' sizes, strides and offsets are in the fingerprint).
    whole_checks: list[tuple[int, int, int]]
    nbytes: int
    storages: int
    #: Leaves that share a data pointer (aliases, the same tensor twice, empty
    #: tensors): their indices and, for each, the first of them that is the same tensor
    #: object; None when every leaf's data pointer is its own. Hazard: the host of a
    #: leaf repeated in the state dict is one object, so the result repeats a tensor
    #: exactly where the plan's leaves did; a fingerprint of per-leaf values cannot see
    #: that, and leaves with a data pointer no other leaf has cannot be repeats.
    repeats: tuple[list[int], list[int]] | None = None


class BufferSet:
    """One generation of host buffers (see module doc). Fields are guarded by the
    engine's condition variable, except ``cache``/``plans``, which only the worker
    thread touches while the set is selected."""

    def __init__(self, index: int, *, shared: bool, pinner: Pinner | None) -> None:
        self.index = index
        self.pool = HostPool(shared=shared, pinner=pinner)
        self.cache = StorageCache(self.pool)
        self.plans: OrderedDict[Any, Plan] = OrderedDict()
        self.leases = 0
        self.busy = False  # selected by a stage that has not finished enqueueing
        self.inflight: list[Completion] = []
        # Baseline of ``held`` (see ``watch``).
        self._watch_objects: list[Any] = []
        self._watch_refs: list[int] = []
        self._watch_storages: list[int] = []
        self._watch_uses: list[int] = []

    def held(self) -> bool:
        """True while a result built from this set may still be reachable: a lease on
        it, a host tensor of one of its plans referenced from outside the stager (the
        staged dict, a tensor taken out of it), or any other reference into one of its
        blocks (a view, ``untyped_storage()``, a numpy array).

        Hazard: exact only against a baseline taken by ``watch`` while no result of
        this set existed; every change to the set's plans or cache must be followed by
        ``watch`` before the stage builds its result. Cost: two C-speed maps (no Python
        per tensor), paid only when a stage considers this set.
        """
        if self.leases:
            return True
        if self.inflight:
            # Copies that have landed are no longer in flight; a copier may hold the
            # destination tensors until it sees that (the fake one does).
            self.inflight = [c for c in self.inflight if not c.query()]
        refs = list(map(sys.getrefcount, self._watch_objects))
        if any(map(operator.gt, refs, self._watch_refs)):
            return True
        uses = list(map(_use_count, self._watch_storages))
        return any(map(operator.gt, uses, self._watch_uses))

    def watch(self) -> None:
        """Take the baseline ``held`` compares with: the references the stager itself
        holds to this set's host tensors and block storages, as Python objects (the
        staged dict, a tensor or ``untyped_storage()`` held) and as C++ references
        (views, numpy arrays over a view)."""
        blocks = self.cache.blocks()
        self._watch_objects = [h for p in self.plans.values() for h in p.hosts]
        self._watch_objects += [b.storage for b in blocks]
        # StorageImpl addresses: stable while the blocks (and their storages) live.
        self._watch_storages = [b.storage._cdata for b in blocks]
        self._watch_refs = list(map(sys.getrefcount, self._watch_objects))
        self._watch_uses = list(map(_use_count, self._watch_storages))

    def plan_for(self, signature: Any) -> Plan | None:
        plan = self.plans.get(signature)
        if plan is not None:
            self.plans.move_to_end(signature)
        return plan

    def forget_plans(self) -> None:
        """Drop every plan of this set (their blocks may be handed out again)."""
        self.plans.clear()

    def forget_plan(self, signature: Any) -> None:
        """Drop the plan for ``signature``, if any (it no longer holds)."""
        self.plans.pop(signature, None)

    def remember(self, plan: Plan) -> None:
        self.plans[plan.signature] = plan
        self.plans.move_to_end(plan.signature)
        while len(self.plans) > MAX_PLANS:
            self.plans.popitem(last=False)

    def wait_inflight(self) -> None:
        """Block (worker thread) until copies still in flight into this set finish."""
        for c in list(self.inflight):
            c.synchronize()
        self.inflight.clear()

    def close(self) -> None:
        self.wait_inflight()
        self._watch_objects = []
        self.plans.clear()
        self.cache.clear()
        self.pool.close()


def signature_of(sd: Any) -> Any:
    """A cheap key to pick the plan to try first: type, size, first and last key."""
    cls = type(sd)
    if isinstance(sd, dict):
        n = len(sd)
        if not n:
            return (cls, 0)
        it = iter(sd)
        first = next(it)
        last = next(reversed(sd)) if n > 1 else first
        return (cls, n, _hashable(first), _hashable(last))
    if isinstance(sd, (list, tuple)):
        return (cls, len(sd))
    return (cls,)


def _hashable(k: Any) -> Any:
    """The key as part of a signature. Hazard: the signature is kept with the plan, so
    a tensor key must not be kept itself, or the plan would keep that source and its
    memory alive: its type and id stand in, as for unhashable keys (the fingerprint, not
    the signature, decides whether the plan is reused)."""
    if isinstance(k, torch.Tensor):
        return (type(k), id(k))
    if type(k) is tuple:
        return tuple(map(_hashable, k))
    try:
        hash(k)
    except TypeError:
        return (type(k), id(k))
    return k


def _each(f: Callable[[Any], Any]) -> Callable[[Sequence[torch.Tensor]], list[Any]]:
    def each(leaves: Sequence[torch.Tensor]) -> list[Any]:
        return list(map(f, leaves))

    return each


#: What a leaf's fingerprint is made of: everything a staged tensor carries from its
#: source but its values and attributes, so a plan whose fingerprint matches builds
#: what a new plan would. Each entry maps a list of leaves to one list at C speed
#: (``map`` over descriptors, no Python per leaf). Hazard: the result is made of the plan's host tensors as they were made,
#: so whatever is missing here is stale on the fast path: size, stride and offset
#: (shapes and layouts, also of empty tensors, which have no copy to fail), the class
#: (Parameter or Tensor, subclasses), requires_grad, and the lazy conj/neg bits.
#: Attributes are not here: the walk gives each host exactly its source's.
#: The data pointer is first: the only entry about *where* the data is (which leaves
#: alias) rather than what the result looks like (see ``_plan.plan_holds``). The conj
#: bit is last: only a complex tensor can have it (torch asserts so), so it is only
#: compared where the dtypes, the second entry, have a complex one.
FINGERPRINT: tuple[Callable[[Sequence[torch.Tensor]], list[Any]], ...] = (
    _each(torch.Tensor.data_ptr),
    _each(operator.attrgetter("dtype")),
    _each(torch.Tensor.size),
    _each(torch.Tensor.stride),
    _each(torch.Tensor.storage_offset),
    _each(torch.Tensor.get_device),
    _each(operator.attrgetter("requires_grad")),
    _each(type),
    _each(torch.Tensor.is_neg),
    _each(torch.Tensor.is_conj),
)


def fingerprint(leaves: Sequence[torch.Tensor]) -> list[list[Any]]:
    """One list per FINGERPRINT entry: per leaf, its data pointer, dtype, size, stride,
    storage offset, device index, requires_grad, class, and neg and conj bits."""
    return [f(leaves) for f in FINGERPRINT]
