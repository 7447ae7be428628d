"""DefaultStager's staged tensors and torch's shared-memory calls, as PyTorch's
``test_tensor_pinned_and_shared`` checks them (issue 41, section 3): ``is_shared()``
is what the config asked for, and ``share_memory_()`` keeps later stages in the
stager's memory."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from async_stager import CheckpointStagerConfig, DefaultStager

pytestmark = pytest.mark.timeout(60)


def config(shared: bool) -> CheckpointStagerConfig:
    return CheckpointStagerConfig(
        use_async_staging=False,
        use_pinned_memory=False,
        use_shared_memory=shared,
        use_non_blocking_copy=False,
    )


@pytest.mark.parametrize("shared", [False, True])
def test_is_shared_is_what_the_config_asked_for(shared: bool) -> None:
    sd = {"tensor1": torch.randn(4, 4), "tensor2": torch.randn(8, 8)}
    with DefaultStager(config(shared)) as stager:
        staged: Any = stager.stage(sd)
        for k, v in sd.items():
            assert torch.equal(staged[k], v)
            assert staged[k].is_shared() is shared
            assert staged[k].untyped_storage().is_shared() is shared
            assert not staged[k].is_pinned()


@pytest.mark.parametrize("shared", [False, True])
def test_later_stages_stay_in_the_stagers_memory_after_share_memory(shared: bool) -> None:
    sd = {"a": torch.randn(64), "b": torch.randn(32)}
    with DefaultStager(config(shared)) as stager:
        staged: Any = stager.stage(sd)
        where = {k: v.data_ptr() for k, v in staged.items()}
        first_a = staged["a"].clone()
        staged["a"].share_memory_()
        assert staged["a"].is_shared()
        assert (staged["a"].data_ptr() == where["a"]) is shared  # in place when shared
        # A moved tensor views other memory: kept, it holds nothing of the stager's. A
        # tensor left in place is a staged result: kept, it would hold its buffer set.
        kept = None if shared else staged["a"]
        del staged
        for v in sd.values():
            v.mul_(2)
        again: Any = stager.stage(sd)
        assert {k: v.data_ptr() for k, v in again.items()} == where
        assert torch.equal(again["a"], sd["a"]) and torch.equal(again["b"], sd["b"])
        if kept is not None:
            assert torch.equal(kept, first_a)  # the moved copy is the caller's own now
