"""Walk and rebuild of nested state dicts.

One pass over the structure (dict, list, tuple, namedtuple, OrderedDict, defaultdict,
set, dataclasses and any object through the copy/pickle protocol, with shared and
self references) copies every container and collects the tensor leaves in order.
Each leaf is replaced by ``hosts[i]``, the host tensor prepared for the i-th leaf, so
the walk *is* the rebuild: the engine runs it with last time's host tensors, and keeps
the result when the leaves turn out unchanged (the fast path), or runs it twice,
collect-then-build, when they did not.

Hazards:
- The walk runs in a worker thread holding the GIL; ``tick`` is called every few
  hundred leaves so the engine can hand the GIL to the event loop.
- Errors carry the path from the root: each container frame prepends its key on the
  way up (try/except costs nothing until something raises). A step is always a way to
  reach the object from its parent: a key, an attribute, or, where neither exists (a
  set member, a dict key itself, the arguments an object reduces to), a step that
  says what it is (``Nth``, ``REDUCE``).
- Objects made during the walk (reduce results) are kept alive until it ends, so
  ``id()`` keys in the memo stay unique.
"""

from __future__ import annotations

import collections
import operator
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from async_stager._core.walk.objects import (
    ATOMIC,
    REDUCE,
    UNWALKED,
    GeneratorStates,
    Interrupt,
    ObjectWalk,
    key_step,
)
from async_stager.errors import Attr, NestingError, Nth, StagingError, UnsupportedTensorError

__all__ = ["REDUCE", "Interrupt", "Walk", "check_tensor", "path_of_leaf", "tensorless_copy", "wrap_like"]

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter

#: Leaves between calls of ``tick``.
_TICK_EVERY = 256
#: Dicts of at least this many items try the bulk path (``Walk._bulk_items``): below
#: it, the type checks cost about what the per-item loop does.
_BULK_MIN = 64
#: Items per C-level step of the bulk path (a tick between steps).
_BULK_CHUNK = 2048
#: The exact types the bulk path takes as values.
_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})


_strided = torch.strided


def check_tensor(t: torch.Tensor) -> None:
    """Raise UnsupportedTensorError (path ()) if ``t`` cannot be staged faithfully.

    Runs once per leaf on every slow-path stage (tens of thousands of times for a state
    of many small tensors): the common case reads as few attributes as it can."""
    if t.layout is not _strided or t.is_nested or t.is_quantized or t.is_meta:
        if t.is_nested:
            raise UnsupportedTensorError("nested tensors are not supported")
        if t.layout is not _strided:
            raise UnsupportedTensorError(f"{t.layout} tensors are not supported (only strided)")
        if t.is_quantized:
            raise UnsupportedTensorError("quantized tensors are not supported")
        raise UnsupportedTensorError("meta tensors have no data to stage")
    n = t.numel()
    if n:
        nbytes = t.untyped_storage().nbytes()
        if t.is_contiguous():
            extent = t.storage_offset() + n  # the common case, without the sum
        else:
            extent = t.storage_offset() + 1 + sum((s - 1) * abs(d) for s, d in zip(t.shape, t.stride()))
        if extent * t.element_size() > nbytes:
            if t.untyped_storage().data_ptr() == 0:
                raise UnsupportedTensorError(
                    f"storage was freed (data_ptr 0) but the tensor has {n} elements"
                )
            raise UnsupportedTensorError(
                f"storage holds {nbytes} bytes but the tensor needs "
                f"{extent * t.element_size()} (was it resized?)"
            )


class Walk(ObjectWalk):
    """A copy of one nested structure, with tensor leaf i replaced by ``hosts[i]``.

    ``leaves`` receives every tensor leaf in order (one entry per occurrence).
    With ``validate`` each new leaf is checked (``check_tensor``) and accelerator devices
    must agree; errors name their path. Leaves past the end of ``hosts`` stay the
    source tensors (the result is then only good for its ``leaves``; hazard: it must
    not be None, since objects rebuilt around it, e.g. ``torch.Generator``, check it).
    ``generators``: states taken at the call (``generator_states``), which the
    generators they name are rebuilt from.
    """

    __slots__ = (
        "accel",
        "generators",
        "hosts",
        "keep",
        "leaves",
        "memo",
        "nhosts",
        "stop_at",
        "tick",
        "validate",
    )

    def __init__(
        self,
        hosts: Sequence[torch.Tensor],
        *,
        validate: bool,
        tick: Callable[[], None],
        generators: GeneratorStates | None = None,
    ) -> None:
        self.generators = generators if generators is not None else {}
        self.leaves: list[torch.Tensor] = []
        self.hosts = hosts
        self.nhosts = len(hosts)
        self.memo: dict[int, Any] = {}
        self.keep: list[Any] = []
        self.validate = validate
        self.tick = tick
        self.accel: torch.device | None = None
        self.stop_at = -1

    def rebuild(self, obj: Any) -> Any:
        """The copy of ``obj`` with its leaves replaced (see the class doc); ``leaves``
        filled in walk order. The entry point: resets the memo, types a structure
        too deep to walk as NestingError."""
        if self.nhosts:
            # Hazard: hosts are reused from stage to stage (the fast path), so
            # attributes the caller set on an earlier result would stay: gone.
            _clear_attrs(self.hosts)
        try:
            return self.visit(obj)
        except RecursionError as e:
            # The walk recurses once per nesting level (a few frames each). Hazard:
            # raising the interpreter's limit is process-wide and risks overflowing
            # the C stack, so a structure this deep is refused, typed, not crashed on.
            raise NestingError(
                "the structure is nested too deeply to walk "
                f"(deeper than sys.getrecursionlimit()={sys.getrecursionlimit()} allows)",
                path=None,
            ) from e
        finally:
            self.keep.clear()
            self.memo.clear()

    # -- dispatch ---------------------------------------------------------------------

    def visit(self, obj: Any) -> Any:
        """The walked copy of one object (dispatched on its exact type)."""
        cls = type(obj)
        if cls in ATOMIC:
            return obj
        fn = _DISPATCH.get(cls)
        if fn is not None:
            return fn(self, obj)
        return self._other(obj)

    def _leaf(self, t: torch.Tensor) -> Any:
        leaves = self.leaves
        i = len(leaves)
        leaves.append(t)
        if not i % _TICK_EVERY:
            self.tick()
        if self.validate:
            self._check(t)
        host = self.hosts[i] if i < self.nhosts else t
        if not t.__dict__:
            return host
        # Python attributes on a tensor are state too. They go onto a new alias of the
        # host made for this walk. Hazard: the plan's host is reused from stage to
        # stage, so attributes put on it would stay (also after its source lost them),
        # and what they reference (other staged tensors) would stay referenced after
        # the result is dropped. A tensor seen again is the same alias, its
        # attributes walked once (in every mode, so leaf indices agree).
        memo = self.memo
        out = memo.get(id(t))
        if out is None:
            out = memo[id(t)] = t if host is t else _alias(host)
            attrs = self._state_dict(t.__dict__)
            if out is not t:
                out.__dict__.update(attrs)
        return out

    def _check(self, t: torch.Tensor) -> None:
        if self.stop_at >= 0:
            if len(self.leaves) - 1 == self.stop_at:
                raise _LeafFound("found", path=())
            return
        if type(t) is _Tensor or type(t) is _Parameter:
            check_tensor(t)
            if t.is_cpu:
                return  # nothing to agree on (reading t.device makes an object)
            dev = t.device
        else:
            try:
                # A subclass: inspect its data, not what a __torch_function__ override
                # says about it (one that raises must give a typed error, with path).
                with torch._C.DisableTorchFunctionSubclass():
                    check_tensor(t)
                    dev = t.device
            except StagingError:
                raise
            except Exception as e:
                raise UnsupportedTensorError(
                    f"inspecting this {type(t).__name__} raised {e!r}", path=()
                ) from e
        if dev.type != "cpu":
            if self.accel is None:
                self.accel = dev
            elif dev != self.accel:
                raise UnsupportedTensorError(
                    f"tensor on {dev}, but this state dict also has tensors on {self.accel}: "
                    "stage one accelerator device per state dict"
                )

    # -- containers -------------------------------------------------------------------

    def _dict(self, d: dict[Any, Any]) -> Any:
        memo = self.memo
        out = memo.get(id(d))
        if out is not None:
            return out
        out = {}
        memo[id(d)] = out
        return self._dict_items(d, out)

    def _dict_items(self, d: dict[Any, Any], out: dict[Any, Any]) -> Any:
        if len(d) >= _BULK_MIN and not self.validate and self._bulk_items(d, out):
            return out
        leaves = self.leaves
        hosts = self.hosts
        nh = self.nhosts
        validate = self.validate
        k = key = None
        try:
            for k, v in d.items():
                # Keys are state too (a tensor as a key): walked first, in every
                # branch, so their leaves come before the value's in every mode.
                if type(k) in ATOMIC:
                    key = k
                else:
                    key = UNWALKED
                    key = self.visit(k)
                c = type(v)
                if (c is _Tensor or c is _Parameter) and not v.__dict__:
                    # The hot path, inlined: a plain tensor leaf. Every occurrence is a
                    # leaf of its own (no memo), in every mode, so leaf indices agree
                    # between the fast and the slow walk.
                    i = len(leaves)
                    leaves.append(v)
                    if not i % _TICK_EVERY:
                        self.tick()
                    if validate:
                        self._check(v)
                    out[key] = hosts[i] if i < nh else v
                elif c in ATOMIC:
                    out[key] = v
                else:
                    out[key] = self.visit(v)
        except StagingError as e:
            e.path = (key_step(d, k) if key is UNWALKED else k, *(e.path or ()))
            raise
        except RuntimeError as e:
            _raise_if_mutated(e)
            raise
        return out

    def _bulk_items(self, d: dict[Any, Any], out: dict[Any, Any]) -> bool:
        """The common case at C speed: a dict whose keys are all atomic and whose values
        are all plain tensors (Tensor or Parameter, no attributes), such as a module's
        state dict. Fills ``out`` (new and empty: nothing refers to it yet but the memo)
        and ``leaves`` exactly as the per-item loop would (leaf i is the i-th value;
        each occurrence its own leaf) and returns True; False (``out`` and ``leaves`` as
        they were) when the dict is not of that kind: the per-item loop then walks it.

        Not used when validating (the slow path checks each leaf and names its path).
        Hazard: each C-level step holds the GIL for its whole length (the interpreter
        switches threads only between bytecodes): every map runs over one chunk of
        ``_BULK_CHUNK`` items, with a tick between chunks, so the event loop's thread
        waits at most about one chunk's time for the GIL."""
        # One C call copies the dict (no Python code runs meanwhile, so no other thread
        # does): keys and values are read from that copy, pairwise consistent even if
        # the caller breaks the rule and mutates the state dict during the stage.
        snap = dict(d)
        keys = list(snap)
        vals = list(snap.values())
        del snap
        n = len(vals)
        leaves = self.leaves
        base = len(leaves)
        hosts = self.hosts
        nh = self.nhosts
        if base < nh < base + n:
            return False  # hosts end inside this dict (a result only good for leaves)
        for lo in range(0, n, _BULK_CHUNK):
            hi = min(n, lo + _BULK_CHUNK)
            ks = keys[lo:hi]
            part = vals[lo:hi]
            if (
                not ATOMIC.issuperset(map(type, ks))
                or not _PLAIN.issuperset(map(type, part))
                or any(map(_ATTRS, part))
            ):
                del leaves[base:]
                out.clear()
                return False
            # The per-item loop ticks at every leaf index divisible by _TICK_EVERY;
            # once per chunk is as often in time (a chunk is C speed).
            self.tick()
            i = base + lo
            leaves.extend(part)
            out.update(zip(ks, hosts[i : i + hi - lo] if i < nh else part))
        return True

    def _ordered_dict(self, d: collections.OrderedDict[Any, Any]) -> Any:
        memo = self.memo
        if id(d) in memo:
            return memo[id(d)]
        out: collections.OrderedDict[Any, Any] = collections.OrderedDict()
        memo[id(d)] = out
        return self._dict_items(d, out)

    def _defaultdict(self, d: collections.defaultdict[Any, Any]) -> Any:
        memo = self.memo
        if id(d) in memo:
            return memo[id(d)]
        factory = d.default_factory
        if type(factory) not in ATOMIC:
            # A partial, a bound method of an object, a class instance: state too.
            factory = self._walk_at(factory, Attr("default_factory"))
        out: collections.defaultdict[Any, Any] = collections.defaultdict(factory)
        memo[id(d)] = out
        return self._dict_items(d, out)

    def _list(self, lst: list[Any]) -> Any:
        memo = self.memo
        out = memo.get(id(lst))
        if out is not None:
            return out
        out = []
        memo[id(lst)] = out
        self._items_into(lst, out.append)
        return out

    def _items_into(self, seq: Any, put: Callable[[Any], Any], member: str | None = None) -> None:
        """Walk the items of ``seq`` into ``put``; errors name the item by its index,
        or, with ``member``, as the index-th such member (an unordered container)."""
        leaves = self.leaves
        hosts = self.hosts
        nh = self.nhosts
        validate = self.validate
        j = 0
        try:
            for j, v in enumerate(seq):  # noqa: B007 - j names the path on errors
                c = type(v)
                if (c is _Tensor or c is _Parameter) and not v.__dict__:
                    i = len(leaves)
                    leaves.append(v)
                    if not i % _TICK_EVERY:
                        self.tick()
                    if validate:
                        self._check(v)
                    put(hosts[i] if i < nh else v)
                elif c in ATOMIC:
                    put(v)
                else:
                    put(self.visit(v))
        except StagingError as e:
            e.path = (j if member is None else Nth(j), *(e.path or ()))
            raise
        except RuntimeError as e:
            _raise_if_mutated(e)
            raise

    def _tuple(self, t: tuple[Any, ...]) -> Any:
        items: list[Any] = []
        self._items_into(t, items.append)
        # A cycle through a mutable child may have made this tuple already.
        done = self.memo.get(id(t))
        if done is not None:
            return done
        out = type(t)(items) if type(t) is tuple else type(t)._make(items)  # type: ignore[attr-defined]
        self.memo[id(t)] = out
        return out

    def _set(self, s: set[Any] | frozenset[Any]) -> Any:
        if id(s) in self.memo:
            return self.memo[id(s)]
        items: list[Any] = []
        self._items_into(s, items.append, member="set member")
        out = type(s)(items)
        self.memo[id(s)] = out
        return out


_DISPATCH: dict[type, Callable[[Walk, Any], Any]] = {
    dict: Walk._dict,
    list: Walk._list,
    tuple: Walk._tuple,
    set: Walk._set,
    frozenset: Walk._set,
    collections.OrderedDict: Walk._ordered_dict,
    collections.defaultdict: Walk._defaultdict,
    _Tensor: Walk._tensor,
    _Parameter: Walk._tensor,
    torch.Generator: Walk._generator,
}


def wrap_like(src: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    """``host`` as ``src``'s class (Parameter, subclass) with its requires_grad."""
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


def _alias(host: torch.Tensor) -> torch.Tensor:
    """A new tensor on ``host``'s memory with its layout, conj/neg bits, class and
    requires_grad, and no attributes (overrides of ``__torch_function__`` off)."""
    with torch._C.DisableTorchFunctionSubclass():
        return wrap_like(host, host.detach())


_ATTRS = operator.attrgetter("__dict__")


def _clear_attrs(hosts: Sequence[torch.Tensor]) -> None:
    """Every host tensor without attributes (at C speed but for hosts that have some).

    In chunks: a ``filter`` over hosts that have none runs in one C call, which holds
    the GIL throughout (tens of thousands of hosts: milliseconds)."""
    for lo in range(0, len(hosts), _BULK_CHUNK):
        for attrs in filter(None, map(_ATTRS, hosts[lo : lo + _BULK_CHUNK])):
            attrs.clear()


def _raise_if_mutated(e: RuntimeError) -> None:
    """A container changed size while it was iterated (another thread mutating the
    state dict during a stage): a typed error naming this container, never a torn copy."""
    if not isinstance(e, RecursionError) and "during iteration" in str(e):
        raise StagingError(
            f"this container changed while it was being staged ({e}); "
            "do not mutate a state dict until its stage() returns",
            path=(),
        ) from e


class _LeafFound(StagingError):
    """Internal: raised at the wanted leaf by ``path_of_leaf``; carries its path."""


def path_of_leaf(sd: Any, index: int) -> tuple[Any, ...] | None:
    """The path of the ``index``-th tensor leaf of ``sd`` in walk order (None if the
    structure has fewer leaves now). Used to name the place of errors found after the
    walk, such as a failed copy."""
    walk = Walk((), validate=True, tick=_no_tick)
    walk.stop_at = index
    try:
        walk.rebuild(sd)
    except _LeafFound as e:
        return e.path or ()
    except StagingError:
        return None
    return None


def tensorless_copy(
    sd: Any, *, tick: Callable[[], None], generators: GeneratorStates | None
) -> tuple[bool, Any]:
    """``(True, copy)`` when ``sd`` holds no tensor: ``copy`` is its staged copy (the
    walk copies every container and object, as a stage does); ``(False, None)`` as soon
    as the walk meets a tensor leaf (the first one: the rest is not walked). Errors of
    the structure before that leaf are raised as a stage raises them, with their path."""
    walk = Walk((), validate=True, tick=tick, generators=generators)
    walk.stop_at = 0
    try:
        result = walk.rebuild(sd)
    except _LeafFound:
        return False, None
    return True, result


def _no_tick() -> None:
    pass
