"""Test helpers: synchronous staging through the engine, deep comparisons."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from async_stager._core.run.engine import Engine
from async_stager._core.run.make import build_engine
from async_stager._core.run.records import StageRecord


def make_engine(**opts: Any) -> Engine:
    return build_engine(**opts)


def stage_sync(engine: Engine, sd: Any, **kw: Any) -> StageRecord:
    """Stage on the calling thread and wait for the copies."""
    staged = engine.run(sd, engine.capture(), **kw)
    for c in staged.completions:
        c.synchronize()
    engine.settle(staged)
    return staged


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's raw bytes (for bit-exact comparison of any dtype, NaNs included)."""
    t = t.detach().resolve_conj()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    # A fresh tensor with standard strides: contiguous() may return a view whose
    # size-1 dims keep odd strides, which the byte view below refuses.
    c = torch.empty(t.shape, dtype=t.dtype).copy_(t)
    return c.reshape(-1).view(torch.uint8)


def assert_same(a: Any, b: Any, path: str = "sd") -> None:
    """Deep equality: same types and structure, bit-equal tensors with the same
    sizes, strides, offsets, dtype and class."""
    assert type(a) is type(b), f"{path}: {type(a)} vs {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, path
        assert a.shape == b.shape, path
        assert a.stride() == b.stride(), path
        assert a.storage_offset() == b.storage_offset(), path
        assert a.requires_grad == b.requires_grad, path
        assert torch.equal(bits(a), bits(b)), f"{path}: values differ"
        return
    if isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
        return
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
        return
    if dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
        return
    assert a == b, path


def tensors_of(obj: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            out.extend(tensors_of(v))
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            out.extend(tensors_of(v))
    return out


def assert_no_alias(staged: Any, source: Any) -> None:
    """No staged tensor shares memory with any source tensor."""
    src_ptrs = {t.untyped_storage().data_ptr() for t in tensors_of(source) if t.numel()}
    for t in tensors_of(staged):
        if t.numel():
            assert t.untyped_storage().data_ptr() not in src_ptrs


def assert_equal(a: Any, b: Any) -> None:
    """Nested dicts of tensors and plain values are equal: same keys, tensors
    ``torch.equal``, other values ``==`` (a restored state against what was saved)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_equal(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b
