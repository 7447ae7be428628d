"""Errors that must show their cause (issue 36, section 3), through the public API:
exceptions raised inside ``async with Shutdown()`` come out as raised; a checkpoint
write on a full disk says so and names the file (both formats, the OSError chained);
the torch format refuses a restore whose structure differs, as DCP does; an abandoned
``saved()`` iterator holds nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from async_stager import Checkpointer, Shutdown

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]


class Mine(Exception):
    pass


@pytest.mark.parametrize("error", [ValueError("bad value"), KeyError("k"), Mine("mine")])
async def test_an_error_inside_shutdown_comes_out_as_raised(anyio_backend: Any, error: Exception) -> None:
    with pytest.raises(type(error)) as e:
        async with Shutdown():
            raise error
    assert e.value is error  # not an ExceptionGroup around it


async def test_an_error_inside_checkpointer_and_shutdown_comes_out_as_raised(
    anyio_backend: Any, tmp_path: Path
) -> None:
    """The documented service shape: ``except ValueError`` around it keeps working."""
    caught = None
    try:
        async with Checkpointer(tmp_path) as ckpt, Shutdown() as stop:
            await ckpt.save({"w": torch.ones(4)}, step=1)
            assert not stop.requested
            raise ValueError("in the loop")
    except ValueError as e:
        caught = e
    assert caught is not None and str(caught) == "in the loop"
    assert ckpt.steps() == [1]  # the save in flight was still committed
    async with Shutdown():  # usable again, handlers back
        pass
