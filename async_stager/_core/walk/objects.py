"""Walk and rebuild of what is not a container: tensors (wrapper subclasses such as
DTensor), generators, and any other object through the copy/pickle protocol.

``ObjectWalk`` is the half of ``_tree.Walk`` for these: an object reduces
(``__reduce_ex__(4)`` or ``copyreg``) to a callable, its arguments and its state, which
are walked like any structure and the object rebuilt from them, as ``copy.deepcopy``
does; errors name the step (an attribute, ``REDUCE`` for the arguments or the state).
Kept apart from the containers' walk so each reads on its own; also the shared
constants of both halves (``ATOMIC``, ``UNWALKED``).
"""

from __future__ import annotations

import copyreg
import enum
import functools
import types
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from async_stager.errors import Attr, InvalidStateDictError, Nth, StagingError, UncopyableObjectError

__all__ = [
    "ATOMIC",
    "REDUCE",
    "UNWALKED",
    "GeneratorStates",
    "Interrupt",
    "ObjectWalk",
    "check_state_dict",
    "generator_states",
    "key_step",
    "stateful_object_error",
]

_Tensor = torch.Tensor


ATOMIC: frozenset[type] = frozenset(
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

#: The path step to what an object reduces to (``copy``/``pickle`` protocol): then
#: ``[1][i]`` is its i-th argument, ``[2]`` its state. ``sd['o'].__reduce_ex__(4)[1][0]``
#: is Python that evaluates to (a copy of) the object the step names.
REDUCE = Attr("__reduce_ex__(4)")

#: ``functools.partial``'s reduce state, as the attributes it is made of.
_PARTIAL_STATE = (Attr("func"), Attr("args"), Attr("keywords"))


#: Stands for a key whose walk has not returned (it raised): the error names the key.
UNWALKED: Any = object()


def key_step(d: Any, key: Any) -> Nth:
    """The path step naming ``key`` itself (not its value) in ``d``."""
    for i, k in enumerate(d):
        if k is key:
            return Nth(i)
    return Nth(-1)


#: Per generator (by id): the generator and its reduce (``__reduce_ex__(4)``, its state
#: copied) taken at the call; what the walk rebuilds that generator from.
GeneratorStates = Mapping[int, tuple[torch.Generator, Any]]

#: Containers of more entries than this are not looked into for generators at the
#: call (the look must cost microseconds, not a pass over a flat model state dict).
_SCAN_WIDTH = 256
#: How deep the look at the call goes: the state itself (0), its values (1), and
#: their values (2).
_SCAN_DEPTH = 2


def _default_generators() -> list[torch.Generator]:
    """torch's default generators: the CPU's, and CUDA's of every device with a context
    (only those can have advanced; none before CUDA is initialised). Creates no
    context."""
    out = [torch.default_generator]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)
        for i, g in enumerate(torch.cuda.default_generators):
            if has_context is None or has_context(i):
                out.append(g)
    return out


def generator_states(sd: Any) -> dict[int, tuple[torch.Generator, Any]]:
    """At the call, on the caller's thread: the state of every ``torch.Generator``
    found at the top levels of ``sd`` (``sd`` itself, its values and their values,
    looking only into dicts, lists and tuples of at most ``_SCAN_WIDTH`` entries) and of
    torch's default generators (CPU, and CUDA's per device), wherever they are in
    ``sd``. A generator advances as soon as the caller draws a number (on CUDA: when a
    kernel using it is launched, without any stream ordering), so a state read when the
    worker walks would not be the state as of the call. Generators found only by the
    walk (deeper, inside objects) are read when the worker walks. Cost: a reduce per
    generator (a 5 KB copy for a CPU one), microseconds."""
    out: dict[int, tuple[torch.Generator, Any]] = {}

    def take(g: torch.Generator) -> None:
        if id(g) not in out:
            out[id(g)] = (g, g.__reduce_ex__(4))

    for g in _default_generators():
        take(g)
    stack: list[tuple[Any, int]] = [(sd, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, torch.Generator):
            take(v)
        elif depth < _SCAN_DEPTH and isinstance(v, (dict, list, tuple)) and len(v) <= _SCAN_WIDTH:
            values = v.values() if isinstance(v, dict) else v
            stack.extend((x, depth + 1) for x in values)
    return out


#: What holds state but is not a state dict: its ``state_dict()`` is.
_STATEFUL_OBJECTS: tuple[tuple[type, str], ...] = (
    (torch.nn.Module, "torch.nn.Module"),
    (torch.optim.Optimizer, "torch.optim.Optimizer"),
)


def stateful_object_error(obj: Any) -> InvalidStateDictError | None:
    """The error (path ``()``) for a module or optimizer met where a state dict's
    values go; None for anything else. Walked, one would be staged as a copy of the
    whole object (its hooks, its parameters' graph), which no loader takes; calling its
    ``state_dict()`` from the stager's thread would run the caller's hooks (FSDP's
    collectives) there."""
    for cls, name in _STATEFUL_OBJECTS:
        if isinstance(obj, cls):
            return InvalidStateDictError(
                f"a {name} ({type(obj).__name__}) is not a state dict: stage its state_dict() "
                "(Checkpointer.save and async_stager.dcp.save call state_dict() of a "
                "top-level value themselves)",
                path=(),
            )
    return None


def check_state_dict(sd: Any) -> None:
    """Refuse, at the call, a top level that is not a state dict: a plain value with
    nothing to stage (None, a number, a string: ``ATOMIC``), or a module or optimizer.
    Anything that may hold a tensor (a dict, list, tuple, dataclass, a tensor itself,
    another object) is staged."""
    if type(sd) in ATOMIC:
        raise InvalidStateDictError(
            f"stage() takes a state dict (a dict, list, tuple, dataclass or tensor), got "
            f"{type(sd).__name__} {sd!r:.60}: nothing to stage",
            path=(),
        )
    refused = stateful_object_error(sd)
    if refused is not None:
        raise refused


class Interrupt(Exception):
    """Base of the engine's control-flow exceptions raised from ``tick`` (a
    cancellation): the walk lets them through untouched, never wraps them."""


class ObjectWalk:
    """Tensors, generators and objects of a ``Walk`` (see module doc). The containers'
    half (``Walk``) provides the memo, the leaves and ``visit``."""

    __slots__ = ()

    memo: dict[int, Any]
    keep: list[Any]
    nhosts: int
    generators: GeneratorStates

    def visit(self, obj: Any) -> Any:
        raise NotImplementedError

    def _leaf(self, t: torch.Tensor) -> Any:
        raise NotImplementedError

    def _tuple(self, t: tuple[Any, ...]) -> Any:
        raise NotImplementedError

    def _items_into(self, seq: Any, put: Callable[[Any], Any], member: str | None = None) -> None:
        raise NotImplementedError

    def _other(self, obj: Any) -> Any:
        if isinstance(obj, _Tensor):
            return self._tensor(obj)
        refused = stateful_object_error(obj)
        if refused is not None:
            raise refused
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
        # generator is copied here and now, outside the plan (a few KB): from its state
        # taken at the call when there is one (``generator_states``), else as it is now.
        memo = self.memo
        if id(g) in memo:
            return memo[id(g)]
        try:
            taken = self.generators.get(id(g))
            rv: Any = taken[1] if taken is not None and taken[0] is g else g.__reduce_ex__(4)
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
                    key = UNWALKED
                    key = self.visit(k)
                    y[key] = self.visit(v)
            except StagingError as e:
                e.path = (Nth(i) if key is UNWALKED else k, *(e.path or ()))
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
        """``visit(obj)``; errors are prefixed with ``steps`` (from the caller's object)."""
        try:
            return self.visit(obj)
        except StagingError as e:
            e.path = (*steps, *(e.path or ()))
            raise

    def _state_dict(self, state: dict[Any, Any]) -> dict[Any, Any]:
        # An object's __dict__ (or slot values): a dict whose keys are its attributes.
        out: dict[Any, Any] = {}
        k = key = None
        try:
            for k, v in state.items():
                if type(k) is str or type(k) in ATOMIC:
                    key = k
                else:
                    key = UNWALKED
                    key = self.visit(k)
                out[key] = v if type(v) in ATOMIC else self.visit(v)
        except StagingError as e:
            if key is UNWALKED:
                step: Any = key_step(state, k)
            else:
                step = Attr(k) if isinstance(k, str) else k
            e.path = (step, *(e.path or ()))
            raise
        return out
