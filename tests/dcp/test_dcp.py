"""DCP integration: stage-then-save with ``async_stager.dcp.save`` and the seed's
DefaultStager as ``async_stager=`` of ``dcp.async_save``; loaded back bit-exact."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import bits

import async_stager._dcp.save as _dcp_save
import async_stager.dcp as adcp
from async_stager import CheckpointStagerConfig, DefaultStager, Stager

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.timeout(60),
    # dcp.load(no_dist=True) warns that it assumes a single process: we asked for that.
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]


def make_sd(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(64, generator=g)
    return {
        "model": {
            "w": torch.randn(32, 16, generator=g),
            "b": torch.randn(16, generator=g).to(torch.bfloat16),
            "view": base[8:40],
            "t": torch.randn(8, 4, generator=g).t(),
            "nan": torch.tensor([float("nan"), float("inf"), -0.0]),
        },
        "optim": {"state": {"0": {"exp_avg": torch.randn(10, generator=g), "step": torch.tensor(5.0)}}},
        "ints": torch.randint(0, 1 << 30, (20,), generator=g),
        "epoch": 3,
        "name": "run-1",
    }


def zeros_like_sd(sd: Any) -> Any:
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd.contiguous())
    if isinstance(sd, dict):
        return {k: zeros_like_sd(v) for k, v in sd.items()}
    return None if isinstance(sd, str) else 0


def assert_loaded_equal(fresh: Any, sd: Any, path: str = "sd") -> None:
    if isinstance(sd, torch.Tensor):
        assert fresh.dtype == sd.dtype and fresh.shape == sd.shape, path
        assert torch.equal(bits(fresh), bits(sd)), f"{path} differs"
    elif isinstance(sd, dict):
        for k in sd:
            assert_loaded_equal(fresh[k], sd[k], f"{path}[{k!r}]")
    else:
        assert fresh == sd, path


def load(path: Path, like: Any) -> Any:
    fresh = zeros_like_sd(like)
    dcp.load(fresh, checkpoint_id=str(path), no_dist=True)
    return fresh


def leases(stager: Stager) -> int:
    return sum(s.leases for s in stager._engine.sets.all())


async def test_save_then_load_bit_exact(anyio_backend: Any, tmp_path: Path) -> None:
    sd = make_sd()
    async with Stager(share_memory=True) as stager:
        first = make_sd()
        md = await adcp.save(sd, stager=stager, checkpoint_id=tmp_path / "a", no_dist=True)
        assert "model.w" in md.state_dict_metadata
        assert leases(stager) == 0
        # Training goes on; the next checkpoint reuses the host buffers.
        sd["model"]["w"].add_(1.0)
        await adcp.save(sd, stager=stager, checkpoint_id=tmp_path / "b", no_dist=True)
        assert stager.stats is not None and stager.stats.fast_path
    assert_loaded_equal(load(tmp_path / "b", sd), sd)
    assert_loaded_equal(load(tmp_path / "a", first), first)


async def test_lease_is_held_while_saving(anyio_backend: Any, tmp_path: Path, monkeypatch: Any) -> None:
    seen: list[int] = []
    stager = Stager()
    real = _dcp_save.save_blocking

    def spy(staged: dict[str, Any], **kw: Any) -> Any:
        seen.append(leases(stager))
        return real(staged, **kw)

    monkeypatch.setattr(_dcp_save, "save_blocking", spy)
    async with stager:
        await adcp.save({"a": torch.ones(4)}, stager=stager, checkpoint_id=tmp_path, no_dist=True)
        assert seen == [1] and leases(stager) == 0


def slow_save(started: threading.Event, finished: threading.Event, seconds: float) -> Any:
    real = _dcp_save.save_blocking

    def save(staged: dict[str, Any], **kw: Any) -> Any:
        started.set()
        time.sleep(seconds)
        md = real(staged, **kw)
        finished.set()
        return md

    return save


async def test_cancel_while_saving_waits_for_the_save(
    anyio_backend: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    started, finished = threading.Event(), threading.Event()
    monkeypatch.setattr(_dcp_save, "save_blocking", slow_save(started, finished, 0.3))
    sd = make_sd(1)
    async with Stager() as stager:
        with anyio.move_on_after(0.15) as scope:
            await adcp.save(sd, stager=stager, checkpoint_id=tmp_path, no_dist=True)
        assert scope.cancelled_caught
        # The save ran to completion before the cancellation was delivered, and the
        # lease was held until then.
        assert started.is_set() and finished.is_set()
        assert leases(stager) == 0
        staged = await stager.stage(sd)  # still usable
        assert torch.equal(staged["ints"], sd["ints"])
    assert_loaded_equal(load(tmp_path, sd), sd)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_native_asyncio_cancel_is_deferred_too(
    anyio_backend: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    started, finished = threading.Event(), threading.Event()
    monkeypatch.setattr(_dcp_save, "save_blocking", slow_save(started, finished, 0.3))
    async with Stager() as stager:
        task = asyncio.ensure_future(
            adcp.save({"a": torch.ones(3)}, stager=stager, checkpoint_id=tmp_path, no_dist=True)
        )
        while not started.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert finished.is_set() and leases(stager) == 0


async def test_cancel_while_staging_saves_nothing(anyio_backend: Any, tmp_path: Path) -> None:
    async with Stager() as stager:
        with anyio.CancelScope() as scope:
            scope.cancel()
            await adcp.save(make_sd(), stager=stager, checkpoint_id=tmp_path / "x", no_dist=True)
        assert scope.cancelled_caught
        assert not (tmp_path / "x").exists()
        # The stage was submitted at the call; cancelled, its job is abandoned and its
        # lease goes when the worker is done with it (buffers stay reserved until then).
        await stager.fence()
        assert leases(stager) == 0


async def test_save_error_propagates_and_releases(anyio_backend: Any, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    async with Stager() as stager:
        # DCP's own error, unchanged (CheckpointException is a BaseException).
        with pytest.raises(BaseException, match="Not a directory") as ei:
            await adcp.save({"a": torch.ones(2)}, stager=stager, checkpoint_id=blocker / "ckpt", no_dist=True)
        assert not isinstance(ei.value, (anyio.get_cancelled_exc_class(),))
        assert leases(stager) == 0
        await adcp.save({"a": torch.ones(2)}, stager=stager, checkpoint_id=tmp_path / "ok", no_dist=True)
    assert_loaded_equal(load(tmp_path / "ok", {"a": torch.ones(2)}), {"a": torch.ones(2)})


@pytest.mark.timeout(60)
def test_default_stager_with_dcp_async_save(tmp_path: Path) -> None:
    with DefaultStager(CheckpointStagerConfig()) as stager:
        for i in range(2):
            sd = make_sd(i)
            response = dcp.async_save(
                sd, checkpoint_id=str(tmp_path / str(i)), async_stager=stager, no_dist=True
            )
            upload: Any = getattr(response, "upload_completion", response)
            upload.result(timeout=30)
            assert_loaded_equal(load(tmp_path / str(i), sd), sd)


async def test_snapshot_point_is_the_call(anyio_backend: Any, tmp_path: Path) -> None:
    sd: dict[str, Any] = {"w": torch.arange(1000.0), "step": 1}
    expected = sd["w"].clone()
    async with Stager() as stager:
        pending = adcp.save(sd, stager=stager, checkpoint_id=tmp_path, no_dist=True)
        await stager.fence()  # the coroutine has not even started: the stage has
        sd["w"].add_(1.0)
        await pending
    assert torch.equal(load(tmp_path, {"w": expected, "step": 1})["w"], expected)


async def test_dropped_save_gives_its_lease_back(anyio_backend: Any, tmp_path: Path) -> None:
    async with Stager() as stager:
        pending = adcp.save({"w": torch.ones(10)}, stager=stager, checkpoint_id=tmp_path, no_dist=True)
        pending.close()
        del pending
        await stager.fence()
        with anyio.fail_after(5):
            while leases(stager):
                await anyio.sleep(0.01)
        assert not tmp_path.joinpath(".metadata").exists()
