"""What a budgeted save can see at its call, without pickling anything: DCP's write
items of a state dict (``_dcp_values``: DCP's flattening rule), the biggest tensor item
(``largest_tensor``), and a look inside the values DCP pickles whole (``survey``).

What the budget bounds: the ring, ``N`` bytes of host memory at most, through which
every byte DCP writes passes in pieces: tensor items (a tensor, a DTensor's local
shard: each must fit the ring whole), and the serialized non-tensor values (DCP's
bytes items: ints, lists, tuples, dataclasses, user objects), CPU tensors inside them
included, which are cut into pieces of any size. What ``torch.save`` builds whole for
one value at a time (its pickle, without the CPU tensors' data; a host copy of a
device tensor's storage inside it) is not in pieces, so each must be at most ``N``:
BudgetTooSmallError otherwise, naming the value (or the device tensor inside it) and
the budget it needs. The call checks what it can see without pickling (``survey``:
tensor items, bytes-likes, strings, numpy arrays, numbers, device tensors, inside
plain containers and objects); the rest is checked as each value is serialized
(``pickling``), and the save then fails with that error before any metadata is
written.
"""

from __future__ import annotations

import copyreg
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from async_stager._core.memory.ring import padded
from async_stager._core.walk.objects import stateful_object_error
from async_stager.errors import Attr, BudgetTooSmallError, Nth

__all__ = ["Seen", "largest_tensor", "survey"]


@dataclass
class Seen:
    """What ``survey`` saw of the values DCP pickles (its bytes items), for the pipeline.

    ``object_bytes``: their estimated ring bytes, all values (only to size the ring: a
    short estimate means smaller pieces, not a failure). ``paths``: per flattened DCP
    name (``fqn``), the value's path from the root, for errors found when serialized.
    ``generators``: the ``torch.Generator``s inside them, by id, each with its pickle
    reduction taken at the call (``pickling``). ``host_tensors``: a value may hold a
    CPU tensor, so their serialization first waits on the host for the captures
    (False: none holds one; nothing waits)."""

    object_bytes: int | None = None
    paths: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    generators: dict[int, tuple[Any, Any]] = field(default_factory=dict)
    host_tensors: bool = True


#: Nodes the call's look inside non-tensor values may visit, per save (the event loop
#: waits for it): what it does not reach is checked when the value is serialized.
_SURVEY_NODES = 20_000
#: About what ``torch.save`` writes for a value besides its data (zip records).
_ITEM_OVERHEAD = 1536


def _dcp_terminal(value: Any) -> bool:
    """DCP's ``traverse_state_dict`` rule: a mapping is walked into; a list only when
    it holds a tensor or a container that is walked into; anything else (a tuple too)
    is one value, written as a tensor item or pickled as one bytes item."""
    if isinstance(value, Mapping):
        return False
    if not isinstance(value, list):
        return True
    for entry in value:
        if isinstance(entry, (Mapping, list)) and not _dcp_terminal(entry):
            return False
        if isinstance(entry, torch.Tensor):
            return False
    return True


def _dcp_values(state_dict: Any) -> Iterator[tuple[tuple[Any, ...], str, Any]]:
    """``(path, fqn, value)`` for each value DCP's default planner (flattening) makes
    write items of: ``path`` with the state dict's own keys, ``fqn`` DCP's flattened
    name. A top-level Stateful is left out: DCP calls its ``state_dict()`` later."""
    from torch.distributed.checkpoint.stateful import Stateful

    def walk(
        path: tuple[Any, ...], names: tuple[Any, ...], value: Any
    ) -> Iterator[tuple[tuple[Any, ...], str, Any]]:
        if isinstance(value, Mapping):
            for k, v in value.items():
                yield from walk((*path, k), (*names, str(k)), v)
        elif _dcp_terminal(value):
            yield path, ".".join(map(str, names)), value
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                yield from walk((*path, i), (*names, i), v)

    if not isinstance(state_dict, Mapping):
        return
    for key, value in state_dict.items():
        if isinstance(value, Stateful) and not isinstance(value, torch.Tensor):
            continue
        yield from walk((key,), (str(key),), value)


def _local_nbytes(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def largest_tensor(state_dict: Any) -> tuple[tuple[Any, ...], int]:
    """The path and ring bytes (padded) of the biggest tensor DCP writes as a tensor
    item (a DTensor counts its local shard: what this rank writes). Tensors inside
    non-tensor values are not tensor items: they are streamed in pieces."""
    best: tuple[tuple[Any, ...], int] = ((), 0)
    for path, _, value in _dcp_values(state_dict):
        if isinstance(value, torch.Tensor):
            n = padded(_local_nbytes(value))
            if n > best[1]:
                best = (path, n)
    return best


_PLAIN_PICKLING = frozenset({"builtins", "collections"})


def _plainly_pickled(tp: type) -> bool:
    """Whether pickle saves an instance of ``tp`` by its contents (``__dict__``,
    ``__slots__``, items): its reduce and getstate are those of a builtin or of
    ``collections``, not the class's own (which may drop or add anything), and no
    ``copyreg`` reducer is registered for it."""
    if tp in copyreg.dispatch_table:
        return False
    for name in ("__reduce_ex__", "__reduce__", "__getstate__"):
        owner = next((c for c in tp.__mro__ if name in c.__dict__), object)
        if owner.__module__ not in _PLAIN_PICKLING:
            return False
    return True


class _Survey:
    """What ``dcp.save`` can see at the call of the values DCP pickles (its bytes
    items), without pickling them: a lower bound of each one's pickle (bytes-likes,
    strings, numpy arrays, numbers, walked into plain containers and objects), the
    device tensors inside them (which ``torch.save`` moves to host memory whole) and
    the CPU tensors' storage bytes (streamed in pieces; they only size the ring).
    At most ``_SURVEY_NODES`` nodes in all: the rest is checked when serialized."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.nodes = _SURVEY_NODES
        self.ring_bytes = 0  # estimated bytes streamed through the ring, all values
        self.refusal: BudgetTooSmallError | None = None
        #: Generators met, by id: (the generator, its pickle reduction now).
        self.generators: dict[int, tuple[Any, Any]] = {}
        #: A value may hold a CPU tensor (one was seen, or the look stopped short):
        #: serializing must first wait on the host for the captures.
        self.host_tensors = False

    def value(self, path: tuple[Any, ...], value: Any) -> None:
        seen: set[int] = set()
        storages: set[int] = set()
        pickled = 0
        stack: list[tuple[tuple[Any, ...], Any]] = [(path, value)]
        while stack and self.nodes > 0:
            where, v = stack.pop()
            self.nodes -= 1
            if isinstance(v, torch.Tensor):
                try:
                    storage = v.untyped_storage()
                except Exception:  # noqa: BLE001 - a wrapper subclass without storage
                    continue
                key = storage.data_ptr() or id(storage)
                if key in storages or v.device.type == "meta":
                    continue
                self.host_tensors = self.host_tensors or v.device.type == "cpu"
                storages.add(key)
                n = storage.nbytes()
                if v.device.type != "cpu" and n > self.budget and self.refusal is None:
                    self.refusal = BudgetTooSmallError(
                        f"this {v.device.type} tensor sits inside a value DCP pickles whole, and "
                        f"torch.save moves its storage of {n} bytes to host memory in one piece, "
                        f"more than host_budget_bytes={self.budget}; make it a tensor of the state "
                        "dict (a dict or list entry: DCP writes those in pieces of the budget), "
                        f"or pass host_budget_bytes >= {n}",
                        path=where,
                        needed_bytes=n,
                    )
                self.ring_bytes += n
                continue
            refused = stateful_object_error(v)
            if refused is not None:
                # As a stage refuses it: no loader takes a pickled module or optimizer.
                refused.path = where
                raise refused
            if isinstance(v, torch.Generator):
                # Its state as of the call: training advances it right after (a
                # dropout), and torch.save would read it when serialized.
                if id(v) not in self.generators:
                    self.generators[id(v)] = (v, v.__reduce__())
                continue
            if isinstance(v, float):
                pickled += 9
                continue
            if isinstance(v, (bool, int)) or v is None:
                pickled += 1
                continue
            if id(v) in seen:  # pickle's memo: written once
                continue
            seen.add(id(v))
            if isinstance(v, (bytes, bytearray, str)):
                pickled += len(v)
            elif isinstance(v, np.ndarray):
                pickled += int(v.nbytes) if v.dtype != object else 0
            elif not _plainly_pickled(type(v)):
                continue
            elif isinstance(v, Mapping):
                for k, x in v.items():
                    if isinstance(k, (str, bytes)) and id(k) not in seen:
                        seen.add(id(k))
                        pickled += len(k)
                    stack.append(((*where, k), x))
            elif isinstance(v, (list, tuple)):
                stack.extend(((*where, i), x) for i, x in enumerate(v))
            elif isinstance(v, (set, frozenset)):
                stack.extend(((*where, Nth(i)), x) for i, x in enumerate(v))
            else:
                self._attributes(where, v, stack)
        if stack:
            self.host_tensors = True  # not looked at: may hold one
        self.ring_bytes += pickled + _ITEM_OVERHEAD
        if pickled > self.budget and self.refusal is None:
            self.refusal = BudgetTooSmallError(
                f"this value is not a tensor: DCP pickles it, and its pickle (at least {pickled} "
                f"bytes) is held in host memory in one piece, more than host_budget_bytes="
                f"{self.budget}; store its data as a tensor (torch.from_numpy, torch.frombuffer: "
                f"DCP writes tensors in pieces of the budget), or pass host_budget_bytes >= {pickled}",
                path=path,
                needed_bytes=pickled,
            )

    @staticmethod
    def _attributes(where: tuple[Any, ...], v: Any, stack: list[tuple[tuple[Any, ...], Any]]) -> None:
        # object.__getattribute__: never a class's __getattr__ (no user code runs here).
        try:
            attrs = object.__getattribute__(v, "__dict__")
        except AttributeError:
            attrs = None
        if isinstance(attrs, dict):
            stack.extend(((*where, Attr(k)), x) for k, x in attrs.items() if isinstance(k, str))
        for cls in type(v).__mro__:
            slots = cls.__dict__.get("__slots__", ())
            for name in (slots,) if isinstance(slots, str) else slots:
                if name in ("__dict__", "__weakref__"):
                    continue
                try:
                    stack.append(((*where, Attr(name)), object.__getattribute__(v, name)))
                except AttributeError:
                    continue


def survey(state_dict: Any, budget: int) -> Seen:
    """Check ``state_dict`` against ``budget`` at the call, before anything is staged:
    BudgetTooSmallError naming the first tensor item bigger than the budget, else the
    first non-tensor value (or device tensor inside one) that ``torch.save`` would hold
    whole beyond it. Returns what it saw of the non-tensor values (``Seen``)."""
    path, need = largest_tensor(state_dict)
    if need > budget:
        raise BudgetTooSmallError(
            f"this tensor takes {need} bytes of host memory, more than host_budget_bytes={budget}; "
            f"pass host_budget_bytes >= {need}",
            path=path,
            needed_bytes=need,
        )
    look = _Survey(budget)
    paths: dict[str, tuple[Any, ...]] = {}
    for where, fqn, value in _dcp_values(state_dict):
        if isinstance(value, torch.Tensor) or hasattr(value, "__create_write_items__"):
            continue
        paths[fqn] = where
        look.value(where, value)
    if look.refusal is not None:
        raise look.refusal
    if look.nodes <= 0:
        look.host_tensors = True  # values not looked at may hold one
    return Seen(look.ring_bytes, paths, look.generators, look.host_tensors)
