"""A stage that copies no tensor needs no buffer set (issue 41, section 3).

PyTorch's ``test_multiple_staging_operations`` keeps three staged results, the third
without tensors; with every set holding a result, that third stage used to wait for a
set and raise BuffersHeldError. It holds no host memory of the stager, so it takes no
set: it never waits, never makes a set, and leaves the sets' plans as they were.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from async_stager import (
    BuffersHeldError,
    Stager,
    UncopyableObjectError,
)

pytestmark = pytest.mark.timeout(60)

#: Long enough that a stage which waits for a set fails the test by its error, not by
#: its time; short enough that the old code's wait costs little.
WAIT = 2.0


def model_sd(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(16, 16, generator=g), "b": torch.randn(16, generator=g)}


def no_tensors() -> dict[str, Any]:
    return {"step": 3, "lr": 1e-3, "nested": {"names": ["a", "b"], "pair": (1, 2)}, "tag": "run-7"}


@pytest.mark.anyio
async def test_a_stage_without_tensors_while_every_set_holds_a_result(anyio_backend: Any) -> None:
    async with Stager(max_buffer_sets=2, buffer_wait_timeout=WAIT) as stager:
        kept = [await stager.stage(model_sd(0)), await stager.stage(model_sd(1))]
        assert stager.buffer_sets == 2
        sd = no_tensors()
        staged: Any = await stager.stage(sd)
        assert staged == sd
        # A copy, as for any stage: changing it leaves the source alone.
        assert staged is not sd and staged["nested"] is not sd["nested"]
        staged["nested"]["names"].append("c")
        assert sd["nested"]["names"] == ["a", "b"]
        stats = stager.stats
        assert stats is not None and stats.tensors == 0 and stats.bytes == 0
        assert stats.buffer_set == -1  # no set taken
        assert stager.buffer_sets == 2
        # A lease and a snapshot of such a state dict: no set either, released as usual.
        lease = await stager.lease(sd)
        assert lease.state_dict == sd
        lease.release()
        assert lease.released
        async with stager.snapshot(sd) as snap:
            assert snap == sd
        assert snap == {}
        # The kept results are untouched.
        assert torch.equal(kept[0]["w"], model_sd(0)["w"])
        assert torch.equal(kept[1]["w"], model_sd(1)["w"])


@pytest.mark.anyio
async def test_a_stage_with_tensors_still_waits_for_a_set(anyio_backend: Any) -> None:
    async with Stager(max_buffer_sets=1, buffer_wait_timeout=0.2) as stager:
        kept = await stager.stage(model_sd(0))
        # Its tensor comes after an object and a container: still found, still waits.
        with pytest.raises(BuffersHeldError):
            await stager.stage({"step": 1, "cfg": {"a": [1, 2]}, "model": model_sd(1)})
        del kept
        again: Any = await stager.stage({"step": 1, "model": model_sd(1)})
        assert torch.equal(again["model"]["w"], model_sd(1)["w"])


@pytest.mark.anyio
async def test_stages_without_tensors_make_no_set_and_keep_the_plans(anyio_backend: Any) -> None:
    async with Stager(max_buffer_sets=3, buffer_wait_timeout=WAIT) as stager:
        sd = model_sd(0)
        held = await stager.stage(sd)
        for _ in range(3):
            # Set 0 holds a result: the old code made a set for each of these.
            assert await stager.stage(no_tensors()) == no_tensors()
        assert stager.buffer_sets == 1
        del held
        # Set 0 is free now: a stage without tensors that takes it leaves it as it was,
        # so the next stage of the model reuses its plan (fast path) in set 0.
        for _ in range(6):
            assert await stager.stage({"step": 4}) == {"step": 4}
            assert stager.stats is not None and stager.stats.buffer_set == -1
        staged = await stager.stage(sd)
        stats = stager.stats
        assert stats is not None and stats.fast_path and stats.buffer_set == 0
        assert torch.equal(staged["b"], sd["b"])
        assert stager.buffer_sets == 1


@pytest.mark.anyio
async def test_bad_input_without_tensors_is_typed_while_every_set_is_held(anyio_backend: Any) -> None:
    async with Stager(max_buffer_sets=1, buffer_wait_timeout=WAIT) as stager:
        held = await stager.stage(model_sd(0))
        with pytest.raises(UncopyableObjectError) as ei:
            await stager.stage({"step": 3, "lock": threading.Lock()})
        assert ei.value.path == ("lock",)
        assert await stager.stage({"step": 5}) == {"step": 5}
        assert torch.equal(held["w"], model_sd(0)["w"])
