"""``Checkpointer(host_budget_bytes=N)``: each save stages and writes in a pipeline of at
most N host bytes (``dcp.save(..., host_budget_bytes=N)``), returns once the last piece
is copied, and the checkpoint is committed, checksummed (from the pieces as they land)
and restored like any other."""

from __future__ import annotations

import json
import os
import socket
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from helpers import assert_equal

from async_stager import BudgetTooSmallError, Checkpointer, IntegrityError, InvalidOptionError, Stager

MiB = 2**20


def state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return {
        "model": {f"layer{i}.w": torch.randn(MiB // 4, generator=g) for i in range(6)},  # 1 MiB each
        "optim": {"step": 5, "lr": [0.1, 0.01], "bf": torch.randn(1000, generator=g).bfloat16()},
    }


def zeros_like(sd: Any) -> Any:
    if isinstance(sd, dict):
        return {k: zeros_like(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [zeros_like(v) for v in sd]
    return torch.zeros_like(sd) if isinstance(sd, torch.Tensor) else sd


@pytest.mark.anyio
async def test_budgeted_saves_hold_the_budget_commit_and_restore(tmp_path: Path) -> None:
    sd = state()
    budget = 2 * MiB + 4096
    async with Checkpointer(tmp_path, host_budget_bytes=budget, keep=2) as ckpt:
        for step in (1, 2):
            for t in sd["model"].values():
                t.add_(step)
            expected = {k: v.clone() for k, v in sd["model"].items()}
            assert await ckpt.save(sd, step=step)
            # The sources may change once save returned: never seen in the checkpoint.
            for t in sd["model"].values():
                t.fill_(-1.0)
            await ckpt.wait()
            stats = ckpt.last
            assert stats is not None and stats.step == step and stats.budget is not None
            assert stats.budget.peak_bytes <= budget and stats.budget.pieces >= 7
            assert stats.bytes == stats.budget.tensor_bytes >= 6 * MiB
            for k, v in expected.items():
                sd["model"][k].copy_(v)
        assert ckpt.steps() == [1, 2]
    manifest = json.loads((tmp_path / "step-00000002" / "checksums.json").read_text())
    assert manifest["hash"] == "xxh3_64" and "model.layer0.w@0" in manifest["tensors"]
    # Plain DCP reads it.
    plain = zeros_like(state()["model"])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": plain}, checkpoint_id=str(tmp_path / "step-00000002"), no_dist=True)
    assert_equal(plain, sd["model"])
    # And the Checkpointer restores and verifies it.
    out = zeros_like(state())
    async with Checkpointer(tmp_path) as ckpt:
        assert await ckpt.restore(out, fallback=False) == 2
    assert_equal(out["model"], sd["model"])
    assert out["optim"]["step"] == 5 and out["optim"]["lr"] == [0.1, 0.01]


@pytest.mark.anyio
async def test_a_corrupted_byte_of_a_budgeted_checkpoint_is_found(tmp_path: Path) -> None:
    sd = state()
    async with Checkpointer(tmp_path, host_budget_bytes=MiB + 4096) as ckpt:
        await ckpt.save(sd, step=1)
    (data,) = [p for p in (tmp_path / "step-00000001").iterdir() if p.suffix == ".distcp"]
    raw = bytearray(data.read_bytes())
    at = raw.find(sd["model"]["layer3.w"].numpy().tobytes()[:256])  # inside that tensor's data
    assert at > 0
    raw[at + 5000] ^= 0x10
    data.write_bytes(bytes(raw))
    async with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(IntegrityError) as info:
            await ckpt.restore(zeros_like(state()), fallback=False)
        assert info.value.step == 1 and info.value.tensor == "model.layer3.w"


@pytest.mark.anyio
async def test_a_budget_below_the_largest_tensor_is_refused_at_the_save(tmp_path: Path) -> None:
    sd = state()
    async with Checkpointer(tmp_path, host_budget_bytes=512 * 1024) as ckpt:
        with pytest.raises(BudgetTooSmallError) as info:
            await ckpt.save(sd, step=1)
        assert info.value.needed_bytes >= MiB
        await ckpt.wait()
        assert ckpt.steps() == []
        # Usable afterwards: a smaller state fits.
        assert await ckpt.save({"w": torch.ones(1000)}, step=2)
        await ckpt.wait()
        assert ckpt.steps() == [2]


@pytest.mark.anyio
async def test_skip_policy_with_a_budget(tmp_path: Path) -> None:
    async with Checkpointer(tmp_path, host_budget_bytes=MiB + 4096, policy="skip", stager=Stager()) as ckpt:
        saved = [await ckpt.save(state(), step=s) for s in (1, 2, 3)]
        await ckpt.wait()
        assert saved[0] and sorted(ckpt.steps() + ckpt.dropped)[-1] == 3
        assert set(ckpt.dropped) == {s for s, ok in zip((1, 2, 3), saved) if not ok}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"host_budget_bytes": 100}, "host_budget_bytes"),
        ({"host_budget_bytes": True}, "host_budget_bytes"),
        ({"host_budget_bytes": 1 << 20, "format": "torch"}, "format='dcp'"),
        ({"host_budget_bytes": 1 << 20, "policy": "coalesce"}, "coalesce"),
    ],
)
def test_budget_options_are_checked(tmp_path: Path, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidOptionError, match=match):
        Checkpointer(tmp_path, **kwargs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _rank_main(rank: int, world: int, port: int, directory: str) -> None:
    import anyio
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        g = torch.Generator().manual_seed(0)
        full = {"w": torch.randn(256, 512, generator=g), "b": torch.randn(512, generator=g)}
        mesh = init_device_mesh("cpu", (world,))

        def sharded(src: dict[str, torch.Tensor]) -> dict[str, Any]:
            return {
                "model": {
                    "w": distribute_tensor(src["w"], mesh, [Shard(0)]),  # 256 KiB per rank
                    "b": distribute_tensor(src["b"], mesh, [Replicate()]),
                },
                "step": 4,
            }

        async def main() -> None:
            async with Checkpointer(directory, host_budget_bytes=300 * 1024) as ckpt:
                await ckpt.save(sharded(full), step=4)
                await ckpt.wait()
                assert ckpt.last is not None and ckpt.last.budget is not None
                assert ckpt.last.budget.peak_bytes <= 300 * 1024
            out = sharded({k: torch.zeros_like(v) for k, v in full.items()})
            out["step"] = 0
            async with Checkpointer(directory) as ckpt:
                assert await ckpt.restore(out, fallback=False) == 4
            assert torch.equal(out["model"]["w"].full_tensor(), full["w"])
            assert torch.equal(out["model"]["b"].full_tensor(), full["b"])
            assert out["step"] == 4

        anyio.run(main, backend="asyncio" if rank == 0 else "trio")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # 2 spawned gloo ranks: CI's second call
@pytest.mark.timeout(600)  # a hang guard, not a speed check (see CONTRIBUTING.md, "Tests")
def test_two_ranks_budgeted_checkpointer_with_dtensors(tmp_path: Path) -> None:
    directory = str(tmp_path / "ckpt")
    mp.spawn(_rank_main, args=(2, _free_port(), directory), nprocs=2, join=True)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step-")) == [
        "step-00000004"
    ]


@pytest.mark.anyio
async def test_a_budgeted_write_failing_before_its_pipeline_starts_does_not_hang_save(tmp_path: Path) -> None:
    """The pipeline's fence hook is registered at save (the snapshot point); a write that
    fails before the pipeline runs (here: its temporary folder cannot be made) must let
    it go at once, or save(), waiting on the fence, would wait for ever."""
    import shutil

    import anyio

    from async_stager import CheckpointError

    root = tmp_path / "ckpt"
    async with Checkpointer(root, host_budget_bytes=MiB + 4096) as ckpt:
        shutil.rmtree(root)
        root.write_text("not a folder")  # mkdir of the step's temporary folder fails
        with anyio.fail_after(30):
            await ckpt.save(state(), step=1)
            with pytest.raises(CheckpointError):
                await ckpt.wait()
            await ckpt.fence()  # nothing left registered
        root.unlink()
        root.mkdir()
        with anyio.fail_after(30):
            assert await ckpt.save(state(), step=2)
            await ckpt.wait()
        assert ckpt.steps() == [2]


@pytest.mark.anyio
async def test_a_budgeted_save_given_up_while_it_waits_for_a_write_slot_lets_fence_return(
    tmp_path: Path,
) -> None:
    """A budgeted save's job is made at its call (a fence hook on the stager, a lane of
    copiers). One given up before its write started (here: while the save before it
    holds the only write slot, its commit waiting for the folder's lock) lets them go at
    once; before, every later ``fence()`` waited for a pipeline that would never run."""
    import fcntl

    import anyio

    async with Checkpointer(tmp_path, host_budget_bytes=MiB + 4096) as ckpt:
        fd = os.open(tmp_path / ".lock", os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # step 1's commit waits here, holding the slot
            assert await ckpt.save(state(), step=1)
            with anyio.move_on_after(0.5) as scope:
                await ckpt.save(state(), step=2)  # waits for the slot: given up
            assert scope.cancelled_caught
            with anyio.fail_after(30):  # a hang guard
                await ckpt.fence()
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        with anyio.fail_after(30):
            await ckpt.wait()
        assert ckpt.steps() == [1]
