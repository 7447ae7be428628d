"""Comparing two states bit for bit: what a restore check, a resume test or a service's
self-check needs, in one place instead of a copy per program.

``state_differences(expected, actual)`` walks both structures together and names every
place where they differ (``state.optim.state.0.exp_avg: bytes differ``). Tensors are
compared by dtype, shape and bytes, not by value: -0.0 is not 0.0 and a NaN equals
itself, which is what "restored exactly" means. Anything with a ``state_dict()``
method (a module, an optimizer, an LR scheduler, a DCP Stateful) is compared by its
state dict, so a live model compares against the state restored into another.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["state_differences"]

#: Nesting beyond which a structure is reported instead of walked (a cycle, or a
#: structure no state dict has).
_MAX_DEPTH = 200


def _host_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's logical bytes as a flat uint8 CPU tensor (lazy conj/neg bits and
    strides resolved; a DTensor compared by its local shard)."""
    local = getattr(t, "to_local", None)
    if callable(local) and type(t) is not torch.Tensor:
        t = local()
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t.to("cpu").contiguous().reshape(-1).view(torch.uint8)


def _tensor(path: str, expected: torch.Tensor, actual: Any) -> list[str]:
    if not isinstance(actual, torch.Tensor):
        return [f"{path}: a {type(actual).__name__}, not a tensor"]
    if actual.dtype != expected.dtype:
        return [f"{path}: dtype {actual.dtype}, not {expected.dtype}"]
    if tuple(actual.shape) != tuple(expected.shape):
        return [f"{path}: shape {tuple(actual.shape)}, not {tuple(expected.shape)}"]
    if not torch.equal(_host_bytes(actual), _host_bytes(expected)):
        return [f"{path}: bytes differ"]
    return []


def _plain(path: str, expected: Any, actual: Any) -> list[str]:
    if type(actual) is not type(expected):
        return [f"{path}: a {type(actual).__name__}, not a {type(expected).__name__}"]
    if isinstance(expected, float) and math.isnan(expected) and math.isnan(actual):
        return []
    try:
        same = bool(actual == expected)
    except Exception:  # noqa: BLE001 - an object whose == raises (or is ambiguous) differs
        same = False
    return [] if same else [f"{path}: {actual!r:.60}, not {expected!r:.60}"]


def _walk(path: str, expected: Any, actual: Any, depth: int, out: list[str]) -> None:
    if depth > _MAX_DEPTH:
        out.append(f"{path}: nested more than {_MAX_DEPTH} deep (a cycle?)")
        return
    if isinstance(expected, torch.Tensor):
        out += _tensor(path, expected, actual)
        return
    state_dict = getattr(expected, "state_dict", None)
    if callable(state_dict) and not isinstance(expected, Mapping):
        other = getattr(actual, "state_dict", None)
        if not callable(other):
            out.append(f"{path}: a {type(actual).__name__}, without a state_dict()")
            return
        _walk(path, state_dict(), other(), depth + 1, out)
        return
    if isinstance(expected, Mapping):
        if not isinstance(actual, Mapping):
            out.append(f"{path}: a {type(actual).__name__}, not a mapping")
            return
        missing = [k for k in expected if k not in actual]
        extra = [k for k in actual if k not in expected]
        if missing:
            out.append(f"{path}: keys missing: {', '.join(map(repr, missing[:8]))}")
        if extra:
            out.append(f"{path}: keys not expected: {', '.join(map(repr, extra[:8]))}")
        for k in expected:
            if k in actual:
                _walk(f"{path}.{k}", expected[k], actual[k], depth + 1, out)
        return
    if isinstance(expected, (list, tuple)):
        if type(actual) is not type(expected):
            out.append(f"{path}: a {type(actual).__name__}, not a {type(expected).__name__}")
            return
        if len(actual) != len(expected):
            out.append(f"{path}: {len(actual)} items, not {len(expected)}")
            return
        for i, (e, a) in enumerate(zip(expected, actual)):
            _walk(f"{path}[{i}]", e, a, depth + 1, out)
        return
    if dataclasses.is_dataclass(expected) and not isinstance(expected, type):
        if type(actual) is not type(expected):
            out.append(f"{path}: a {type(actual).__name__}, not a {type(expected).__name__}")
            return
        for f in dataclasses.fields(expected):
            _walk(f"{path}.{f.name}", getattr(expected, f.name), getattr(actual, f.name), depth + 1, out)
        return
    out += _plain(path, expected, actual)


def state_differences(expected: Any, actual: Any, *, name: str = "state") -> list[str]:
    """Every place where ``actual`` differs from ``expected``, one line each, starting
    with its path from ``name`` (``state.model.0.weight: bytes differ``); an empty list
    when they are equal.

    Walks dicts (keys compared as sets, then each value), lists and tuples (type and
    length), dataclasses (field by field) and anything with a ``state_dict()`` method
    (a module, optimizer, scheduler or Stateful: by its state dict). Tensors are equal
    when dtype, shape and bytes are (bit-exact: -0.0 is not 0.0, a NaN equals itself;
    devices may differ; a DTensor compares its local shard). Other values: same type
    and ``==`` (a float NaN equals a NaN). Reads only; runs on the calling thread (a
    GPU tensor is copied to the host to compare it)."""
    out: list[str] = []
    _walk(name, expected, actual, 0, out)
    return out
