"""The stagers given to DCP the wrong way, and the drop-in on a machine without CUDA:
a plain ``Stager`` as ``async_save``'s ``async_stager`` is a TypeError at the call
that names the way to go (no coroutine left un-awaited, nothing staged), and the
``DefaultStager`` asked for pinned memory without CUDA warns and stages (as
torch_checkpointing's stager does)."""

from __future__ import annotations

import asyncio
import gc
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_same

from async_stager import CheckpointStagerConfig, DefaultStager, Stager

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]


def test_a_plain_stager_given_to_async_save_is_a_type_error(tmp_path: Path) -> None:
    sd = {"w": torch.arange(16.0)}

    async def main() -> None:
        async with Stager() as stager:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # a never-awaited coroutine warning fails here
                with pytest.raises(TypeError) as e:
                    dcp.async_save(sd, checkpoint_id=str(tmp_path / "ck"), async_stager=stager, no_dist=True)  # type: ignore[arg-type]
                gc.collect()
            msg = str(e.value)
            assert "DefaultStager" in msg and "async_stager.dcp.save" in msg
            # The stager is untouched and stays usable.
            staged = await stager.stage(sd)
            assert_same(staged, sd)

    asyncio.run(main())
    assert not list(tmp_path.glob("ck/*.distcp"))  # nothing was written


def test_a_plain_stager_called_from_sync_code_still_works() -> None:
    """Only DCP's call is refused: ``asyncio.run(stager.stage(sd))`` makes the coroutine
    outside any loop, and is fine."""
    sd = {"w": torch.arange(4.0)}

    async def make() -> Stager:
        return Stager()

    stager = asyncio.run(make())
    try:
        staged = asyncio.run(stager.stage(sd))
        assert_same(staged, sd)
    finally:
        asyncio.run(stager.aclose())


def test_default_stager_through_async_save_with_pinned_memory_asked_on_cpu(tmp_path: Path) -> None:
    """torchtitan's config (``use_pinned_memory=True``) on a CPU-only machine: a warning,
    then a checkpoint DCP loads back."""
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only behaviour")
    sd = {"w": torch.randn(64), "b": torch.randn(8)}
    with pytest.warns(UserWarning, match="Ignoring use_pinned_memory=True"):
        stager = DefaultStager(CheckpointStagerConfig(use_pinned_memory=True))
    with stager:
        resp: Any = dcp.async_save(sd, checkpoint_id=str(tmp_path / "ck"), async_stager=stager, no_dist=True)
        upload = resp.upload_completion if not isinstance(resp, Future) else resp
        upload.result(timeout=30)
    back = {"w": torch.zeros(64), "b": torch.zeros(8)}
    dcp.load(back, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    assert_same(back, sd)


def test_the_wrong_stager_the_other_way_is_a_type_error(tmp_path: Path) -> None:
    """Siblings: a DefaultStager (or anything else) given where a Stager is needed
    (``async_stager.dcp.save``, ``Checkpointer(stager=...)``) is a TypeError naming
    what is needed, at the call, not an AttributeError later."""
    import async_stager.dcp as adcp
    from async_stager import Checkpointer, InvalidOptionError

    with DefaultStager(CheckpointStagerConfig(use_async_staging=False, use_pinned_memory=False)) as ds:
        with pytest.raises(TypeError, match="DefaultStager") as e:
            adcp.save({"w": torch.ones(2)}, stager=ds, checkpoint_id=str(tmp_path / "x"))  # type: ignore[arg-type,unused-coroutine]
        assert isinstance(e.value, InvalidOptionError) and "async_save" in str(e.value)
        with pytest.raises(TypeError, match=r"stager must be an async_stager\.Stager"):
            Checkpointer(tmp_path / "ck", stager=ds)  # type: ignore[arg-type]
