"""State handling for the Checkpointer: Stateful objects as DCP treats them, loading
in place, and the ``torch`` format's file."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from . import _integrity
from ._errors import CheckpointError

__all__ = ["TORCH_FILE", "assign", "is_stateful", "resolve", "staged_bytes", "torch_write"]

#: The single file of the ``torch`` format, inside the step folder.
TORCH_FILE = "state.pt"


def is_stateful(value: Any) -> bool:
    return (
        not isinstance(value, torch.Tensor)
        and callable(getattr(value, "state_dict", None))
        and callable(getattr(value, "load_state_dict", None))
    )


def resolve(state: dict[str, Any]) -> dict[str, Any]:
    """What DCP does with a Stateful top-level value: call its ``state_dict()`` now."""
    if not isinstance(state, dict):
        raise CheckpointError(f"state must be a dict of str keys, got {type(state).__name__}")
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


def torch_write(staged: dict[str, Any], path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(staged, f)
        f.flush()
        os.fsync(f.fileno())
