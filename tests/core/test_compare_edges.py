"""``state_differences`` on the tensors and arrays a state may hold (issue 41, section
2): a quantized tensor (it killed the interpreter), one-element tensors with a
non-unit stride (they raised), sparse, nested and meta tensors, and numpy arrays (equal
ones were reported different: numpy's RNG state among them)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch

from async_stager import state_differences

pytestmark = pytest.mark.timeout(60)


def _quantized(values: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated in torch 2.13
        return torch.quantize_per_tensor(values, 0.1, 3, torch.qint8)


def _per_channel(values: torch.Tensor, scales: list[float]) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.quantize_per_channel(
            values, torch.tensor(scales, dtype=torch.float64), torch.tensor([0, 1]), 0, torch.qint8
        )


def test_a_quantized_tensor_is_compared_not_fatal() -> None:
    # In a child: before the fix it killed the interpreter (a segfault).
    code = textwrap.dedent(
        """
        import warnings
        import torch
        from async_stager import state_differences
        warnings.simplefilter("ignore")
        q = torch.quantize_per_tensor(torch.arange(4.0), 0.1, 0, torch.qint8)
        print(state_differences({"q": q}, {"q": q.clone()}))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_quantized_tensors_differ_by_their_integers_or_their_quantization() -> None:
    q = _quantized(torch.arange(4.0))
    assert state_differences({"q": q}, {"q": q.clone()}) == []
    assert state_differences({"q": q}, {"q": _quantized(torch.arange(4.0) + 1)}) == [
        "state.q: integers differ"
    ]
    other = torch.quantize_per_tensor(torch.arange(4.0), 0.2, 3, torch.qint8)
    assert "state.q: scale differ" in state_differences({"q": q}, {"q": other})
    assert state_differences({"q": q}, {"q": q.dequantize()}) == [
        "state.q: dtype torch.float32, not torch.qint8"
    ]
    c = _per_channel(torch.ones(2, 3), [0.1, 0.2])
    assert state_differences({"c": c}, {"c": c.clone()}) == []
    assert state_differences({"c": c}, {"c": _per_channel(torch.ones(2, 3), [0.1, 0.3])}) == [
        "state.c: integers differ",  # the same values at another scale
        "state.c: scales differ",
    ]
    assert state_differences({"q": q}, {"q": c}) != []


def test_one_element_tensors_with_a_non_unit_stride() -> None:
    row = torch.randn(1, 3)
    assert state_differences({"x": row[:, 0]}, {"x": row[:, 0].clone()}) == []
    assert state_differences({"x": row[:, 0]}, {"x": row[:, 1]}) == ["state.x: bytes differ"]
    z = torch.randn(1, dtype=torch.complex64)
    assert state_differences({"x": z.imag}, {"x": z.imag.clone()}) == []
    assert state_differences({"x": z.real}, {"x": z.imag}) == ["state.x: bytes differ"]
    big = torch.randn(3, 3)
    assert state_differences({"x": big.t()}, {"x": big.t().contiguous()}) == []
    assert state_differences({"x": big[0, 0]}, {"x": big[0, 0].clone()}) == []


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.filterwarnings("ignore:.*nested tensors is in prototype")
def test_sparse_nested_and_meta_tensors() -> None:
    dense = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    for make in (lambda t: t.to_sparse(), lambda t: t.to_sparse_csr(), lambda t: t.to_sparse_csc()):
        s = make(dense)
        assert state_differences({"s": s}, {"s": make(dense.clone())}) == []
        assert state_differences({"s": s}, {"s": make(dense * 2)}) == ["state.s: values differ"]
    assert state_differences({"s": dense.to_sparse()}, {"s": dense}) == [
        "state.s: a strided tensor, not a sparse_coo one"
    ]
    n = torch.nested.nested_tensor([torch.ones(2), torch.zeros(3)])
    assert state_differences({"n": n}, {"n": n.clone()}) == []
    other = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    assert state_differences({"n": n}, {"n": other}) == ["state.n[1]: bytes differ"]
    m = torch.empty(3, device="meta")
    assert state_differences({"m": m}, {"m": torch.empty(3, device="meta")}) == []
    assert state_differences({"m": m}, {"m": torch.zeros(3)}) == ["state.m: a strided tensor, not a meta one"]


def test_numpy_arrays_and_scalars() -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert state_differences({"a": a}, {"a": a.copy()}) == []
    assert state_differences({"a": a}, {"a": a + 1}) == ["state.a: bytes differ"]
    assert state_differences({"a": a}, {"a": a.astype(np.float64)}) == ["state.a: dtype float64, not float32"]
    assert state_differences({"a": a}, {"a": a.reshape(3, 2)}) == ["state.a: shape (3, 2), not (2, 3)"]
    assert state_differences({"a": a}, {"a": a.tolist()}) == ["state.a: a list, not a ndarray"]
    assert state_differences({"a": np.array([np.nan])}, {"a": np.array([np.nan])}) == []  # as tensors
    assert state_differences({"a": np.float32("nan")}, {"a": np.float32("nan")}) == []
    assert state_differences({"a": np.float32(0.0)}, {"a": np.float32(-0.0)}) == ["state.a: bytes differ"]
    objects = np.array([{"k": 1}, "s"], dtype=object)
    assert state_differences({"o": objects}, {"o": objects.copy()}) == []
    assert state_differences({"o": objects}, {"o": np.array([{"k": 2}, "s"], dtype=object)}) == [
        "state.o[0].k: 2, not 1"
    ]
    rng = np.random.RandomState(7)
    state = rng.get_state()
    assert state_differences({"rng": state}, {"rng": np.random.RandomState(7).get_state()}) == []
    rng.random_sample()
    assert state_differences({"rng": state}, {"rng": rng.get_state()}) != []
    gen = np.random.default_rng(3)
    assert (
        state_differences({"g": gen.bit_generator.state}, {"g": np.random.default_rng(3).bit_generator.state})
        == []
    )
