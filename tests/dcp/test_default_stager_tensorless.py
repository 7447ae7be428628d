"""DefaultStager: a stage that copies no tensor needs no buffer set (issue 41, section 3),
as PyTorch's ``test_multiple_staging_operations`` uses it: three staged results kept,
the third without tensors."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from async_stager import CheckpointStagerConfig, DefaultStager

pytestmark = pytest.mark.timeout(60)

#: Long enough that a stage which waits for a set fails by its error, not its time.
WAIT = 2.0

SYNC = CheckpointStagerConfig(
    use_async_staging=False, use_pinned_memory=False, use_shared_memory=False, use_non_blocking_copy=False
)


def three() -> list[dict[str, Any]]:
    return [
        {"model1": torch.nn.Linear(5, 3).state_dict()},
        {"model2": torch.nn.Conv2d(3, 16, 3).state_dict()},
        {"optimizer": {"lr": 0.001, "momentum": 0.9}},
    ]


def test_three_results_kept_the_third_without_tensors() -> None:
    state_dicts = three()
    # As few sets as results with tensors: the old code raised BuffersHeldError here.
    with DefaultStager(SYNC, max_buffer_sets=2, buffer_wait_timeout=WAIT) as stager:
        results: list[Any] = [stager.stage(sd) for sd in state_dicts]
        assert results[2] == {"optimizer": {"lr": 0.001, "momentum": 0.9}}
        assert stager.get_staged_state_dict() == results[2]
        for sd, result in zip(state_dicts, results):
            assert isinstance(result, dict) and result.keys() == sd.keys()
        assert torch.equal(results[1]["model2"]["weight"], state_dicts[1]["model2"]["weight"])
        assert torch.equal(results[0]["model1"]["bias"], state_dicts[0]["model1"]["bias"])


def test_no_set_made_and_no_warning_for_stages_without_tensors(caplog: pytest.LogCaptureFixture) -> None:
    state_dicts = three()
    with caplog.at_level(logging.WARNING, logger="async_stager.stage"), DefaultStager(SYNC) as stager:
        results = [stager.stage(sd) for sd in state_dicts[:2]]
        held = stager.host_bytes
        results += [stager.stage(state_dicts[2]), stager.stage({"epoch": 5}), stager.stage({"epoch": 6})]
        assert stager.host_bytes == held
        assert results[-1] == {"epoch": 6}
    # A third set would have logged that the stager holds more sets than usual.
    assert not [r for r in caplog.records if "buffer sets" in r.getMessage()]


def test_async_future_of_a_stage_without_tensors() -> None:
    g = torch.Generator().manual_seed(0)
    sd = {"w": torch.randn(8, generator=g)}
    with DefaultStager(max_buffer_sets=1, buffer_wait_timeout=WAIT) as stager:
        first = stager.stage(sd)
        assert not isinstance(first, dict)
        held = first.result(timeout=30)
        fut = stager.stage({"step": 9})
        assert not isinstance(fut, dict)
        assert fut.result(timeout=30) == {"step": 9}
        stager.synchronize_staging()
        assert torch.equal(held["w"], sd["w"])
