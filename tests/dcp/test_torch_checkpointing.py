"""torch_checkpointing's save pipeline and checkpoint manager, driven with our stager.

End to end on the CPU: save through the peer's ``AsyncCheckpointSaver`` (its writer is
a spawned process, the only async writer it offers) and its ``CheckpointManager``, load
back with the peer's loader, bit-exact. One rank, and two ranks over gloo. Skipped
where the optional ``torch-checkpointing`` test extra is not installed.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

tc = pytest.importorskip(
    "torch_checkpointing", reason="torch-checkpointing (optional test extra) is not installed"
)

from torch_checkpointing import builder as tc_builder  # noqa: E402
from torch_checkpointing.checkpoint_manager import CheckpointManager, _DictCheckpoint  # noqa: E402
from torch_checkpointing.config import AsyncCheckpointSaverConfig  # noqa: E402
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig  # noqa: E402

from async_stager import CheckpointStagerConfig, DefaultStager  # noqa: E402

pytestmark = pytest.mark.timeout(600)  # a hang guard, not a speed check (see CONTRIBUTING.md, "Tests")


def payload(step: int) -> dict[str, Any]:
    """Dtypes and layouts a trainer saves: floats, bf16, ints, a view, a Python value."""
    g = torch.Generator().manual_seed(step)
    w = torch.randn(64, 32, generator=g)
    return {
        "model": {"w": w, "b16": torch.randn(257, generator=g).to(torch.bfloat16)},
        "ids": torch.arange(1000, dtype=torch.int64) * step,
        "step": step,
    }


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def assert_bit_exact(loaded: Any, expected: Any) -> None:
    if isinstance(expected, dict):
        assert isinstance(loaded, dict) and set(loaded) == set(expected)
        for k in expected:
            assert_bit_exact(loaded[k], expected[k])
    elif isinstance(expected, torch.Tensor):
        assert isinstance(loaded, torch.Tensor)
        assert loaded.dtype == expected.dtype and loaded.shape == expected.shape
        assert bits(loaded) == bits(expected)
    else:
        assert loaded == expected


def empty_like(sd: dict[str, Any]) -> dict[str, Any]:
    return {
        k: empty_like(v) if isinstance(v, dict) else torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0
        for k, v in sd.items()
    }


def manager_config(shared: bool) -> CheckpointManager.Config:
    # Our config in the peer's manager config (duck-typed: the same six fields).
    config = CheckpointManager.Config(
        save=AsyncCheckpointSaverConfig(
            staging_config=CheckpointStagerConfig(use_shared_memory=shared)  # type: ignore[arg-type]
        )
    )
    config.save.wait_timeout_secs = 240  # type: ignore[union-attr]
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    return config


def save_and_load_twice(
    manager: CheckpointManager, root: Path, seed: int = 0, written: Callable[[], None] = lambda: None
) -> None:
    """Two saves (the second into the reused buffers), each loaded back bit-exact,
    the sources changed in place right after each stage."""
    for step in (1, 2):
        sd = payload(step + seed)
        sd["step"] = step
        expected = {"model": {k: v.clone() for k, v in sd["model"].items()}, "ids": sd["ids"].clone()}
        expected["step"] = step
        path = str(root / f"step{step}")
        write = manager.save(path, sd)
        assert write is not None
        write.result(timeout=240)
        written()  # (ranks: every rank's write done, rank 0 finalized the checkpoint)
        sd["model"]["w"].add_(1.0)  # optimizer.step() after the checkpoint
        loaded = manager.load(path, into=empty_like(expected))
        assert_bit_exact(dict(loaded), expected)


def test_checkpoint_manager_with_our_stager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The manager builds its stager itself (builder.DefaultStager): no argument takes one.
    # Shared memory (the default): the writer process maps the staged arenas, no copy.
    monkeypatch.setattr(tc_builder, "DefaultStager", DefaultStager)
    manager = manager_config(True).build()
    try:
        stager = manager._saver.stager  # the one it built, to check the switch took
        assert isinstance(stager, DefaultStager)
        save_and_load_twice(manager, tmp_path)
        assert stager.pinned_num_bytes() == 0  # CPU: nothing pinned
    finally:
        manager.close()


def test_async_saver_with_our_stager(tmp_path: Path) -> None:
    # The one-line switch: the peer's saver, built as its builder does, with our stager.
    from torch_checkpointing.checkpoint_process import CheckpointProcess, CheckpointProcessConfig
    from torch_checkpointing.checkpoint_saver import AsyncCheckpointSaver
    from torch_checkpointing.checkpoint_writer import CheckpointWriterArgs, CheckpointWriterConfig

    rank_info = tc_builder._get_default_rank_info()
    storage = LocalFileSystemStorageConfig(use_direct_io=False)
    process = CheckpointProcess(
        rank_info=rank_info,
        config=CheckpointProcessConfig(),
        subprocess_init_fn=tc_builder._default_subprocess_init,
        subprocess_init_args=(),
        checkpoint_writer_args=CheckpointWriterArgs(
            config=CheckpointWriterConfig(), rank_info=rank_info, storage_config=storage
        ),
    )
    saver = AsyncCheckpointSaver(
        checkpoint_stager=DefaultStager(),  # type: ignore[arg-type]  # duck-typed: not their ABC
        checkpoint_process=process,
    )
    loader = CheckpointManager(CheckpointManager.Config(storage_config=storage))
    try:
        for step in (1, 2):
            sd = payload(step)
            expected = {"model": {k: v.clone() for k, v in sd["model"].items()}, "ids": sd["ids"].clone()}
            expected["step"] = step
            items = {k: tc.CheckpointItem(value=v, requires_copy=True) for k, v in sd.items()}
            staged, written = saver.save(str(tmp_path / f"s{step}"), _DictCheckpoint(items))
            staged.result(timeout=240)
            sd["model"]["w"].zero_()  # after staging: must not reach the checkpoint
            written.result(timeout=240)
            loaded = loader.load(str(tmp_path / f"s{step}"), into=empty_like(expected))
            assert_bit_exact(dict(loaded), expected)
    finally:
        saver.close()
        loader.close()


def _rank_main(rank: int, world: int, init: str, root: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        setattr(tc_builder, "DefaultStager", DefaultStager)  # noqa: B010  (this process only)
        manager = manager_config(True).build()
        try:
            # One checkpoint for both ranks, each saving (and loading) its own values.
            save_and_load_twice(manager, Path(root), seed=100 * rank, written=dist.barrier)
        finally:
            manager.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # 2 spawned gloo ranks: CI's second call
def test_two_ranks_over_gloo(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    init = f"file://{tmp_path / 'rendezvous'}"
    os.makedirs(tmp_path / "ckpt")
    mp.start_processes(_rank_main, args=(2, init, str(tmp_path / "ckpt")), nprocs=2, start_method="spawn")
