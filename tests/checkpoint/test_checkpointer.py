"""Checkpointer on one process: save/restore in both formats, Statefuls, policies,
stats, retention and ``latest``, the commit protocol's leftovers, integrity, Shutdown."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from async_stager import Checkpointer, IntegrityError, InvalidOptionError, SaveStats, Shutdown
from async_stager._cli.main import main as cli_main

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]

GATE = threading.Event()


class Gate:
    """Pickles normally, except in DCP's save thread, where it waits for GATE: a write
    that is held open deterministically (staging copies it in another thread)."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        if threading.current_thread().name.startswith("async-stager-dcp-save"):
            assert GATE.wait(30)
        return (Gate, ())


def model_and_optim(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    return m, opt


def train(m: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for i in range(steps):
        torch.manual_seed(100 + i)
        m(torch.randn(4, 8)).square().sum().backward()
        opt.step()
        opt.zero_grad()


class App:
    """A Stateful as DCP's docs write it."""

    def __init__(self, m: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.m, self.opt = m, opt

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.m, self.opt)
        return {"model": msd, "optim": osd}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.m, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.anyio
async def test_dcp_round_trip_with_statefuls_retention_and_latest(tmp_path: Path) -> None:
    m, opt = model_and_optim()
    seen: list[SaveStats] = []
    async with Checkpointer(tmp_path, keep=2, on_saved=seen.append) as ckpt:
        stream = ckpt.saved()
        for step in (1, 2, 3):
            train(m, opt, 1)
            assert await ckpt.save({"app": App(m, opt), "meta": {"step": step}}, step=step)
            await ckpt.fence()
        await ckpt.wait()
        assert ckpt.steps() == [2, 3]
        assert (tmp_path / "latest").read_text() == "step-00000003\n"
        m2, opt2 = model_and_optim(seed=1)
        train(m2, opt2, 1)
        state: dict[str, Any] = {"app": App(m2, opt2), "meta": {"step": -1}}
        assert await ckpt.restore(state) == 3
        assert same(m, m2) and state["meta"]["step"] == 3
        train(m, opt, 2)
        train(m2, opt2, 2)
        assert same(m, m2)  # optimizer state restored too
    assert [s.step for s in seen] == [1, 2, 3]
    with stream:
        got = [s async for s in stream]
    assert got == seen and all(s.bytes > 0 and s.write_seconds > 0 for s in got)
    # Plain DCP loads it, without async_stager.
    plain = {"meta": {"step": 0}}
    dcp.load(plain, checkpoint_id=str(tmp_path / "step-00000003"), no_dist=True)
    assert plain["meta"]["step"] == 3


@pytest.mark.anyio
async def test_torch_format_round_trip_and_nothing_to_restore(tmp_path: Path) -> None:
    m, opt = model_and_optim()
    train(m, opt, 2)
    async with Checkpointer(tmp_path, format="torch") as ckpt:
        assert await ckpt.restore({"model": m}) is None
        await ckpt.save({"model": m, "optim": opt, "n": 7, "t": torch.arange(3)}, step=5)
        await ckpt.wait()
        m2, opt2 = model_and_optim(seed=3)
        t = torch.zeros(3, dtype=torch.long)
        state: dict[str, Any] = {"model": m2, "optim": opt2, "n": 0, "t": t}
        assert await ckpt.restore(state) == 5
        assert same(m, m2) and state["n"] == 7 and state["t"] is t and t.tolist() == [0, 1, 2]
        train(m, opt, 1)
        train(m2, opt2, 1)
        assert same(m, m2)
    assert sorted(os.listdir(tmp_path / "step-00000005")) == ["COMMIT", "checksums.json", "state.pt"]


@pytest.mark.anyio
async def test_skip_policy(tmp_path: Path) -> None:
    GATE.clear()
    async with Checkpointer(tmp_path, policy="skip") as ckpt:
        assert await ckpt.save({"g": Gate(), "x": torch.ones(2)}, step=1)
        assert not await ckpt.save({"x": torch.ones(2)}, step=2)
        GATE.set()
        await ckpt.wait()
        assert ckpt.steps() == [1] and ckpt.dropped == [2]
        assert await ckpt.save({"x": torch.ones(2)}, step=3)  # a free slot again
    assert ckpt.steps() == [1, 3]


@pytest.mark.anyio
async def test_coalesce_policy_writes_the_newest(tmp_path: Path) -> None:
    GATE.clear()
    async with Checkpointer(tmp_path, policy="coalesce", keep=5) as ckpt:
        x = torch.zeros(4)
        assert await ckpt.save({"g": Gate(), "x": x}, step=1)
        for step in (2, 3, 4):
            x.fill_(step)
            assert await ckpt.save({"x": x}, step=step)
        x.fill_(-1)  # staged copies are snapshots
        GATE.set()
        await ckpt.wait()
        assert ckpt.steps() == [1, 4] and ckpt.dropped == [2, 3]
        y = torch.empty(4)
        assert await ckpt.restore({"x": y}) == 4
        assert y.tolist() == [4.0] * 4


@pytest.mark.anyio
async def test_wait_policy_waits_for_a_slot(tmp_path: Path) -> None:
    GATE.clear()
    done: list[int] = []
    async with Checkpointer(tmp_path, keep=5) as ckpt:
        await ckpt.save({"g": Gate(), "x": torch.ones(2)}, step=1)

        async def second() -> None:
            await ckpt.save({"x": torch.ones(2)}, step=2)
            done.append(2)

        async with anyio.create_task_group() as tg:
            tg.start_soon(second)
            await anyio.wait_all_tasks_blocked()
            assert done == []  # waiting for the write in flight
            GATE.set()
        await ckpt.wait()
        assert done == [2] and ckpt.steps() == [1, 2] and ckpt.dropped == []


def test_options_are_checked(tmp_path: Path) -> None:
    for kwargs in ({"keep": 0}, {"policy": "drop"}, {"format": "zip"}, {"max_in_flight": 0}):
        with pytest.raises(InvalidOptionError):
            Checkpointer(tmp_path, **kwargs)  # type: ignore[arg-type]


def flip_byte_of(path: Path, value: float) -> None:
    data = bytearray(path.read_bytes())
    i = data.find(torch.tensor([value]).numpy().tobytes())
    assert i >= 0
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.anyio
async def test_corrupted_byte_is_detected_and_restore_falls_back(tmp_path: Path, capsys: Any) -> None:
    w = torch.arange(256.0)
    async with Checkpointer(tmp_path, keep=3) as ckpt:
        for step in (1, 2):
            w += 1000
            await ckpt.save({"layer": {"w": w}}, step=step)
        await ckpt.wait()
    assert cli_main(["verify", str(tmp_path)]) == 0
    flip_byte_of(tmp_path / "step-00000002" / "__0_0.distcp", 2100.0)
    async with Checkpointer(tmp_path) as ckpt:
        out = torch.empty(256)
        with pytest.raises(IntegrityError) as info:
            await ckpt.restore({"layer": {"w": out}}, fallback=False)
        assert info.value.step == 2 and info.value.tensor == "layer.w"
        assert "layer.w" in str(info.value)
        assert await ckpt.restore({"layer": {"w": out}}) == 1
        assert torch.equal(out, torch.arange(256.0) + 1000)
    capsys.readouterr()
    assert cli_main(["verify", str(tmp_path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("step-00000002: FAILED") and lines[1].startswith("step-00000001: ok")


@pytest.mark.anyio
async def test_torch_format_corruption_and_missing_checksums(tmp_path: Path) -> None:
    async with Checkpointer(tmp_path, format="torch", keep=3) as ckpt:
        await ckpt.save({"w": torch.full((64,), 3.0)}, step=1)
        await ckpt.save({"w": torch.full((64,), 5.0)}, step=2)
        await ckpt.wait()
    flip_byte_of(tmp_path / "step-00000002" / "state.pt", 5.0)
    (tmp_path / "step-00000001" / "checksums.json").unlink()
    async with Checkpointer(tmp_path, format="torch") as ckpt:
        with pytest.raises(IntegrityError) as info:
            await ckpt.restore({"w": torch.empty(64)})
        assert info.value.step == 2 and info.value.tensor == "w"


@pytest.mark.anyio
async def test_leftovers_of_a_crash_are_never_restored(tmp_path: Path) -> None:
    async with Checkpointer(tmp_path) as ckpt:
        await ckpt.save({"w": torch.ones(3)}, step=1)
    # A write that never committed, and a replacement that crashed between renames.
    torn = tmp_path / ".tmp-step-00000009"
    torn.mkdir()
    (torn / "__0_0.distcp").write_bytes(b"torn")
    os.rename(tmp_path / "step-00000001", tmp_path / ".old-step-00000001")
    async with Checkpointer(tmp_path) as ckpt:
        assert not torn.exists() and ckpt.steps() == [1]
        w = torch.zeros(3)
        assert await ckpt.restore({"w": w}) == 1 and w.tolist() == [1.0, 1.0, 1.0]
    manifest = json.loads((tmp_path / "step-00000001" / "checksums.json").read_text())
    assert manifest["hash"] == "xxh3_64" and "w@0" in manifest["tensors"]


@pytest.mark.anyio
async def test_shutdown_final_checkpoint_on_sigterm(tmp_path: Path) -> None:
    m, opt = model_and_optim()
    async with Checkpointer(tmp_path) as ckpt, Shutdown() as stop:
        step = 0
        while not stop.requested:
            train(m, opt, 1)
            step += 1
            if step == 3:
                os.kill(os.getpid(), signal.SIGTERM)
            await anyio.sleep(0.01)
        assert stop.signal == signal.SIGTERM
        assert await stop.final_checkpoint(ckpt, {"app": App(m, opt)}, step=step, deadline=20) == 0
        assert ckpt.steps() == [step]


@pytest.mark.anyio
async def test_two_writes_in_flight(tmp_path: Path) -> None:
    GATE.clear()
    async with Checkpointer(tmp_path, policy="skip", max_in_flight=2, keep=5) as ckpt:
        assert await ckpt.save({"g": Gate(), "x": torch.ones(2)}, step=1)
        assert await ckpt.save({"g": Gate(), "x": torch.ones(2)}, step=2)
        assert not await ckpt.save({"x": torch.ones(2)}, step=3)
        GATE.set()
        await ckpt.wait()
        assert ckpt.steps() == [1, 2] and ckpt.dropped == [3]
        assert (tmp_path / "latest").read_text() == "step-00000002\n"


@pytest.mark.cuda
@pytest.mark.anyio
async def test_cuda_state_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(0)
    m = nn.Linear(64, 64).cuda()
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(4, 64, device="cuda")).sum().backward()
    opt.step()
    async with Checkpointer(tmp_path) as ckpt:
        expected = {k: v.clone() for k, v in m.state_dict().items()}
        await ckpt.save({"app": App(m, opt)}, step=1)
        await ckpt.fence()
        with torch.no_grad():
            m.weight.add_(1.0)  # after the fence: not in the checkpoint
        await ckpt.wait()
        m2 = nn.Linear(64, 64).cuda()
        opt2 = torch.optim.AdamW(m2.parameters())
        assert await ckpt.restore({"app": App(m2, opt2)}) == 1
        got = m2.state_dict()
        assert all(torch.equal(got[k], v) for k, v in expected.items()) and m2.weight.is_cuda


@pytest.mark.anyio
async def test_torch_format_truncated_file_falls_back(tmp_path: Path) -> None:
    async with Checkpointer(tmp_path, format="torch", keep=3) as ckpt:
        for step in (1, 2):
            await ckpt.save({"w": torch.full((64,), float(step))}, step=step)
        await ckpt.wait()
        path = tmp_path / "step-00000002" / "state.pt"
        path.write_bytes(path.read_bytes()[:100])
        w = torch.empty(64)
        assert await ckpt.restore({"w": w}) == 1 and w.tolist() == [1.0] * 64


class Unpicklable:
    """Fails to pickle in DCP's save thread only (staging copies it elsewhere)."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        if threading.current_thread().name.startswith("async-stager-dcp-save"):
            raise ValueError("cannot pickle this")
        return (Unpicklable, ())


@pytest.mark.anyio
async def test_a_failed_write_is_raised_once_and_the_next_save_works(tmp_path: Path) -> None:
    from async_stager import CheckpointError

    async with Checkpointer(tmp_path) as ckpt:
        await ckpt.save({"bad": Unpicklable(), "x": torch.ones(2)}, step=1)
        with pytest.raises(CheckpointError) as info:
            await ckpt.wait()
        assert info.value.step == 1 and "cannot pickle this" in repr(info.value.__cause__)
        await ckpt.save({"x": torch.ones(2)}, step=2)
        await ckpt.wait()
        assert ckpt.steps() == [2]


@pytest.mark.anyio
async def test_shutdown_deadline_missed_returns_one(tmp_path: Path) -> None:
    GATE.clear()
    async with Checkpointer(tmp_path) as ckpt, Shutdown() as stop:
        await ckpt.save({"g": Gate(), "x": torch.ones(2)}, step=1)
        stop.request()
        assert stop.requested
        assert await stop.final_checkpoint(ckpt, {"x": torch.ones(2)}, step=2, deadline=0.2) == 1
    # Leaving the block did not wait for step 1's write (stuck in the gate): abandoned,
    # nothing committed; step 2 was never staged.
    assert ckpt.steps() == []
    GATE.set()
