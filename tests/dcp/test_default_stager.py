"""The seed's API (CheckpointStager, CheckpointStagerConfig, DefaultStager) on our engine."""

from __future__ import annotations

import warnings
from concurrent.futures import Future
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_same

from async_stager import (
    CheckpointStager,
    CheckpointStagerConfig,
    ClosedError,
    DefaultStager,
    StagingError,
    UnsupportedError,
    UnsupportedTensorError,
)
from async_stager.testing import FakeBackend, FakePinner

pytestmark = pytest.mark.timeout(60)

HAS_CUDA = torch.cuda.is_available()


def sample() -> dict[str, Any]:
    return {
        "model": {"w": torch.randn(8, 8), "b": torch.randn(8)},
        "optim": {"state": {0: {"exp_avg": torch.randn(8, 8), "step": torch.tensor(3.0)}}, "lr": 1e-3},
        "epoch": 2,
    }


def test_default_stager_is_a_checkpoint_stager() -> None:
    assert issubclass(DefaultStager, CheckpointStager)
    with pytest.raises(TypeError):
        CheckpointStager()  # type: ignore[abstract]


def test_defaults_work_on_this_machine() -> None:
    sd = sample()
    with DefaultStager() as stager:  # async by default: a Future
        fut = stager.stage(sd)
        assert isinstance(fut, Future)
        assert_same(fut.result(timeout=30), sd)


def test_sync_staging_returns_the_dict() -> None:
    sd = sample()
    stager = DefaultStager(CheckpointStagerConfig(use_async_staging=False))
    try:
        staged = stager.stage(sd)
        assert isinstance(staged, dict)
        assert_same(staged, sd)
        sd["model"]["w"].add_(1)  # training goes on; the staged copy does not change
        assert not torch.equal(staged["model"]["w"], sd["model"]["w"])
    finally:
        stager.close()


def test_close_is_idempotent_and_use_after_close_is_clear() -> None:
    stager = DefaultStager(CheckpointStagerConfig(use_async_staging=False))
    stager.stage(sample())
    stager.close()
    stager.close()
    with pytest.raises(ClosedError):
        stager.stage(sample())


def test_reuse_after_close_needs_a_new_stager() -> None:
    # pytorch #183413: reusing a stager after a leak fix raised KeyError. Here a new
    # stager works and an old one says clearly that it is closed.
    sd = sample()
    for _ in range(3):
        with DefaultStager(CheckpointStagerConfig(use_async_staging=False)) as s:
            assert_same(s.stage(sd), sd)


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only refusal")
def test_non_blocking_copies_are_refused_on_cpu_pinned_memory_warns() -> None:
    # As torch_checkpointing: non-blocking copies without CUDA assert; pinned memory is
    # ignored with a warning and staging goes on unpinned.
    with pytest.raises(UnsupportedError, match="non_blocking"):
        DefaultStager(CheckpointStagerConfig(use_non_blocking_copy=True))
    with pytest.warns(UserWarning, match="Ignoring use_pinned_memory=True"):
        stager = DefaultStager(CheckpointStagerConfig(use_pinned_memory=True, use_async_staging=False))
    with stager:
        sd = sample()
        assert_same(stager.stage(sd), sd)
        assert stager.pinned_num_bytes() == 0
    assert issubclass(UnsupportedError, StagingError)


def test_accepts_torch_staging_options() -> None:
    from torch.distributed.checkpoint.staging import StagingOptions

    sd = sample()
    with DefaultStager(StagingOptions(False, True, False, False)) as stager:
        assert_same(stager.stage(sd), sd)


def test_errors_come_through_the_future_with_path() -> None:
    with DefaultStager() as stager:
        fut = stager.stage({"a": {"b": torch.empty(1, device="meta")}})
        assert isinstance(fut, Future)
        with pytest.raises(UnsupportedTensorError) as ei:
            fut.result(timeout=30)
        assert ei.value.path == ("a", "b")
        pending = stager.stage({"w": torch.ones(2)})
        assert isinstance(pending, Future)
        ok = pending.result(timeout=30)
        assert torch.equal(ok["w"], torch.ones(2))


def test_async_stager_protocol() -> None:
    with DefaultStager() as stager:
        assert stager.should_synchronize_after_execute is True
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            stager.synchronize_staging()  # nothing pending: returns, no warning
        stager.stage(sample())
        stager.synchronize_staging()


def test_fake_device_waits_for_completion() -> None:
    backend = FakeBackend(delay=0.01)
    pinner = FakePinner()
    sd = {f"w{i}": torch.randn(16) for i in range(100)}
    config = CheckpointStagerConfig(use_async_staging=False)
    with DefaultStager(config, backend=backend, pinner=pinner) as stager:
        assert_same(stager.stage(sd), sd)
        assert all(ev.fired for ev in backend.events)
        assert pinner.total_registrations == 1
    assert pinner.registered == {}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_dcp_async_save_round_trip(tmp_path: Any) -> None:
    sd: dict[str, Any] = {"model": {"w": torch.randn(16, 16), "b": torch.randn(16)}, "step": torch.tensor(7)}
    expect = {"model": {k: v.clone() for k, v in sd["model"].items()}, "step": sd["step"].clone()}
    stager = DefaultStager(CheckpointStagerConfig(use_async_staging=True))
    try:
        resp = dcp.async_save(sd, checkpoint_id=str(tmp_path / "ckpt"), async_stager=stager, no_dist=True)
        upload = resp.upload_completion if hasattr(resp, "upload_completion") else resp
        if hasattr(resp, "staging_completion"):
            resp.staging_completion.result(timeout=60)
        sd["model"]["w"].add_(1.0)  # after staging completed: must not reach the checkpoint
        upload.result(timeout=60)
    finally:
        stager.close()
    back = {"model": {"w": torch.zeros(16, 16), "b": torch.zeros(16)}, "step": torch.tensor(0)}
    dcp.load(back, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    assert_same(back, expect)
