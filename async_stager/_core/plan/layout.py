"""Plans: one state dict's layout in one buffer set, and the fingerprint that says
whether a plan still holds.

A Plan remembers the host tensor of each leaf and the copy program per source device
(``DeviceProgram``: direct copies, and ``Run``s of small tensors gathered on the device
first), plus a fingerprint of its leaves (everything a staged tensor carries but its
values: see FINGERPRINT). When the next state dict's leaves have the same fingerprint
the engine reuses the plan without touching the storage cache (the fast path). Plans
are made by ``_plan.make_plan``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from async_stager._core.memory.arena import Block

__all__ = [
    "FINGERPRINT",
    "HOST_MARKS",
    "DeviceProgram",
    "Plan",
    "Run",
    "Unit",
    "fingerprint",
    "host_marks",
    "identity_layout",
    "signature_of",
]


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
    #: ``direct_reps`` is 0, 1, ..., n-1: with n leaves, the sources are the leaves
    #: list itself (a state dict of distinct tensors on one device), no gather.
    direct_in_order: bool = False

    def freeze(self) -> None:
        self.direct_dsts = [u.dst for u in self.direct]
        self.direct_reps = [u.rep for u in self.direct]
        self.direct_whole = any(u.whole for u in self.direct)
        self.direct_in_order = self.direct_reps == list(range(len(self.direct_reps)))


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
    #: Who shares what (see ``identity_layout``): per leaf, the first leaf that is the
    #: same tensor object, the first leaf on the same storage, and its storage's
    #: bytes. With the fingerprint but for data pointers, what a plan needs to be
    #: taken over by new tensors of the same layout (``_reuse.take_over``).
    identity: tuple[list[int], list[int], list[int]] | None = None
    #: Per storage group: the first leaf on it and its block (empty storages too).
    groups: list[tuple[int, Block]] = field(default_factory=list)
    #: ``host_marks(hosts)`` when the plan was made (see ``HOST_MARKS``).
    host_marks: list[list[Any]] = field(default_factory=list)


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


#: What each host tensor of a plan must still be when the plan is reused. The result is
#: made of the plan's host tensor objects, and a caller may have changed one in place
#: after an earlier stage handed it out (``unsqueeze_``, ``t_``, ``as_strided_``,
#: ``resize_``, ``set_``, ``requires_grad_``, ``.data =``, ``__class__ =``): its layout,
#: memory, dtype, requires_grad and class, taken when the plan is made (``host_marks``)
#: and compared before each reuse (``_reuse.hosts_intact``; lazy bits cannot change in
#: place). What a caller may attach (a gradient, hooks) is checked to be absent there.
HOST_MARKS: tuple[Callable[[Sequence[torch.Tensor]], list[Any]], ...] = (
    _each(torch.Tensor.data_ptr),
    _each(operator.attrgetter("dtype")),
    _each(torch.Tensor.size),
    _each(torch.Tensor.stride),
    _each(torch.Tensor.storage_offset),
    _each(operator.attrgetter("requires_grad")),
    _each(type),
)


def host_marks(hosts: Sequence[torch.Tensor]) -> list[list[Any]]:
    """One list per HOST_MARKS entry, per host tensor."""
    return [f(hosts) for f in HOST_MARKS]


def fingerprint(leaves: Sequence[torch.Tensor]) -> list[list[Any]]:
    """One list per FINGERPRINT entry: per leaf, its data pointer, dtype, size, stride,
    storage offset, device index, requires_grad, class, and neg and conj bits."""
    return [f(leaves) for f in FINGERPRINT]


def identity_layout(
    leaves: Sequence[torch.Tensor],
) -> tuple[list[int], list[int], list[int], list[torch.UntypedStorage]]:
    """Per leaf (at C speed, no Python per leaf): the index of the first leaf that is
    the same tensor object, of the first leaf on the same storage, and the storage's
    bytes; and the storages themselves (the caller must not keep them: they are the
    sources)."""
    idx = range(len(leaves))
    storages = list(map(torch.Tensor.untyped_storage, leaves))
    first_tensor: dict[int, int] = {}
    first_storage: dict[int, int] = {}
    same_tensor = list(map(first_tensor.setdefault, map(id, leaves), idx))
    same_storage = list(map(first_storage.setdefault, map(operator.attrgetter("_cdata"), storages), idx))
    nbytes = list(map(torch.UntypedStorage.nbytes, storages))
    return same_tensor, same_storage, nbytes, storages
