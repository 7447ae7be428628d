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
import copyreg
import enum
import functools
import operator
import sys
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ._errors import Attr, NestingError, Nth, StagingError, UncopyableObjectError, UnsupportedTensorError

__all__ = ["REDUCE", "Interrupt", "Walk", "check_tensor", "path_of_leaf", "wrap_like"]

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter

_ATOMIC: frozenset[type] = frozenset(
    {
        int,
        float,
        bool,
        complex,
        str,
        bytes,
        type(None),
        type(Ellipsis),
        type(NotImplemented),
        type,
        range,
        types.FunctionType,
        types.BuiltinFunctionType,
        types.MethodType,
        weakref.ref,
        property,
        torch.dtype,
        torch.device,
        torch.layout,
        torch.memory_format,
        torch.Size,
        torch.finfo,
        torch.iinfo,
    }
)

#: Leaves between calls of ``tick``.
_TICK_EVERY = 256


#: The path step to what an object reduces to (``copy``/``pickle`` protocol): then
#: ``[1][i]`` is its i-th argument, ``[2]`` its state. ``sd['o'].__reduce_ex__(4)[1][0]``
#: is Python that evaluates to (a copy of) the object the step names.
REDUCE = Attr("__reduce_ex__(4)")

#: ``functools.partial``'s reduce state, as the attributes it is made of.
_PARTIAL_STATE = (Attr("func"), Attr("args"), Attr("keywords"))


def check_tensor(t: torch.Tensor) -> None:
    """Raise UnsupportedTensorError (path ()) if ``t`` cannot be staged faithfully."""
    if t.is_nested:
        raise UnsupportedTensorError("nested tensors are not supported")
    if t.layout is not torch.strided:
        raise UnsupportedTensorError(f"{t.layout} tensors are not supported (only strided)")
    if t.is_quantized:
        raise UnsupportedTensorError("quantized tensors are not supported")
    dev = t.device
    if dev.type == "meta":
        raise UnsupportedTensorError("meta tensors have no data to stage")
    n = t.numel()
    if n:
        st = t.untyped_storage()
        if st.data_ptr() == 0:
            raise UnsupportedTensorError(f"storage was freed (data_ptr 0) but the tensor has {n} elements")
        extent = t.storage_offset() + 1 + sum((s - 1) * abs(d) for s, d in zip(t.shape, t.stride()))
        if extent * t.element_size() > st.nbytes():
            raise UnsupportedTensorError(
                f"storage holds {st.nbytes()} bytes but the tensor needs "
                f"{extent * t.element_size()} (was it resized?)"
            )


class Walk:
    """A copy of one nested structure, with tensor leaf i replaced by ``hosts[i]``.

    ``leaves`` receives every tensor leaf in order (one entry per occurrence).
    With ``validate`` each new leaf is checked (``check_tensor``) and accelerator devices
    must agree; errors name their path. Leaves past the end of ``hosts`` stay the
    source tensors (the result is then only good for its ``leaves``; hazard: it must
    not be None, since objects rebuilt around it, e.g. ``torch.Generator``, check it).
    """

    __slots__ = (
        "accel",
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
    ) -> None:
        self.leaves: list[torch.Tensor] = []
        self.hosts = hosts
        self.nhosts = len(hosts)
        self.memo: dict[int, Any] = {}
        self.keep: list[Any] = []
        self.validate = validate
        self.tick = tick
        self.accel: torch.device | None = None
        self.stop_at = -1

    def run(self, obj: Any) -> Any:
        if self.nhosts:
            # Hazard: hosts are reused from stage to stage (the fast path), so
            # attributes the caller set on an earlier result would stay: gone.
            _clear_attrs(self.hosts)
        try:
            return self.walk(obj)
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

    def walk(self, obj: Any) -> Any:
        cls = type(obj)
        if cls in _ATOMIC:
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
        leaves = self.leaves
        hosts = self.hosts
        nh = self.nhosts
        validate = self.validate
        k = key = None
        try:
            for k, v in d.items():
                # Keys are state too (a tensor as a key): walked first, in every
                # branch, so their leaves come before the value's in every mode.
                if type(k) in _ATOMIC:
                    key = k
                else:
                    key = _UNWALKED
                    key = self.walk(k)
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
                elif c in _ATOMIC:
                    out[key] = v
                else:
                    out[key] = self.walk(v)
        except StagingError as e:
            e.path = (_key_step(d, k) if key is _UNWALKED else k, *(e.path or ()))
            raise
        except RuntimeError as e:
            _raise_if_mutated(e)
            raise
        return out

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
        if type(factory) not in _ATOMIC:
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
                elif c in _ATOMIC:
                    put(v)
                else:
                    put(self.walk(v))
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

    # -- everything else --------------------------------------------------------------

    def _other(self, obj: Any) -> Any:
        if isinstance(obj, _Tensor):
            return self._tensor(obj)
        cls = type(obj)
        if isinstance(obj, tuple) and hasattr(cls, "_fields") and hasattr(cls, "_make"):
            return self._tuple(obj)  # namedtuple
        if isinstance(obj, (enum.Enum, type)):
            # Enum members, and classes with a metaclass (ABCMeta, EnumType): atomic,
            # as for copy.deepcopy (their reduce cannot rebuild them).
            return obj
        return self._reduce(obj)

    def _tensor(self, t: torch.Tensor) -> Any:
        if not is_traceable_wrapper_subclass(t):
            return self._leaf(t)
        memo = self.memo
        if id(t) in memo:
            return memo[id(t)]
        # DTensor and other wrapper subclasses: stage the inner tensors, rebuild the
        # wrapper around their host copies with the same metadata (mesh, placements).
        names, ctx = t.__tensor_flatten__()
        inner: dict[str, Any] = {}
        for name in names:
            try:
                x = getattr(t, name)
                # Not every flattened "inner" is a tensor: torch >= 2.10 lists a
                # DTensor's DeviceMesh too. Such handles are passed through as is.
                inner[name] = self._tensor(x) if isinstance(x, _Tensor) else x
            except StagingError as e:
                e.path = (Attr(name), *(e.path or ()))
                raise
        if not self.nhosts:
            out = t  # a collect-only walk: nothing to rebuild
        else:
            try:
                out = type(t).__tensor_unflatten__(inner, ctx, t.size(), t.stride())
            except Exception as e:
                raise UncopyableObjectError(
                    f"could not rebuild {type(t).__name__} around its staged inner tensors: {e!r}",
                    path=(),
                ) from e
        memo[id(t)] = out
        self.keep.append(t)
        return out

    def _generator(self, g: torch.Generator) -> Any:
        # Hazard: Generator.__setstate__ reads its state tensor's *values*, but an
        # object rebuilt in the walk gets host tensors the copies fill only later. So a
        # generator is copied here and now, outside the plan (a few KB).
        memo = self.memo
        if id(g) in memo:
            return memo[id(g)]
        try:
            rv: Any = g.__reduce_ex__(4)
            func, args, state = rv[:3]
            out = func(*args)
            out.__setstate__(state)
        except Exception as e:
            raise UncopyableObjectError(f"cannot copy {type(g).__name__}: {e!r}", path=()) from e
        memo[id(g)] = out
        return out

    def _reduce(self, obj: Any) -> Any:
        memo = self.memo
        if id(obj) in memo:
            return memo[id(obj)]
        cls = type(obj)
        try:
            reductor = copyreg.dispatch_table.get(cls)
            rv = reductor(obj) if reductor is not None else obj.__reduce_ex__(4)
        except Exception as e:
            raise UncopyableObjectError(
                f"cannot copy {cls.__module__}.{cls.__qualname__}: its __reduce_ex__ raised {e!r}",
                path=(),
            ) from e
        if isinstance(rv, str):  # a global: copy returns it as is
            return obj
        self.keep.append(rv)
        try:
            return self._reconstruct(obj, rv)
        except (StagingError, Interrupt, RecursionError):
            raise
        except Exception as e:
            # Anything a malformed reduce value or user code raises while the object
            # is rebuilt (listiter, dictiter, append, item assignment): typed, with path.
            raise UncopyableObjectError(
                f"cannot copy {cls.__module__}.{cls.__qualname__}: rebuilding it raised {e!r}",
                path=(),
            ) from e

    def _reconstruct(self, obj: Any, rv: tuple[Any, ...]) -> Any:
        func, args, state, listiter, dictiter = (tuple(rv) + (None,) * 5)[:5]
        cls = type(obj)
        # functools.partial reduces to (its class, (func,), (func, args, keywords,
        # __dict__)): its own attributes, named as such on errors.
        partial = isinstance(obj, functools.partial) and func is cls and len(args or ()) == 1
        # What func raises is typed (with the path) by _reduce.
        if not args:
            args = ()
        elif partial:
            args = (self._walk_at(args[0], _PARTIAL_STATE[0]),)
        else:
            args = self._walk_at(args, REDUCE, 1)
        y = func(*args)
        self.memo[id(obj)] = y
        if state is not None:
            state = self._walk_state(obj, state, partial)
            try:
                if hasattr(y, "__setstate__"):
                    y.__setstate__(state)
                else:
                    slotstate = None
                    if isinstance(state, tuple) and len(state) == 2:
                        state, slotstate = state
                    if state:
                        y.__dict__.update(state)
                    if slotstate:
                        for key, value in slotstate.items():
                            setattr(y, key, value)
            except Exception as e:
                raise UncopyableObjectError(
                    f"cannot copy {cls.__module__}.{cls.__qualname__}: restoring its state raised {e!r}",
                    path=(),
                ) from e
        if listiter is not None:
            items: list[Any] = []
            self._items_into(listiter, items.append)
            for item in items:
                y.append(item)
        if dictiter is not None:
            k = key = None
            i = -1
            try:
                for i, (k, v) in enumerate(dictiter):  # noqa: B007 - i names a key on errors
                    key = _UNWALKED
                    key = self.walk(k)
                    y[key] = self.walk(v)
            except StagingError as e:
                e.path = (Nth(i) if key is _UNWALKED else k, *(e.path or ()))
                raise
        return y

    def _walk_state(self, obj: Any, state: Any, partial: bool) -> Any:
        """The walked reduce state of ``obj``; errors name the attributes it holds where
        it is the object's attributes, or else the state as what it is (``REDUCE``)."""
        if partial and isinstance(state, tuple) and len(state) == 4:
            head = tuple(self._walk_at(x, step) for x, step in zip(state, _PARTIAL_STATE))
            return (*head, None if state[3] is None else self._state_dict(state[3]))
        try:
            own = obj.__dict__
        except Exception:  # noqa: BLE001 - no __dict__ (slots), or a __getattr__ that raises
            own = None
        if state is own and isinstance(state, dict):
            return self._state_dict(state)
        if (
            isinstance(state, tuple)
            and len(state) == 2
            and (state[0] is None or state[0] is own)
            and isinstance(state[1], dict)
            and getattr(type(obj), "__getstate__", None) is getattr(object, "__getstate__", None)
        ):
            # The default state of an object with __slots__: (its __dict__, slot values).
            return (None if state[0] is None else self._state_dict(state[0]), self._state_dict(state[1]))
        return self._walk_at(state, REDUCE, 2)

    def _walk_at(self, obj: Any, *steps: Any) -> Any:
        """``walk(obj)``; errors are prefixed with ``steps`` (from the caller's object)."""
        try:
            return self.walk(obj)
        except StagingError as e:
            e.path = (*steps, *(e.path or ()))
            raise

    def _state_dict(self, state: dict[Any, Any]) -> dict[Any, Any]:
        # An object's __dict__ (or slot values): a dict whose keys are its attributes.
        out: dict[Any, Any] = {}
        k = key = None
        try:
            for k, v in state.items():
                if type(k) is str or type(k) in _ATOMIC:
                    key = k
                else:
                    key = _UNWALKED
                    key = self.walk(k)
                out[key] = v if type(v) in _ATOMIC else self.walk(v)
        except StagingError as e:
            if key is _UNWALKED:
                step: Any = _key_step(state, k)
            else:
                step = Attr(k) if isinstance(k, str) else k
            e.path = (step, *(e.path or ()))
            raise
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
    """Every host tensor without attributes (at C speed but for hosts that have some)."""
    for attrs in filter(None, map(_ATTRS, hosts)):
        attrs.clear()


#: Stands for a key whose walk has not returned (it raised): the error names the key.
_UNWALKED: Any = object()


def _key_step(d: Any, key: Any) -> Nth:
    """The path step naming ``key`` itself (not its value) in ``d``."""
    for i, k in enumerate(d):
        if k is key:
            return Nth(i)
    return Nth(-1)


def _raise_if_mutated(e: RuntimeError) -> None:
    """A container changed size while it was iterated (another thread mutating the
    state dict during a stage): a typed error naming this container, never a torn copy."""
    if not isinstance(e, RecursionError) and "during iteration" in str(e):
        raise StagingError(
            f"this container changed while it was being staged ({e}); "
            "do not mutate a state dict until its stage() returns",
            path=(),
        ) from e


class Interrupt(Exception):
    """Base of the engine's control-flow exceptions raised from ``tick`` (a
    cancellation): the walk lets them through untouched, never wraps them."""


class _LeafFound(StagingError):
    """Internal: raised at the wanted leaf by ``path_of_leaf``; carries its path."""


def path_of_leaf(sd: Any, index: int) -> tuple[Any, ...] | None:
    """The path of the ``index``-th tensor leaf of ``sd`` in walk order (None if the
    structure has fewer leaves now). Used to name the place of errors found after the
    walk, such as a failed copy."""
    walk = Walk((), validate=True, tick=_no_tick)
    walk.stop_at = index
    try:
        walk.run(sd)
    except _LeafFound as e:
        return e.path or ()
    except StagingError:
        return None
    return None


def _no_tick() -> None:
    pass
