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
import sys
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["state_differences"]

#: Nesting beyond which a structure is reported instead of walked (a cycle, or a
#: structure no state dict has).
_MAX_DEPTH = 200


def _host_bytes(t: torch.Tensor) -> torch.Tensor:
    """A strided tensor's logical bytes as a flat uint8 CPU tensor (lazy conj/neg bits
    and strides resolved; no copy of a contiguous CPU tensor). A one-element tensor
    with a non-unit stride (``x[:, 0]`` of a one-row matrix, ``.imag`` of a one-element
    complex) counts as contiguous, and ``contiguous()`` keeps its stride, which a byte
    view refuses: that one is copied."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    flat = t.to("cpu").contiguous().reshape(-1)
    if flat.numel() and flat.stride(0) != 1:
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8)


def _parts(t: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
    """A tensor that is not plain strided data, as the plain tensors it is made of (a
    quantized tensor's integers and its quantization, a sparse tensor's indices and
    values), compared part by part; None for a plain strided tensor."""
    if t.is_quantized:
        scheme = t.qscheme()
        parts = [("integers", t.int_repr())]
        if scheme in (torch.per_tensor_affine, torch.per_tensor_symmetric):
            parts += [
                ("scale", torch.tensor(t.q_scale(), dtype=torch.float64)),
                ("zero point", torch.tensor(t.q_zero_point())),
            ]
        else:
            parts += [
                ("scales", t.q_per_channel_scales()),
                ("zero points", t.q_per_channel_zero_points()),
                ("axis", torch.tensor(t.q_per_channel_axis())),
            ]
        return parts
    if t.layout == torch.sparse_coo:
        c = t.coalesce()
        return [("indices", c.indices()), ("values", c.values())]
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [("row offsets", t.crow_indices()), ("columns", t.col_indices()), ("values", t.values())]
    if t.layout in (torch.sparse_csc, torch.sparse_bsc):
        return [("column offsets", t.ccol_indices()), ("rows", t.row_indices()), ("values", t.values())]
    return None


def _kind(t: torch.Tensor) -> str:
    if t.is_quantized:
        return f"quantized ({t.qscheme()})"
    if t.is_nested:
        return "nested"
    if t.is_meta:
        return "meta"
    return str(t.layout).removeprefix("torch.")


def _tensor(path: str, expected: torch.Tensor, actual: Any) -> list[str]:
    if not isinstance(actual, torch.Tensor):
        return [f"{path}: a {type(actual).__name__}, not a tensor"]
    local = getattr(expected, "to_local", None)
    if callable(local) and type(expected) is not torch.Tensor:
        expected = local()  # a DTensor: its local shard
    local = getattr(actual, "to_local", None)
    if callable(local) and type(actual) is not torch.Tensor:
        actual = local()
    if actual.dtype != expected.dtype:
        return [f"{path}: dtype {actual.dtype}, not {expected.dtype}"]
    if _kind(actual) != _kind(expected):
        return [f"{path}: a {_kind(actual)} tensor, not a {_kind(expected)} one"]
    if expected.is_nested:
        # (a nested tensor has no shape to compare: its components do)
        mine, theirs = expected.unbind(), actual.unbind()
        if len(mine) != len(theirs):
            return [f"{path}: {len(theirs)} nested tensors, not {len(mine)}"]
        out: list[str] = []
        for i, (e, a) in enumerate(zip(mine, theirs)):
            out += _tensor(f"{path}[{i}]", e, a)
        return out
    if tuple(actual.shape) != tuple(expected.shape):
        return [f"{path}: shape {tuple(actual.shape)}, not {tuple(expected.shape)}"]
    if expected.is_meta:
        return []  # no data: equal dtype and shape are all there is
    parts = _parts(expected)
    if parts is not None:
        theirs_parts = dict(_parts(actual) or [])
        out = []
        for name, part in parts:
            if _tensor(path, part, theirs_parts.get(name)):
                out.append(f"{path}: {name} differ")
        return out
    if not torch.equal(_host_bytes(actual), _host_bytes(expected)):
        return [f"{path}: bytes differ"]
    return []


def _numpy(path: str, expected: Any, actual: Any) -> list[str] | None:
    """A numpy array or scalar compared as a tensor is (dtype, shape, bytes: a NaN
    equals itself, -0.0 is not 0.0); one holding Python objects item by item. None
    for a value that is not numpy's."""
    np = sys.modules.get("numpy")
    if np is None or not isinstance(expected, (np.ndarray, np.generic)):
        return None
    if type(actual) is not type(expected):
        return [f"{path}: a {type(actual).__name__}, not a {type(expected).__name__}"]
    if actual.dtype != expected.dtype:
        return [f"{path}: dtype {actual.dtype}, not {expected.dtype}"]
    if actual.shape != expected.shape:
        return [f"{path}: shape {actual.shape}, not {expected.shape}"]
    if expected.dtype.hasobject:
        out: list[str] = []
        _walk(path, expected.tolist(), actual.tolist(), 1, out)
        return out
    return [] if actual.tobytes() == expected.tobytes() else [f"{path}: bytes differ"]


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
    arrays = _numpy(path, expected, actual)
    if arrays is not None:
        out += arrays
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
    devices may differ; a DTensor compares its local shard; a quantized tensor its
    integers and quantization, a sparse one its indices and values, a nested one its
    components, a meta one only dtype and shape). A numpy array or scalar compares as
    a tensor does (one of Python objects item by item). Other values: same type
    and ``==`` (a float NaN equals a NaN). Reads only; runs on the calling thread (a
    GPU tensor is copied to the host to compare it)."""
    out: list[str] = []
    _walk(name, expected, actual, 0, out)
    return out
