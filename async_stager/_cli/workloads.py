"""Synthetic state dicts for the benchmark: realistic shapes, scalable sizes.

Four workloads, each a function ``(scale, device) -> state dict``:

- ``transformer``: a decoder-only transformer's model state plus AdamW optimizer state
  (``exp_avg``, ``exp_avg_sq`` and a scalar ``step`` per parameter), in the layout
  ``{"model": ..., "optim": {"state": ..., "param_groups": ...}}`` that
  ``torch.optim.Optimizer.state_dict()`` produces: a few large matrices and many small
  norms, biases and scalars. At scale 1: 8 layers, hidden 512, vocabulary 8192,
  29.4 M parameters, 336.6 MiB in 396 tensors.
- ``fresh``: the transformer's state, but every stage gets new tensors (the same
  values in new storages, the previous ones dropped): a full state dict or a
  converting state-dict hook. Host memory must be reused by layout, not identity;
  compare its cached time with ``transformer``'s in the same run.
- ``small20k``: 20,000 tensors of 16 float32 (64 bytes each): pure per-tensor cost,
  where a Python walk per tensor dominates (DCP's weak spot).
- ``large1g``: 1 GiB in 64 tensors of 16 MiB: pure bandwidth.

``scale`` multiplies the bytes (the tensor count for ``small20k``). Tensors are filled
with constants (``fill_``), not random numbers: the content does not matter for a copy,
but every page must be touched so the first stage does not pay the source's page faults.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["WORKLOADS", "Workload", "count_tensors", "describe_transformer", "renew"]

#: Bytes of a float32 element.
F32 = 4

MiB = 1024 * 1024


@dataclass(frozen=True)
class Workload:
    """A named state-dict builder; ``description`` is one line for the docs and table."""

    name: str
    description: str
    build: Callable[[float, torch.device], dict[str, Any]]
    #: ``(tensors, bytes)`` that ``build`` makes at a scale, computed without building
    #: (what ``count_tensors`` would say): the benchmark refuses a scale the machine's
    #: memory cannot hold before it starts.
    footprint: Callable[[float], tuple[int, int]]
    #: Cached runs are ``runs * runs_factor``: bandwidth-bound workloads are the noisiest
    #: on a shared machine and their stages are cheap to repeat.
    runs_factor: int = 1
    #: Every stage gets new tensors (``renew``: the same values in new storages, the
    #: previous ones dropped first), as a full state dict or a converting state-dict
    #: hook makes them: host memory must be reused by layout, not by identity.
    fresh: bool = False


def _filled(shape: tuple[int, ...], value: float, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.float32, device=device).fill_(value)


def _transformer_dims(scale: float) -> tuple[int, int, int, int]:
    """(layers, hidden, vocabulary, ffn) at ``scale``."""
    layers = max(1, round(8 * scale))
    shrink = min(1.0, math.sqrt(8 * scale)) if scale < 0.125 else 1.0
    hidden = max(8, int(512 * shrink) // 8 * 8)
    vocab = max(16, int(8192 * shrink) // 8 * 8)
    return layers, hidden, vocab, 4 * hidden


def transformer_footprint(scale: float) -> tuple[int, int]:
    """(tensors, bytes) of ``build_transformer(scale)``: per parameter tensor, itself,
    ``exp_avg``, ``exp_avg_sq`` (same size) and a scalar ``step``."""
    layers, h, vocab, ffn = _transformer_dims(scale)
    per_layer = 2 * h + 3 * h * h + 3 * h + h * h + h + 2 * h + ffn * h + ffn + h * ffn + h
    params = vocab * h + layers * per_layer + 2 * h
    model_tensors = 1 + 12 * layers + 2
    return 4 * model_tensors, F32 * (3 * params + model_tensors)


def describe_transformer(scale: float) -> str:
    """What ``build_transformer(scale)`` builds, computed without building it:
    ``2 layers, hidden 512, vocabulary 8192: 10.5M parameters, 108 tensors, 120.2 MiB``."""
    layers, hidden, vocab, _ = _transformer_dims(scale)
    tensors, nbytes = transformer_footprint(scale)
    params = (nbytes // F32 - tensors // 4) // 3
    count = f"{params / 1e6:.1f}M" if params >= 10**5 else f"{params:,}"
    layer_s = "layer" if layers == 1 else "layers"
    return (
        f"{layers} {layer_s}, hidden {hidden}, vocabulary {vocab}: {count} parameters, "
        f"{tensors} tensors, {nbytes / MiB:.1f} MiB"
    )


def build_transformer(scale: float, device: torch.device) -> dict[str, Any]:
    """A transformer with AdamW state; layers grow with ``scale`` above 1/8, the hidden
    size and vocabulary shrink (by the square root) below it, so bytes follow ``scale``."""
    layers, hidden, vocab, ffn = _transformer_dims(scale)
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "ln1.weight": (hidden,),
                p + "ln1.bias": (hidden,),
                p + "attn.qkv.weight": (3 * hidden, hidden),
                p + "attn.qkv.bias": (3 * hidden,),
                p + "attn.out.weight": (hidden, hidden),
                p + "attn.out.bias": (hidden,),
                p + "ln2.weight": (hidden,),
                p + "ln2.bias": (hidden,),
                p + "mlp.fc1.weight": (ffn, hidden),
                p + "mlp.fc1.bias": (ffn,),
                p + "mlp.fc2.weight": (hidden, ffn),
                p + "mlp.fc2.bias": (hidden,),
            }
        )
    shapes["norm.weight"] = (hidden,)
    shapes["norm.bias"] = (hidden,)
    model = {name: _filled(shape, 0.01 * (i % 97), device) for i, (name, shape) in enumerate(shapes.items())}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for i, t in enumerate(model.values()):
        state[i] = {
            "step": torch.tensor(1000.0, device=device),
            "exp_avg": _filled(tuple(t.shape), 1e-3, device),
            "exp_avg_sq": _filled(tuple(t.shape), 1e-6, device),
        }
    groups = [
        {
            "lr": 3e-4,
            "betas": (0.9, 0.95),
            "eps": 1e-8,
            "weight_decay": 0.1,
            "amsgrad": False,
            "params": list(range(len(model))),
        }
    ]
    return {"model": model, "optim": {"state": state, "param_groups": groups}, "step": 1000}


def _small_count(scale: float) -> int:
    return max(1, round(20_000 * scale))


def small_footprint(scale: float) -> tuple[int, int]:
    n = _small_count(scale)
    return n, n * 16 * F32


def build_small(scale: float, device: torch.device) -> dict[str, Any]:
    """``20000 * scale`` tensors of 16 float32 each (at least one)."""
    n = _small_count(scale)
    return {f"t{i}": _filled((16,), float(i % 7), device) for i in range(n)}


def _large_numel(scale: float) -> int:
    return max(1, round(16 * MiB * scale) // F32)


def large_footprint(scale: float) -> tuple[int, int]:
    return 64, 64 * _large_numel(scale) * F32


def build_large(scale: float, device: torch.device) -> dict[str, Any]:
    """64 tensors of ``16 MiB * scale`` each (float32; 1 GiB in all at scale 1)."""
    numel = _large_numel(scale)
    return {f"w{i}": _filled((numel,), float(i), device) for i in range(64)}


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            "transformer",
            "8-layer transformer (hidden 512) with AdamW state: large matrices, many norms/biases",
            build_transformer,
            transformer_footprint,
        ),
        Workload("small20k", "20,000 tensors of 16 float32 (per-tensor cost)", build_small, small_footprint),
        Workload(
            "large1g",
            "1 GiB in 64 tensors of 16 MiB (bandwidth)",
            build_large,
            large_footprint,
            runs_factor=2,
        ),
        Workload(
            "fresh",
            "the transformer, new tensors every checkpoint (a full state dict rebuilt)",
            build_transformer,
            transformer_footprint,
            fresh=True,
        ),
    )
}


def renew(obj: Any) -> Any:
    """A copy of a nested dict/list of tensors whose every tensor is new (``clone``):
    the same values, new storages, as a state dict rebuilt for each checkpoint."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: renew(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [renew(v) for v in obj]
    return obj


def count_tensors(obj: Any) -> tuple[int, int]:
    """(tensors, bytes) in a nested dict/list/tuple; bytes of each tensor's elements."""
    if isinstance(obj, torch.Tensor):
        return 1, obj.numel() * obj.element_size()
    items: Any
    if isinstance(obj, dict):
        items = obj.values()
    elif isinstance(obj, (list, tuple)):
        items = obj
    else:
        return 0, 0
    n = b = 0
    for v in items:
        dn, db = count_tensors(v)
        n += dn
        b += db
    return n, b
