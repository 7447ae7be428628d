"""What Checkpointer.save takes (issue 41, section 4), as Stager.stage and dcp.save: a
dict of str keys, whose top-level module or optimizer is saved as its state_dict();
anything else at the top is a CheckpointError naming state_dict() where it helps, and a
module or optimizer below the top level is refused (InvalidStateDictError, its path)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from async_stager import Checkpointer, CheckpointError
from async_stager.errors import InvalidStateDictError

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


async def test_save_refuses_what_is_not_a_state_and_stays_usable(tmp_path: Path, anyio_backend: Any) -> None:
    model = torch.nn.Linear(3, 2)
    async with Checkpointer(tmp_path) as ckpt:
        for value in (42, None, "hello"):
            with pytest.raises(CheckpointError):
                await ckpt.save(value, step=1)  # type: ignore[arg-type]
        with pytest.raises(CheckpointError) as ei:
            await ckpt.save(model, step=1)  # type: ignore[arg-type]
        assert "state_dict()" in str(ei.value)
        with pytest.raises(InvalidStateDictError) as ej:
            await ckpt.save({"models": [model]}, step=1)
        assert ej.value.path == ("models", 0)
        await ckpt.save({"model": model, "step": 3}, step=2)
        await ckpt.wait()
        assert ckpt.steps() == [2]
