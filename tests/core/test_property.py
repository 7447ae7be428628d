"""Property tests: random nested structures with shared views stage faithfully."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import STRESS
from helpers import assert_same, make_engine, stage_sync
from hypothesis import HealthCheck, given, settings, strategies as st

from async_stager.testing import FakeBackend

pytestmark = pytest.mark.timeout(120)

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.bool, torch.complex64]


@st.composite
def tensor_pool(draw: st.DrawFn) -> list[torch.Tensor]:
    """Base tensors and views of them (slices, transposes, expands, reshapes)."""
    n = draw(st.integers(1, 4))
    pool: list[torch.Tensor] = []
    for _ in range(n):
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))
        seed = draw(st.integers(0, 2**16))
        g = torch.Generator().manual_seed(seed)
        raw = torch.randint(
            0, 256, (max(1, int(torch.Size(shape).numel())) * 16,), generator=g, dtype=torch.uint8
        )
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if dtype == torch.bool:
            base = (raw[: torch.Size(shape).numel()] % 2 == 1).reshape(shape)
        else:
            numel = torch.Size(shape).numel()
            base = raw[: numel * itemsize].view(dtype).reshape(shape)
        pool.append(base)
        for _ in range(draw(st.integers(0, 3))):
            kind = draw(st.sampled_from(["slice", "t", "expand", "flat", "same"]))
            if kind == "slice" and base.dim() and base.shape[0] > 1:
                pool.append(base[1:])
            elif kind == "t" and base.dim() >= 2:
                pool.append(base.transpose(0, 1))
            elif kind == "expand" and base.dim() >= 1 and base.shape[0] == 1:
                pool.append(base.expand(3, *base.shape[1:]))
            elif kind == "flat" and base.is_contiguous():
                pool.append(base.reshape(-1))
            else:
                pool.append(base)
    return pool


def structures(pool: list[torch.Tensor]) -> st.SearchStrategy[Any]:
    leaves = st.one_of(
        st.sampled_from(pool),
        st.integers(-5, 5),
        st.text(max_size=3),
        st.none(),
        st.floats(allow_nan=False, width=32),
    )
    return st.recursive(
        leaves,
        lambda children: st.one_of(
            st.lists(children, max_size=4),
            st.tuples(children, children),
            st.dictionaries(st.text(min_size=1, max_size=3), children, max_size=4),
        ),
        max_leaves=20,
    )


def _tensors(obj: Any, out: list[torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _tensors(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _tensors(v, out)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr() if t.untyped_storage().nbytes() else -id(t)


@st.composite
def state_dicts(draw: st.DrawFn) -> Any:
    pool = draw(tensor_pool())
    return {"root": draw(structures(pool))}


@pytest.mark.parametrize("kind", ["cpu", "shared", "fake-device"])
@settings(
    max_examples=300 if STRESS else 30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(sd=state_dicts())
def test_random_structures_stage_faithfully(kind: str, sd: Any) -> None:
    if kind == "cpu":
        engine = make_engine()
    elif kind == "shared":
        engine = make_engine(share_memory=True)
    else:
        engine = make_engine(backend=FakeBackend())
    try:
        for _ in range(2):  # cold, then the fast path
            staged = stage_sync(engine, sd).result
            assert_same(staged, sd)
            src: list[torch.Tensor] = []
            out: list[torch.Tensor] = []
            _tensors(sd, src)
            _tensors(staged, out)
            assert len(src) == len(out)
            # Same sharing: two leaves share a staged storage iff their sources share one.
            for i in range(len(src)):
                for j in range(i + 1, len(src)):
                    if src[i].untyped_storage().nbytes() == 0:
                        continue
                    same_src = _storage_key(src[i]) == _storage_key(src[j])
                    same_out = _storage_key(out[i]) == _storage_key(out[j])
                    assert same_src == same_out, (i, j)
                    assert (src[i] is src[j]) == (out[i] is out[j]), (i, j)
            # Never aliases a source.
            src_ptrs = {_storage_key(t) for t in src if t.untyped_storage().nbytes()}
            assert not any(_storage_key(t) in src_ptrs for t in out if t.untyped_storage().nbytes())
    finally:
        engine.close()
