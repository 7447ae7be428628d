"""State handling for the Checkpointer: Stateful objects as DCP treats them, loading
in place (every saved value, into fresh objects too), what each format can restore,
and the ``torch`` format's file."""

from __future__ import annotations

import copyreg
import json
import os
import types
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from async_stager._checkpoint import integrity as _integrity
from async_stager._checkpoint.stored import HashingFile
from async_stager._dcp.blocking import no_dist_quiet
from async_stager._dcp.files import naming_file
from async_stager.errors import Attr, CheckpointError, IntegrityError, Nth

__all__ = [
    "KEYS",
    "TORCH_FILE",
    "apply_loaded",
    "assign",
    "check_dcp_savable",
    "check_matches",
    "check_torch_restorable",
    "is_stateful",
    "load_dcp",
    "resolve",
    "staged_bytes",
    "torch_write",
    "typed_paths",
    "write_typed_paths",
]

#: The single file of the ``torch`` format, inside the step folder.
TORCH_FILE = "state.pt"
#: The real (int) dict keys of a DCP checkpoint's values (see ``typed_paths``).
KEYS = "keys.json"
_KEYS_FORMAT = "async_stager-keys/1"


def is_stateful(value: Any) -> bool:
    return (
        not isinstance(value, torch.Tensor)
        and callable(getattr(value, "state_dict", None))
        and callable(getattr(value, "load_state_dict", None))
    )


def resolve(state: dict[str, Any]) -> dict[str, Any]:
    """What DCP does with a Stateful top-level value: call its ``state_dict()`` now."""
    if not isinstance(state, dict):
        raise CheckpointError(
            f"state must be a dict of str keys, got {type(state).__name__}"
            + (" (pass {'model': model}: its state_dict() is saved)" if is_stateful(state) else "")
        )
    return {k: v.state_dict() if is_stateful(v) else v for k, v in state.items()}


def assign(target: Any, loaded: Any) -> Any:
    """Load ``loaded`` into ``target`` in place where it can (tensors: ``copy_``; dicts
    and lists: item by item); returns what ``target``'s slot should now hold."""
    if isinstance(target, torch.Tensor) and isinstance(loaded, torch.Tensor) and target.shape == loaded.shape:
        with torch.no_grad():
            target.copy_(loaded)
        return target
    if isinstance(target, dict) and isinstance(loaded, dict):
        for k in list(target):
            if k not in loaded:
                del target[k]
        for k, v in loaded.items():
            target[k] = assign(target[k], v) if k in target else v
        return target
    if isinstance(target, list) and isinstance(loaded, list) and len(target) == len(loaded):
        target[:] = [assign(a, b) for a, b in zip(target, loaded)]
        return target
    return loaded


def staged_bytes(staged: dict[str, Any]) -> int:
    total = 0
    for v in _integrity.flatten(staged).values():
        if isinstance(v, torch.Tensor):
            local = v.to_local() if hasattr(v, "to_local") else v
            total += local.numel() * local.element_size()
    return total


def torch_write(staged: dict[str, Any], path: Path) -> dict[str, Any]:
    """``torch.save`` the staged state into ``path``, fsynced; returns the file's digest
    (``_stored.file_digest`` of the bytes written, hashed as they were written)."""
    # A full disk's error names the file (torch's writer turns it into "unexpected pos").
    with naming_file(path), open(path, "wb") as f:
        hashing = HashingFile(f)
        torch.save(staged, hashing)  # type: ignore[arg-type]
        f.flush()
        os.fsync(f.fileno())
    return hashing.result()


# -- what a format can restore --------------------------------------------------------

_WEIGHTS_ONLY_LEAVES: tuple[type, ...] = (
    int,
    float,
    bool,
    complex,
    str,
    bytes,
    bytearray,
    type(None),
    torch.Size,
    torch.dtype,
    torch.device,
)


def check_torch_restorable(sd: Any) -> None:
    """Refuse, at ``save``, a value that the ``torch`` format could not restore: it
    loads with ``torch.load(weights_only=True)``, which rebuilds tensors, Parameters,
    dicts, OrderedDicts, lists, tuples, sets and plain values (and the types given to
    ``torch.serialization.add_safe_globals``), nothing else. Raises CheckpointError
    naming the value's path (``state['cfg']``) and the fix."""
    safe = {g[0] if isinstance(g, tuple) else g for g in torch.serialization.get_safe_globals()}
    stack: list[tuple[Any, str]] = [(v, f"state[{k!r}]") for k, v in sd.items()]
    # Each container once: one seen twice (shared, or a state that refers to itself)
    # was checked already; without this a cycle looped for ever, on the event loop.
    seen: set[int] = set()
    while stack:
        value, where = stack.pop()
        kind = type(value)
        if kind in (torch.Tensor, torch.nn.Parameter) or kind in _WEIGHTS_ONLY_LEAVES or kind in safe:
            continue
        if kind in (dict, OrderedDict, list, tuple, set):
            if id(value) in seen:
                continue
            seen.add(id(value))
        if kind in (dict, OrderedDict):
            stack.extend((v, f"{where}[{k!r}]") for k, v in value.items())
            stack.extend((k, f"{where} (key {k!r})") for k in value if type(k) not in (str, int))
        elif kind in (list, tuple):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(value))
        elif kind is set:
            stack.extend((v, f"{where} (an element)") for v in value)
        else:
            raise CheckpointError(
                f"{where} is a {kind.__module__}.{kind.__qualname__}, which format='torch' cannot restore "
                "(it loads with torch.load(weights_only=True)): store plain values (a dict, "
                "dataclasses.asdict(...)), register the type with torch.serialization.add_safe_globals, "
                "or use format='dcp'"
            )


def check_dcp_savable(sd: dict[str, Any]) -> None:
    """Refuse, at ``save``, what the ``dcp`` format could not save or restore, naming
    its path (CheckpointError, ``path`` set): a dict key DCP turns into another one (a
    bool, None, float or tuple key: it stores every key as its ``str()``), a value that
    is not a tensor under an int dict key (DCP gives it back under the key's str), and
    a value DCP pickles that pickle refuses though the stager copies it (a lambda, a
    function or class defined inside a function, an instance of such a class). One walk as
    DCP's own traversal goes (dicts; lists holding tensors or dicts), then into the
    values it pickles (containers, and objects pickled by their attributes); cheap
    enough for the event loop (no pickling, no path built unless refused)."""
    stack: list[tuple[tuple[Any, ...], Any, bool]] = [((), sd, False)]
    terminal: dict[int, bool] = {}
    left = _PICKLE_LOOKS  # values looked into for what pickle refuses: a bounded cost
    tensor = torch.Tensor
    # The containers walked (by id, and whether under an int key): where first.
    inside: dict[tuple[int, bool], tuple[Any, ...]] = {}
    while stack:
        path, value, int_key = stack.pop()
        if isinstance(value, tensor) or hasattr(value, "__create_write_items__"):
            continue
        if isinstance(value, (Mapping, list)):
            first = inside.setdefault((id(value), int_key), path)
            if first is not path:
                if first == path[: len(first)]:
                    # DCP's traversal would recurse for ever (the write failed on it).
                    raise CheckpointError(
                        "this container holds itself, which the dcp format cannot save (DCP walks "
                        'dicts and lists to their leaves); break the cycle, or use format="torch"',
                        path=path,
                    )
                if isinstance(value, Mapping) or not _dcp_terminal(value, terminal):
                    continue  # shared, seen already
        if isinstance(value, Mapping):
            for k, v in value.items():
                kind = type(k)
                if kind is not str and (kind is bool or not isinstance(k, (str, int))):
                    _check_dcp_key(path, k)
                if type(v) is not tensor:  # (the common case, without a path made)
                    stack.append(((*path, k), v, int_key or kind is not str))
            continue
        if isinstance(value, list) and not _dcp_terminal(value, terminal):
            stack.extend(((*path, i), v, int_key) for i, v in enumerate(value))
            continue
        if int_key:
            raise CheckpointError(
                "a value that is not a tensor under an int dict key does not restore in the "
                'dcp format (DCP gives it back under the key\'s str); use str keys, a tensor, or format="torch"',
                path=path,
            )
        left = _check_picklable(path, value, left)


def _check_dcp_key(path: tuple[Any, ...], key: Any) -> None:
    if isinstance(key, bool) or not isinstance(key, (str, int)):
        raise CheckpointError(
            f"a dict key of type {type(key).__name__} cannot be saved in the dcp format (only str and "
            'int keys restore as themselves); use str keys, or format="torch"',
            path=(*path, key),
        )


def _dcp_terminal(value: list[Any], memo: dict[int, bool]) -> bool:
    """DCP's own test (``_traverse``): a list is walked into when it holds a tensor, a
    dict, or such a list; else it is one pickled value."""
    known = memo.get(id(value))
    if known is not None:
        return known
    memo[id(value)] = True  # a list that holds itself: no deeper
    try:
        out = not any(
            isinstance(v, (torch.Tensor, Mapping)) or (isinstance(v, list) and not _dcp_terminal(v, memo))
            for v in value
        )
    except RecursionError:
        out = False  # nested too deep to tell: walked (iteratively); the stager says it is too deep
    memo[id(value)] = out
    return out


def _unpicklable(value: Any) -> str | None:
    """Why pickle refuses ``value`` itself (not its contents) where the stager copies
    it (a lock, a file, a generator or a module the stager refuses itself, naming its
    path): pickle saves a function or a class by its name, which a lambda, a function
    or class defined inside a function, and an instance of such a class, lack."""
    if isinstance(value, (types.FunctionType, type)):
        name = value.__qualname__
        if "<lambda>" in name:
            return "a lambda"
        if "<locals>" in name:
            kind = "class" if isinstance(value, type) else "function"
            return f"{kind} {name} (defined inside a function: pickle saves it by a name it lacks)"
        return None
    cls = type(value)
    if "<locals>" in cls.__qualname__ and _plainly_pickled(cls):
        return f"an instance of class {cls.__qualname__} (defined inside a function: pickle saves its class by name)"
    return None


#: Values pickle always saves (nothing inside them to look at).
_PLAIN = frozenset({str, bytes, int, float, bool, complex, type(None), torch.Tensor})


def _plainly_pickled(kind: type) -> bool:
    """Pickle saves an instance by its attributes (no reduction of its own)."""
    base: Any = object
    return (
        getattr(kind, "__reduce_ex__", None) is base.__reduce_ex__
        and getattr(kind, "__reduce__", None) is base.__reduce__
        and getattr(kind, "__getstate__", None) is getattr(base, "__getstate__", None)
        and kind not in copyreg.dispatch_table
    )


#: The values ``check_dcp_savable`` looks into for what pickle refuses, per save (a
#: best effort beyond it: the write still fails on it, later).
_PICKLE_LOOKS = 100_000


def _check_picklable(path: tuple[Any, ...], value: Any, left: int) -> int:
    """``value`` and what pickle saves of it: refused (CheckpointError naming the path
    inside it) where ``_unpicklable`` says pickle would refuse; at most ``left`` values
    looked into. Returns how many more may be."""
    stack: list[tuple[tuple[Any, ...], Any]] = [(path, value)]
    seen: set[int] = set()
    while stack and left > 0:
        left -= 1
        where, v = stack.pop()
        if type(v) in _PLAIN or isinstance(v, torch.Tensor):
            continue
        if id(v) in seen:
            continue
        seen.add(id(v))
        why = _unpicklable(v)
        if why is not None:
            raise CheckpointError(
                f"this value is {why}, which format='dcp' cannot save (DCP pickles the values that are "
                "not tensors, and pickle refuses it); store plain data instead (a name, a config dict), "
                "or a function defined at module level",
                path=where,
            )
        if isinstance(v, Mapping):
            stack.extend(((*where, k), x) for k, x in v.items() if type(x) not in _PLAIN)
        elif isinstance(v, (list, tuple)):
            stack.extend(((*where, i), x) for i, x in enumerate(v) if type(x) not in _PLAIN)
        elif isinstance(v, (set, frozenset)):
            stack.extend(((*where, Nth(i)), x) for i, x in enumerate(v))
        elif _plainly_pickled(type(v)):
            attrs = getattr(v, "__dict__", None)
            if isinstance(attrs, dict):
                stack.extend(((*where, Attr(k)), x) for k, x in attrs.items() if isinstance(k, str))
    return left


def typed_paths(sd: dict[str, Any]) -> dict[str, list[Any]]:
    """DCP's flattened names whose path goes through a dict key that is not a str (an
    optimizer's ``state`` is keyed by int), with the path as the keys really are: DCP's
    metadata stores every dict key as a str, so a value missing from the restore
    target would otherwise come back under ``'0'`` instead of ``0``. Only int keys are
    recorded (JSON keeps them); others come back as DCP gives them."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, mapping = flatten_state_dict(sd)
    by_str: dict[int, dict[str, Any]] = {}
    out: dict[str, list[Any]] = {}
    for fqn, path in mapping.items():
        node: Any = sd
        typed: list[Any] = []
        changed = False
        for comp in path:
            if isinstance(node, Mapping) and comp not in node:
                table = by_str.get(id(node))
                if table is None:
                    table = by_str[id(node)] = {str(k): k for k in node}
                real = table.get(str(comp), comp)
                if isinstance(real, int) and not isinstance(real, bool):
                    comp, changed = real, True
                elif not isinstance(real, str):
                    # DCP keeps every dict key as its str(): a bool, None, float or
                    # tuple key would restore as a string into a target lacking it.
                    raise CheckpointError(
                        f"a dict key of type {type(real).__name__} cannot be "
                        "saved in the dcp format (only str and int keys restore as themselves); "
                        'use str keys, or format="torch"',
                        path=(*typed, real),
                    )
            typed.append(comp)
            try:
                node = node[comp]
            except (KeyError, IndexError, TypeError):
                break
        if changed:
            if not isinstance(flat[fqn], torch.Tensor):
                # DCP loads a pickled value back under the str of each key of its path
                # (its own load makes {'0': v} beside {0: ...}): restored into the
                # wrong key, or not at all. Refused, never silently wrong.
                raise CheckpointError(
                    "a value that is not a tensor under an int dict key does not restore in the "
                    'dcp format (DCP gives it back under the key\'s str); use str keys, a tensor, or format="torch"',
                    path=tuple(typed),
                )
            out[fqn] = typed
    return out


def write_typed_paths(folder: Path, paths: dict[str, list[Any]]) -> None:
    """Store ``typed_paths`` beside the data (``KEYS``); nothing when there are none."""
    if not paths:
        return
    with open(folder / KEYS, "w", encoding="utf-8") as f:
        json.dump({"format": _KEYS_FORMAT, "paths": paths}, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _read_typed_paths(folder: Path, step: int) -> dict[str, tuple[Any, ...]]:
    try:
        doc = json.loads((folder / KEYS).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise IntegrityError(f"{folder}: unreadable {KEYS} ({exc})", step=step) from exc
    paths = doc.get("paths") if isinstance(doc, dict) and doc.get("format") == _KEYS_FORMAT else None
    if not isinstance(paths, dict) or not all(isinstance(p, list) for p in paths.values()):
        raise IntegrityError(f"{folder}: {KEYS} is damaged", step=step)
    return {k: tuple(p) for k, p in paths.items()}


def _render(path: tuple[Any, ...]) -> str:
    return "state" + "".join(f"[{p!r}]" for p in path)


# -- loading a DCP checkpoint into a state ----------------------------------------------


def load_dcp(state: dict[str, Any], folder: Path, step: int, *, group: Any, distributed: bool) -> None:
    """Load the DCP checkpoint in ``folder`` into ``state``, every saved value included.

    DCP loads only what its target names, so a fresh optimizer (no ``state`` yet) would
    silently stay empty. Here the target is completed from the checkpoint's metadata
    first: every saved value the target lacks gets a placeholder at its path (a tensor
    of the saved size and dtype, or None for a pickled value), DCP fills it, and each
    Stateful then gets ``load_state_dict`` with the whole saved state. A target value
    the checkpoint does not hold, or a tensor of another shape, raises CheckpointError
    naming its path and both shapes before anything is loaded; a file that cannot be
    read raises IntegrityError (the caller may fall back to an older step). A
    KeyboardInterrupt or SystemExit inside DCP's reader (which wraps it in a
    CheckpointException) is re-raised as itself: an interrupt, not a damaged file."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    try:
        metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    except (Exception, CheckpointException) as exc:  # a BaseException: DCP's read failure
        stop = _integrity.interrupt_in(exc)
        if stop is not None:
            raise stop from None
        raise IntegrityError(f"{folder}: unreadable DCP metadata ({exc})", step=step) from exc
    saved = metadata.state_dict_metadata
    planner_data = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    target = resolve(state)
    flat, mapping = flatten_state_dict(target)
    for fqn, value in flat.items():
        where = _render(mapping[fqn])
        md = saved.get(fqn)
        if md is None:
            raise CheckpointError(
                f"restore: {where} is not in checkpoint step {step} ({folder}): the state does not "
                "match what was saved (a renamed or added key?)",
                step=step,
            )
        if isinstance(value, torch.Tensor) != isinstance(md, TensorStorageMetadata):
            kind = "a tensor" if isinstance(md, TensorStorageMetadata) else "a non-tensor value"
            raise CheckpointError(
                f"restore: {where} is a {type(value).__name__} in the state, {kind} in checkpoint step {step}",
                step=step,
            )
        if (
            isinstance(value, torch.Tensor)
            and isinstance(md, TensorStorageMetadata)
            and tuple(value.shape) != tuple(md.size)
        ):
            raise CheckpointError(
                f"restore: {where} has shape {tuple(value.shape)} in the state, "
                f"{tuple(md.size)} in checkpoint step {step}",
                step=step,
            )
        if (
            isinstance(value, torch.Tensor)
            and isinstance(md, TensorStorageMetadata)
            and value.dtype != md.properties.dtype
        ):
            # DCP would convert on load (a copy_ into the target): values silently
            # rounded or widened are not what was saved.
            raise CheckpointError(
                f"restore: {where} is {value.dtype} in the state, {md.properties.dtype} in checkpoint "
                f"step {step}: convert after restoring, not by restoring",
                step=step,
            )
    typed = _read_typed_paths(folder, step)
    for fqn, md in saved.items():
        if fqn in flat:
            continue
        shape = planner_data.get(fqn)
        if shape is None:
            raise IntegrityError(f"{folder}: no path for saved value {fqn!r} in DCP metadata", step=step)
        path = typed.get(fqn) or shape
        if isinstance(md, TensorStorageMetadata):
            placeholder: Any = torch.empty(md.size, dtype=md.properties.dtype)
        elif isinstance(md, BytesStorageMetadata):
            placeholder = None
        else:
            raise IntegrityError(f"{folder}: unknown metadata for {fqn!r}", step=step)
        try:
            _place(target, tuple(path), tuple(shape), placeholder)
        except (TypeError, KeyError, IndexError, AttributeError) as exc:
            raise CheckpointError(
                f"restore: cannot place saved value {_render(tuple(path))} into the state ({exc})", step=step
            ) from exc
    try:
        with no_dist_quiet():
            if distributed:
                dcp.load(target, checkpoint_id=str(folder), process_group=group)
            else:
                dcp.load(target, checkpoint_id=str(folder), no_dist=True)
    except (Exception, CheckpointException) as exc:  # a BaseException: DCP's read failure
        stop = _integrity.interrupt_in(exc)
        if stop is not None:  # Ctrl-C inside DCP's reader: stop, do not fall back
            raise stop from None
        raise IntegrityError(f"{folder}: cannot read checkpoint step {step} ({exc})", step=step) from exc
    apply_loaded(state, target, step)


def _place(target: dict[str, Any], path: tuple[Any, ...], shape: tuple[Any, ...], value: Any) -> None:
    """Put ``value`` at ``path`` in ``target``, making the containers it lacks. DCP's
    own ``set_element`` makes a list for every int key; here a list is made only where
    DCP's path (``shape``: str for a dict key, int for a list index) says the saved
    container was one, so a dict keyed by ints comes back as a dict."""
    node: Any = target
    for i, key in enumerate(path[:-1]):
        is_list = isinstance(shape[i + 1], int) and not isinstance(shape[i + 1], bool)
        if isinstance(node, list):
            while len(node) <= key:
                node.append(None)
            if node[key] is None:
                node[key] = [] if is_list else {}
        elif key not in node:
            node[key] = [] if is_list else {}
        node = node[key]
    last = path[-1]
    if isinstance(node, list):
        while len(node) <= last:
            node.append(None)
    node[last] = value


def check_matches(target: Any, loaded: Any, step: int, where: str = "state") -> None:
    """Refuse to load ``loaded`` into ``target`` when they do not match: a key of the
    target the checkpoint lacks, a tensor of another shape, a tensor where the
    checkpoint holds another value (the ``torch`` format's counterpart of DCP's own
    checks in ``load_dcp``). Keys the checkpoint has and the target lacks are fine:
    they are added.

    One rule for both formats: as DCP's, every value of the target's flattened form (a
    path through dicts, and lists holding tensors, to a tensor or another value) must be
    at that path in the checkpoint, a tensor where a tensor is: a dict in the state
    where the checkpoint holds a tensor (or a plain value where it holds a dict) is
    refused, never replaced."""
    _check_tensors(target, loaded, step, where)
    if where != "state":
        return
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat_target, mapping = flatten_state_dict(target)
    flat_loaded, _ = flatten_state_dict(loaded)
    for fqn, value in flat_target.items():
        place = _render(mapping[fqn])
        if fqn not in flat_loaded:
            raise CheckpointError(
                f"restore: {place} is not in checkpoint step {step}: the state does not match what "
                "was saved (a renamed or added key, or another structure there)",
                step=step,
            )
        saved = flat_loaded[fqn]
        if isinstance(value, torch.Tensor) != isinstance(saved, torch.Tensor):
            kind = "a tensor" if isinstance(saved, torch.Tensor) else "a non-tensor value"
            raise CheckpointError(
                f"restore: {place} is a {type(value).__name__} in the state, {kind} in checkpoint step {step}",
                step=step,
            )


def _check_tensors(target: Any, loaded: Any, step: int, where: str) -> None:
    """The tensors of ``target`` against ``loaded``, path by path: kind, shape, dtype."""
    if isinstance(target, torch.Tensor):
        if not isinstance(loaded, torch.Tensor):
            raise CheckpointError(
                f"restore: {where} is a tensor in the state, a {type(loaded).__name__} in checkpoint step {step}",
                step=step,
            )
        if tuple(target.shape) != tuple(loaded.shape):
            raise CheckpointError(
                f"restore: {where} has shape {tuple(target.shape)} in the state, "
                f"{tuple(loaded.shape)} in checkpoint step {step}",
                step=step,
            )
        if target.dtype != loaded.dtype:
            raise CheckpointError(
                f"restore: {where} is {target.dtype} in the state, {loaded.dtype} in checkpoint "
                f"step {step}: convert after restoring, not by restoring",
                step=step,
            )
    elif isinstance(target, Mapping) and isinstance(loaded, Mapping):
        for k, v in target.items():
            if k not in loaded:
                raise CheckpointError(
                    f"restore: {where}[{k!r}] is not in checkpoint step {step}: the state does not match "
                    "what was saved (a renamed or added key?)",
                    step=step,
                )
            _check_tensors(v, loaded[k], step, f"{where}[{k!r}]")


def apply_loaded(state: dict[str, Any], loaded: dict[str, Any], step: int) -> None:
    """Put a loaded state into ``state`` in place: Statefuls get ``load_state_dict``,
    tensors are copied into, other values replaced; saved keys ``state`` lacks are
    added."""
    for k, v in loaded.items():
        current: Any = state.get(k)
        if k in state and is_stateful(current):
            try:
                current.load_state_dict(v)
            except Exception as exc:
                raise CheckpointError(
                    f"restore: state[{k!r}].load_state_dict failed on checkpoint step {step}: {exc}",
                    step=step,
                ) from exc
        else:
            state[k] = assign(current, v) if k in state else v
