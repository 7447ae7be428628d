"""Incremental saves (``Checkpointer(incremental=True)``, issue 43): a save after the
first writes only the tensors whose content changed since the previous commit and
references the rest; every step stays whole to every reader (restore, verify, plain
``dcp.load``), retention frees only what no kept step references, a damaged shared
file fails every step that references it and restore falls back past them."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from async_stager import Checkpointer, IntegrityError, InvalidOptionError, SaveStats
from async_stager._cli.main import main as cli_main

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.timeout(120),  # hang guards (each test takes about a second)
]

BASE = 256 * 1024  # floats: 1 MiB frozen base
REF = "ref-*"


def lora(step: int) -> dict[str, Any]:
    """A frozen base and an adapter (with optimizer-like state) that changes per step."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(BASE, generator=g)
    return {
        "model": {"base": base, "adapter": torch.full((64, 32), float(step))},
        "optim": {"exp_avg": torch.full((64, 32), step / 3), "step": step},
        "note": f"step {step}",
    }


def blank() -> dict[str, Any]:
    return {
        "model": {"base": torch.zeros(BASE), "adapter": torch.zeros(64, 32)},
        "optim": {"exp_avg": torch.zeros(64, 32), "step": -1},
        "note": "",
    }


def equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    for k, v in want.items():
        if isinstance(v, dict):
            equal(got[k], v)
        elif isinstance(v, torch.Tensor):
            assert torch.equal(got[k], v), k
        else:
            assert got[k] == v, k


def data_bytes(folder: Path) -> int:
    """The bytes of the data files a step wrote itself (not its links)."""
    return sum(p.stat().st_size for p in folder.glob("__*.distcp"))


def distinct_bytes(root: Path) -> int:
    """The disk the folder's files use, each inode once."""
    seen: dict[tuple[int, int], int] = {}
    for p in root.rglob("*"):
        if p.is_file():
            s = p.stat()
            seen[(s.st_dev, s.st_ino)] = s.st_size
    return sum(seen.values())


@pytest.mark.anyio
async def test_a_save_writes_only_what_changed_and_every_step_is_whole(
    tmp_path: Path, anyio_backend: Any
) -> None:
    stats: list[SaveStats] = []
    async with Checkpointer(tmp_path, keep=3, incremental=True, on_saved=stats.append) as ckpt:
        for step in range(1, 5):
            await ckpt.save(lora(step), step=step)
            await ckpt.wait()
        assert ckpt.steps() == [2, 3, 4]
        for step in (2, 3, 4):
            target = blank()
            assert await ckpt.restore(target, step=step) == step
            equal(target, lora(step))
    assert stats[0].reused_bytes == 0
    assert all(s.reused_bytes == BASE * 4 for s in stats[1:]), [s.reused_bytes for s in stats]
    for step in (2, 3, 4):
        folder = tmp_path / f"step-{step:08d}"
        # Written: the adapter and its state (16 KiB) and the framing, not the 1 MiB base.
        assert data_bytes(folder) < 64 * 1024, sorted(os.listdir(folder))
        links = [p for p in folder.iterdir() if p.name.startswith("ref-")]
        assert links and all(p.stat().st_nlink >= 2 for p in links)
        # Plain DCP reads the step: it is self-contained.
        target = blank()
        dcp.load(target, checkpoint_id=str(folder), no_dist=True)
        equal(target, lora(step))
    assert cli_main(["verify", str(tmp_path)]) == 0


@pytest.mark.anyio
async def test_a_changed_shape_or_dtype_is_written_in_full(tmp_path: Path, anyio_backend: Any) -> None:
    stats: list[SaveStats] = []
    w = torch.arange(4096, dtype=torch.float32)
    states = [
        {"w": w, "b": torch.ones(8)},
        {"w": w.view(64, 64), "b": torch.ones(8)},  # same bytes, another shape
        {"w": w.view(torch.int32), "b": torch.ones(8)},  # same bytes, another dtype
        {"w": w.view(torch.int32), "b": torch.ones(8)},  # unchanged: referenced
    ]
    async with Checkpointer(tmp_path, keep=4, incremental=True, on_saved=stats.append) as ckpt:
        for step, sd in enumerate(states):
            await ckpt.save(sd, step=step)
            await ckpt.wait()
        for step, sd in enumerate(states):
            target = {"w": torch.zeros_like(sd["w"]), "b": torch.zeros(8)}
            assert await ckpt.restore(target, step=step) == step
            assert torch.equal(target["w"], sd["w"]) and target["w"].dtype == sd["w"].dtype
    assert [s.reused_bytes for s in stats] == [0, 32, 32, 4096 * 4 + 32]


def test_the_torch_format_and_no_checksums_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidOptionError, match=r"incremental=True needs format='dcp'"):
        Checkpointer(tmp_path, format="torch", incremental=True)
    with pytest.raises(InvalidOptionError, match=r"incremental=True needs checksums=True"):
        Checkpointer(tmp_path, checksums=False, incremental=True)


@pytest.mark.anyio
async def test_retention_frees_what_no_kept_step_references(tmp_path: Path, anyio_backend: Any) -> None:
    async with Checkpointer(tmp_path, keep=2, incremental=True) as ckpt:
        for step in range(1, 31):
            await ckpt.save(lora(step), step=step)
        await ckpt.wait()
        assert ckpt.steps() == [29, 30]
    # Two steps' distinct data: the base once, two adapters, the framing and metadata.
    used = distinct_bytes(tmp_path)
    assert BASE * 4 < used < BASE * 4 + 200 * 1024, used
    # The first step's file (the base's) survives through the links of the kept steps.
    assert not (tmp_path / "step-00000001").exists()


@pytest.mark.anyio
async def test_a_damaged_shared_file_fails_every_step_linking_it(
    tmp_path: Path, anyio_backend: Any, caplog: pytest.LogCaptureFixture
) -> None:
    async with Checkpointer(tmp_path, keep=4, incremental=True) as ckpt:
        sd = lora(0)
        await ckpt.save(sd, step=0)  # full
        sd["model"]["base"] = sd["model"]["base"] + 1
        for step in (1, 2, 3):
            sd["model"]["adapter"] = torch.full((64, 32), float(step))
            await ckpt.save(sd, step=step)  # 1: new base (full); 2, 3: reference 1's
        await ckpt.wait()
    shared = tmp_path / "step-00000001" / "__0_0.distcp"
    assert shared.stat().st_nlink == 3
    md = dcp.FileSystemReader(str(tmp_path / "step-00000001")).read_metadata()
    info = next(i for k, i in md.storage_data.items() if k.fqn == "model.base")
    with open(shared, "r+b") as f:  # one byte of the base's data
        f.seek(info.offset + info.length // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    async with Checkpointer(tmp_path, keep=4, incremental=True) as ckpt:
        with pytest.raises(IntegrityError, match=r"ref-\d+-__0_0\.distcp") as got:
            await ckpt.restore(blank(), step=3, fallback=False)
        assert got.value.tensor == "model.base"
        target = blank()
        with caplog.at_level(logging.WARNING, logger="async_stager"):
            assert await ckpt.restore(target) == 0
        equal(target, lora(0))
    said = [r.getMessage() for r in caplog.records if "does not verify" in r.getMessage()]
    assert len(said) == 3 and all(".distcp" in m for m in said), said


def _flip(folder: Path, fqn: str) -> None:
    """One byte of ``fqn``'s stored data in ``folder`` (every step linking its file sees it)."""
    md = dcp.FileSystemReader(str(folder)).read_metadata()
    info = next(i for k, i in md.storage_data.items() if k.fqn == fqn)
    with open(folder / str(info.relative_path), "r+b") as f:
        f.seek(info.offset + info.length // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))


@pytest.mark.anyio
async def test_a_save_after_its_base_was_damaged_writes_in_full(
    tmp_path: Path, anyio_backend: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # The trainer holds the good data: a save must not reference bytes damaged since
    # their commit (its step would never verify, nor would any later one linking them).
    async with Checkpointer(tmp_path, keep=5, incremental=True) as ckpt:
        await ckpt.save(lora(1), step=1)
        await ckpt.save(lora(2), step=2)  # references 1's base
        await ckpt.wait()
        _flip(tmp_path / "step-00000002", "model.base")  # the file 1 and 2 share
        with caplog.at_level(logging.WARNING, logger="async_stager"):
            await ckpt.save(lora(3), step=3)
            await ckpt.wait()
        assert ckpt.last is not None and ckpt.last.reused_bytes == 0
        assert not list((tmp_path / "step-00000003").glob(REF))
        await ckpt.save(lora(4), step=4)  # references 3's own data again
        await ckpt.wait()
        assert ckpt.last is not None and ckpt.last.reused_bytes > 0
        for step in (4, 3):
            target = blank()
            assert await ckpt.restore(target, step=step, fallback=False) == step
            equal(target, lora(step))
    said = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert said and "model.base" in said[0] and "__0_0.distcp" in said[0], said
    assert cli_main(["verify", str(tmp_path)]) == 1  # 1 and 2 fail, naming the file


@pytest.mark.anyio
async def test_a_transposed_tensor_is_referenced(tmp_path: Path, anyio_backend: Any) -> None:
    # Stored in its memory order, not the digest's row-major one: the base's check of
    # its stored bytes must not take that for damage.
    w = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32).t()
    async with Checkpointer(tmp_path, keep=3, incremental=True) as ckpt:
        for step in (1, 2):
            await ckpt.save({"w": w, "n": step}, step=step)
            await ckpt.wait()
        assert ckpt.last is not None and ckpt.last.reused_bytes == w.numel() * 4
        target: dict[str, Any] = {"w": torch.zeros(32, 64), "n": 0}
        assert await ckpt.restore(target, step=2, fallback=False) == 2
        assert torch.equal(target["w"], w)


@pytest.mark.anyio
async def test_two_writers_on_one_folder_mix_and_lose_nothing(tmp_path: Path, anyio_backend: Any) -> None:
    """Two incremental Checkpointers save into one folder in turn; each one's
    retention retires the other's steps. Every kept step restores bit-exact."""
    saved: dict[int, dict[str, Any]] = {}
    async with (
        Checkpointer(tmp_path, keep=2, incremental=True) as a,
        Checkpointer(tmp_path, keep=2, incremental=True) as b,
    ):
        for step in range(1, 13):
            sd = lora(step)
            if step % 3 == 0:
                sd["model"]["base"] = sd["model"]["base"] * step  # the base changes too
            saved[step] = sd
            writer = a if step % 2 else b
            await writer.save(sd, step=step)
            await writer.wait()
            for kept in writer.steps():
                target = blank()
                assert await writer.restore(target, step=kept) == kept
                equal(target, saved[kept])
    assert cli_main(["verify", str(tmp_path)]) == 0


@pytest.mark.anyio
async def test_the_memory_tiers_persisted_steps_are_incremental(tmp_path: Path, anyio_backend: Any) -> None:
    """With a memory tier, the steps persisted to the folder (every ``persist_every``)
    reference the previous persisted one; a new Checkpointer without the agent
    restores each from the folder."""
    import anyio

    from async_stager._tier.agent import Agent
    from async_stager._tier.client import AgentClient

    base = tempfile.mkdtemp(prefix="ast-", dir="/tmp")  # a Unix socket's path is short
    agent = Agent("inc", max_bytes=1 << 28, base=base)
    stats: list[SaveStats] = []
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(agent.serve)
            try:
                client = AgentClient("inc", base=base)
                async with Checkpointer(
                    tmp_path, keep=2, agent=client, persist_every=2, incremental=True, on_saved=stats.append
                ) as ckpt:
                    for step in range(1, 7):
                        assert await ckpt.save(lora(step), step=step)
                        await ckpt.wait()
                        while ckpt.in_flight():
                            await anyio.sleep(0.01)
                    assert ckpt.steps() == [4, 6]
            finally:
                await agent.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert [s.step for s in stats] == [2, 4, 6]
    assert [s.reused_bytes for s in stats] == [0, BASE * 4, BASE * 4]
    async with Checkpointer(tmp_path, keep=2) as ckpt:
        for step in (4, 6):
            target = blank()
            assert await ckpt.restore(target, step=step, fallback=False) == step
            equal(target, lora(step))


@pytest.mark.anyio
async def test_without_hard_links_the_data_is_copied_or_written(
    tmp_path: Path, anyio_backend: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A file system without hard links: the base's file is copied into the step (a
    warning; the step still writes only what changed); where it cannot be copied
    either, the save writes everything. Each step restores whole."""
    import errno
    import shutil as _shutil

    def no_link(src: Any, dst: Any) -> None:
        raise OSError(errno.EPERM, "Operation not permitted (injected)", str(dst))

    monkeypatch.setattr(os, "link", no_link)
    stats: list[SaveStats] = []
    with caplog.at_level(logging.WARNING, logger="async_stager"):
        async with Checkpointer(tmp_path, keep=3, incremental=True, on_saved=stats.append) as ckpt:
            await ckpt.save(lora(1), step=1)
            await ckpt.save(lora(2), step=2)  # copied
            await ckpt.wait()
            copy = _shutil.copyfile

            def no_copy(src: Any, dst: Any, **kwargs: Any) -> Any:
                if "ref-" in str(dst):
                    raise OSError(errno.ENOSPC, "No space left on device (injected)", str(dst))
                return copy(src, dst, **kwargs)

            monkeypatch.setattr(_shutil, "copyfile", no_copy)
            await ckpt.save(lora(3), step=3)  # written in full
            await ckpt.wait()
            for step in (1, 2, 3):
                target = blank()
                assert await ckpt.restore(target, step=step, fallback=False) == step
                equal(target, lora(step))
    assert [s.reused_bytes for s in stats] == [0, BASE * 4, 0]
    assert all(p.stat().st_nlink == 1 for p in (tmp_path / "step-00000002").glob("ref-*"))
    assert not list((tmp_path / "step-00000003").glob("ref-*"))
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "could not be linked" in said and "every tensor is written" in said


@pytest.mark.anyio
async def test_a_reader_beside_the_trainer_restores_whole_steps(tmp_path: Path, anyio_backend: Any) -> None:
    """A second Checkpointer restores the newest step over and over while the trainer
    saves incrementally with keep=1 (each commit retires the step the next references
    and the reader may hold): every restore is a whole step, bit-exact."""
    import anyio

    done = anyio.Event()
    restored: list[int] = []

    async def reader() -> None:
        async with Checkpointer(tmp_path, keep=1) as other:
            while not done.is_set():
                target = blank()
                step = await other.restore(target)
                if step is not None:
                    equal(target, lora(step))
                    restored.append(step)
                await anyio.sleep(0)

    async with Checkpointer(tmp_path, keep=1, incremental=True) as ckpt, anyio.create_task_group() as tg:
        await ckpt.save(lora(1), step=1)
        await ckpt.wait()
        tg.start_soon(reader)
        for step in range(2, 16):
            await ckpt.save(lora(step), step=step)
            await ckpt.wait()
            await anyio.sleep(0.01)
        done.set()
    assert restored, "the reader restored nothing"
    target = blank()
    async with Checkpointer(tmp_path, keep=1) as ckpt:
        assert await ckpt.restore(target, fallback=False) == 15
    equal(target, lora(15))
