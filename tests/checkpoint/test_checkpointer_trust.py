"""Every committed checkpoint restores exactly what was saved (issue 22): regression
tests, through the public API, for each way the Checkpointer used to lose or mix
checkpoints. Each test names the defect it pins down."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from async_stager import Checkpointer, CheckpointError, IntegrityError, InvalidOptionError, Shutdown, Stager

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    """asyncio and trio (uvloop adds nothing here: the defects are in the disk protocol
    and the Checkpointer's own bookkeeping, which test_checkpointer.py runs on all three)."""
    return request.param


ASYNCIO_ONLY = pytest.mark.parametrize("anyio_backend", ["asyncio"])


def trained(seed: int = 0, steps: int = 3) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(steps):
        model(torch.randn(4, 6)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return model, opt, sched


def fresh() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    return trained(seed=99, steps=0)


def same_optim(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    if sorted(sa["state"]) != sorted(sb["state"]) or sa["param_groups"] != sb["param_groups"]:
        return False
    return all(
        sorted(sa["state"][k]) == sorted(sb["state"][k])
        and all(torch.equal(sa["state"][k][n], sb["state"][k][n]) for n in sa["state"][k])
        for k in sa["state"]
    )


def same_model(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


# -- 1. silent loss of state at restore ----------------------------------------------------


@pytest.mark.parametrize("fmt", ["dcp", "torch"])
async def test_resume_into_fresh_objects_restores_every_saved_value(tmp_path: Path, fmt: Any) -> None:
    model, opt, sched = trained()
    extra = {"history": [1.5, 2.5], "nested": {"t": torch.arange(4), "names": ["a", "b"]}}
    async with Checkpointer(tmp_path, format=fmt) as ckpt:
        await ckpt.save({"model": model, "optim": opt, "sched": sched, "n": 7, "extra": extra}, step=3)
        await ckpt.wait()
    m2, o2, s2 = fresh()
    assert not o2.state_dict()["state"]  # a fresh optimizer: no state yet
    state: dict[str, Any] = {"model": m2, "optim": o2, "sched": s2}
    async with Checkpointer(tmp_path, format=fmt) as ckpt:
        assert await ckpt.restore(state) == 3
    assert same_model(model, m2)
    assert same_optim(opt, o2), "the optimizer's exp_avg/exp_avg_sq/step were dropped"
    assert s2.state_dict() == sched.state_dict()
    assert state["n"] == 7  # saved keys the state lacked are added
    assert state["extra"]["history"] == [1.5, 2.5] and state["extra"]["nested"]["names"] == ["a", "b"]
    assert torch.equal(state["extra"]["nested"]["t"], torch.arange(4))
    # Training continues identically from the restored optimizer.
    x = torch.randn(4, 6)
    for m, o in ((model, opt), (m2, o2)):
        m(x).square().mean().backward()
        o.step()
    assert same_model(model, m2)


@pytest.mark.parametrize("fmt", ["dcp", "torch"])
async def test_an_optimizer_with_no_state_yet_round_trips(tmp_path: Path, fmt: Any) -> None:
    model, opt, _ = trained(steps=0)
    async with Checkpointer(tmp_path, format=fmt) as ckpt:
        await ckpt.save({"model": model, "optim": opt}, step=0)
        await ckpt.wait()
        m2, o2, _ = fresh()
        assert await ckpt.restore({"model": m2, "optim": o2}) == 0
    assert same_model(model, m2) and same_optim(opt, o2)


@dataclasses.dataclass
class Config:
    lr: float
    table: torch.Tensor


async def test_torch_format_refuses_at_save_what_it_cannot_restore(tmp_path: Path) -> None:
    async with Checkpointer(tmp_path, format="torch") as ckpt:
        await ckpt.save({"w": torch.ones(2)}, step=1)
        with pytest.raises(CheckpointError, match=r"state\['extra'\]\['cfg'\].*Config.*weights_only"):
            ckpt.save({"w": torch.ones(2), "extra": {"cfg": Config(0.1, torch.ones(3))}}, step=2)  # type: ignore[unused-coroutine]
        await ckpt.save({"w": torch.full((2,), 3.0)}, step=3)  # still usable
        await ckpt.wait()
        out: dict[str, Any] = {"w": torch.zeros(2)}
        assert await ckpt.restore(out) == 3 and out["w"].tolist() == [3.0, 3.0]
        assert ckpt.steps() == [1, 3]


async def test_dcp_format_restores_a_dataclass_with_a_tensor_inside(tmp_path: Path) -> None:
    cfg = Config(0.5, torch.arange(3.0))
    async with Checkpointer(tmp_path) as ckpt:
        await ckpt.save({"cfg": cfg, "w": torch.ones(2)}, step=1)
        await ckpt.wait()
        out: dict[str, Any] = {"w": torch.zeros(2)}
        assert await ckpt.restore(out) == 1
    assert out["cfg"].lr == 0.5 and torch.equal(out["cfg"].table, torch.arange(3.0))


def _flip(path: Path, needle: bytes) -> None:
    data = bytearray(path.read_bytes())
    i = data.find(needle)
    assert i >= 0, f"{needle!r} not in {path}"
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


@ASYNCIO_ONLY
@pytest.mark.parametrize("fmt", ["dcp", "torch"])
@pytest.mark.parametrize("what", ["string", "int", "tensor-in-object"])
async def test_a_corrupted_non_tensor_value_never_restores_silently(
    tmp_path: Path, fmt: Any, what: str
) -> None:
    def state(i: int) -> dict[str, Any]:
        value: Any = {"string": f"marker-{i}-zzzz", "int": 1_234_567_000 + i}.get(what)
        if what == "tensor-in-object":
            value = (
                [{"deep": torch.full((4,), 77_000.0 + i)}]
                if fmt == "torch"
                else Config(1.0, torch.full((4,), 77_000.0 + i))
            )
        return {"w": torch.ones(3) * i, "v": value}

    needles = {
        "string": b"marker-2-zzzz",
        "int": (1_234_567_002).to_bytes(4, "little"),
        "tensor-in-object": torch.tensor([77_002.0]).numpy().tobytes(),
    }
    async with Checkpointer(tmp_path, format=fmt) as ckpt:
        for i in (1, 2):
            await ckpt.save(state(i), step=i)
        await ckpt.wait()
    folder = tmp_path / "step-00000002"
    data_file = folder / ("state.pt" if fmt == "torch" else "__0_0.distcp")
    _flip(data_file, needles[what])
    async with Checkpointer(tmp_path, format=fmt) as ckpt:
        out: dict[str, Any] = {"w": torch.zeros(3)}
        with pytest.raises(IntegrityError) as info:
            await ckpt.restore(out, fallback=False)
        assert info.value.step == 2
        out = {"w": torch.zeros(3)}
        assert await ckpt.restore(out) == 1  # falls back to the newest good commit
        assert out["w"].tolist() == [1.0, 1.0, 1.0]


# -- 2. commits that lose or mix checkpoints -------------------------------------------------


async def _awaits(coro: Any) -> None:
    await coro


async def test_save_run_as_a_task_snapshots_at_the_call_and_fence_covers_it(tmp_path: Path) -> None:
    w = torch.zeros(1000)
    async with Checkpointer(tmp_path) as ckpt, anyio.create_task_group() as tg:
        for step in (1, 2, 3):
            w.fill_(float(step))
            coro = ckpt.save({"w": w}, step=step)
            tg.start_soon(_awaits, coro)  # the task has not run yet
            await ckpt.fence()
            w.fill_(float(step) + 0.5)  # training changes the sources after fence()
        await ckpt.wait()
    async with Checkpointer(tmp_path) as ckpt:
        for step in (1, 2, 3):
            out = {"w": torch.empty(1000)}
            assert await ckpt.restore(out, step=step) == step
            assert out["w"].unique().tolist() == [float(step)], f"step {step} holds another step's values"


async def test_the_same_step_twice_in_flight_commits_the_later_save_whole(tmp_path: Path) -> None:
    async with Checkpointer(tmp_path, max_in_flight=2) as ckpt:
        await ckpt.save({"w": torch.full((1 << 16,), 1.0), "tag": "periodic"}, step=5)
        await ckpt.save({"w": torch.full((1 << 16,), 2.0), "tag": "final"}, step=5)
        await ckpt.wait()
        assert ckpt.steps() == [5]
        out: dict[str, Any] = {"w": torch.empty(1 << 16)}
        assert await ckpt.restore(out, fallback=False) == 5
    assert out["tag"] == "final" and out["w"].unique().tolist() == [2.0]
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")]


async def test_order_is_commit_order_and_retention_never_deletes_the_newest(tmp_path: Path) -> None:
    committed: list[int] = []
    async with Checkpointer(tmp_path, keep=5) as ckpt:
        for step in (100, 200):
            await ckpt.save({"w": torch.full((3,), float(step))}, step=step)
        await ckpt.wait()
    # A rollback (or a new run in the same folder) saves lower steps afterwards.
    async with Checkpointer(tmp_path, keep=1, on_saved=lambda s: committed.append(s.step)) as ckpt:
        for step in (10, 20):
            await ckpt.save({"w": torch.full((3,), float(step))}, step=step)
            await ckpt.wait()
            assert ckpt.steps() == [step], "the newest commit was deleted by retention"
        out = {"w": torch.zeros(3)}
        assert await ckpt.restore(out) == 20 and out["w"].tolist() == [20.0] * 3
    assert committed == [10, 20]
    assert (tmp_path / "latest").read_text().strip() == "step-00000020"


async def test_steps_lists_commits_oldest_first_across_a_rollback(tmp_path: Path) -> None:
    async with Checkpointer(tmp_path, keep=10) as ckpt:
        for step in (1, 5, 3, 5):
            await ckpt.save({"w": torch.full((2,), float(step))}, step=step)
        await ckpt.wait()
        assert ckpt.steps() == [1, 3, 5]  # 5 saved again: the newest commit


@pytest.mark.parametrize("policy", ["wait", "skip"])
@pytest.mark.parametrize("max_in_flight", [1, 2])
async def test_concurrent_saves_from_several_tasks_obey_the_policy(
    tmp_path: Path, policy: Any, max_in_flight: int
) -> None:
    results: dict[int, bool] = {}
    async with Checkpointer(tmp_path, keep=100, policy=policy, max_in_flight=max_in_flight) as ckpt:

        async def one(step: int) -> None:
            results[step] = await ckpt.save({"w": torch.full((1 << 14,), float(step))}, step=step)

        async with anyio.create_task_group() as tg:
            for step in range(1, 7):
                tg.start_soon(one, step)
        await ckpt.wait()
        accepted = sorted(s for s, ok in results.items() if ok)
        assert sorted(ckpt.steps()) == accepted, "a save that returned True was never written"
        assert sorted(ckpt.dropped) == sorted(s for s, ok in results.items() if not ok)
        if policy == "wait":
            assert accepted == list(range(1, 7))
        for s in accepted:
            out = {"w": torch.empty(1 << 14)}
            assert await ckpt.restore(out, step=s) == s and out["w"].unique().tolist() == [float(s)]


class Slow:
    """Pickled by DCP's writer (a bytes item): blocks the write (not the stage, which
    copies it in the stager's thread) until released."""

    gate: Any = None

    def __reduce__(self) -> Any:
        import threading

        if Slow.gate is not None and "dcp-save" in threading.current_thread().name:
            Slow.gate.wait(20)
        return (Slow, ())


class Unstageable:
    """Raises when the stager copies it: a stage that fails."""

    def __deepcopy__(self, memo: Any) -> Any:
        raise RuntimeError("cannot copy this")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise RuntimeError("cannot copy this")


async def test_coalesce_keeps_the_queued_save_when_its_replacement_fails_to_stage(tmp_path: Path) -> None:
    import threading

    Slow.gate = threading.Event()
    try:
        async with Checkpointer(tmp_path, keep=10, policy="coalesce") as ckpt:
            await ckpt.save({"w": torch.full((4,), 1.0), "slow": Slow()}, step=1)  # writing
            await ckpt.save({"w": torch.full((4,), 2.0)}, step=2)  # queued
            with pytest.raises(Exception, match="cannot copy this"):
                await ckpt.save({"w": torch.full((4,), 3.0), "bad": Unstageable()}, step=3)
            with anyio.move_on_after(0):  # a replacement cancelled while staging
                await ckpt.save({"w": torch.full((4,), 4.0)}, step=4)
            Slow.gate.set()
            await ckpt.wait()
            assert ckpt.steps() == [1, 2], "the queued save was dropped before its replacement staged"
            assert ckpt.dropped == []
    finally:
        Slow.gate.set()
        Slow.gate = None


async def test_coalesce_replaces_the_queued_save_once_the_new_one_is_staged(tmp_path: Path) -> None:
    import threading

    Slow.gate = threading.Event()
    try:
        async with Checkpointer(tmp_path, keep=10, policy="coalesce") as ckpt:
            await ckpt.save({"w": torch.full((4,), 1.0), "slow": Slow()}, step=1)
            await ckpt.save({"w": torch.full((4,), 2.0)}, step=2)
            await ckpt.save({"w": torch.full((4,), 3.0)}, step=3)
            Slow.gate.set()
            await ckpt.wait()
            assert ckpt.steps() == [1, 3] and ckpt.dropped == [2]
    finally:
        Slow.gate.set()
        Slow.gate = None


async def test_a_second_checkpointer_never_deletes_a_live_writers_folder(tmp_path: Path) -> None:
    import threading

    Slow.gate = threading.Event()
    try:
        async with Checkpointer(tmp_path) as first:
            await first.save({"w": torch.ones(4), "slow": Slow()}, step=1)
            with anyio.fail_after(10):
                while not (tmps := [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")]):
                    await anyio.sleep(0.01)
            async with Checkpointer(tmp_path) as second:  # an eval job, a restarted trainer
                assert await second.restore({"w": torch.zeros(4)}) is None
            assert os.listdir(tmp_path).count(tmps[0]) == 1
            Slow.gate.set()
            await first.wait()
            assert first.steps() == [1]
    finally:
        Slow.gate.set()
        Slow.gate = None


_CHILD = textwrap.dedent(
    """
    import os, sys, time, anyio, torch
    from async_stager import Checkpointer
    import threading
    class Stuck:
        def __reduce__(self):
            if "dcp-save" in threading.current_thread().name:
                print("writing", flush=True)
                time.sleep(60)
            return (Stuck, ())
    async def main():
        async with Checkpointer(sys.argv[1]) as ckpt:
            await ckpt.save({"w": torch.ones(4), "stuck": Stuck()}, step=7)
            await ckpt.wait()
    anyio.run(main)
    """
)


@ASYNCIO_ONLY
async def test_a_dead_writers_leftovers_are_removed_at_the_next_open(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        line = await anyio.to_thread.run_sync(child.stdout.readline)
        assert line.strip() == "writing"
        assert [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")]
        async with Checkpointer(tmp_path):  # the live writer's folder stays
            assert [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")]
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        if child.stdout is not None:
            child.stdout.close()
    async with Checkpointer(tmp_path) as ckpt:
        assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")]
        assert len([p for p in os.listdir(tmp_path) if p.startswith(".writer-")]) == 1  # this one's
        assert ckpt.steps() == []
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".writer-")]


# -- 3. failures end in a clear error and a usable folder -------------------------------------


class FailsMidWrite:
    """Fails while DCP writes (after earlier items reached the file), as a full disk
    would; the stager, which copies it in its own thread, sees no error."""

    def __reduce__(self) -> Any:
        import threading

        if "dcp-save" in threading.current_thread().name:
            raise OSError(28, "No space left on device")
        return (FailsMidWrite, ())


async def test_a_failed_write_removes_its_folder_and_later_saves_work(tmp_path: Path) -> None:
    async with Checkpointer(tmp_path) as ckpt:
        await ckpt.save({"a": torch.ones(1 << 16), "z": FailsMidWrite()}, step=1)
        with pytest.raises(CheckpointError) as info:
            await ckpt.wait()
        assert info.value.step == 1
        assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")]
        await ckpt.save({"a": torch.ones(4)}, step=2)
        await ckpt.wait()
        assert ckpt.steps() == [2]


@ASYNCIO_ONLY
@pytest.mark.parametrize("damage", ["truncate", "delete"])
async def test_a_damaged_dcp_data_file_is_an_integrity_error_and_falls_back(
    tmp_path: Path, damage: str
) -> None:
    async with Checkpointer(tmp_path) as ckpt:
        for step in (1, 2):
            await ckpt.save({"w": torch.full((1 << 12,), float(step))}, step=step)
        await ckpt.wait()
    data = tmp_path / "step-00000002" / "__0_0.distcp"
    if damage == "truncate":
        data.write_bytes(data.read_bytes()[:100])
    else:
        data.unlink()
    for checksum in (True, False):
        async with Checkpointer(tmp_path, checksums=checksum) as ckpt:
            with pytest.raises(IntegrityError):
                await ckpt.restore({"w": torch.zeros(1 << 12)}, fallback=False)
            out = {"w": torch.zeros(1 << 12)}
            assert await ckpt.restore(out) == 1 and out["w"].unique().tolist() == [1.0]


@ASYNCIO_ONLY
@pytest.mark.parametrize(
    "damage",
    [
        lambda doc: doc["tensors"]["w@0"].update(digest=None),
        lambda doc: doc["tensors"]["w@0"].pop("shape"),
        lambda doc: doc.update(tensors=[]),
        lambda doc: doc["tensors"].update({"w@0": [1, 2]}),
        lambda doc: doc["files"].update({".metadata": {"bytes": "x", "digest": [1]}}),
        lambda doc: doc.update(
            objects={"n": {"file": "../../etc/passwd", "offset": 0, "length": 1, "bytes": 1, "digest": [1]}}
        ),
    ],
    ids=["null-digest", "missing-field", "list-for-object", "list-entry", "bad-file-entry", "escaping-path"],
)
async def test_a_damaged_manifest_is_an_integrity_error(tmp_path: Path, damage: Any) -> None:
    async with Checkpointer(tmp_path) as ckpt:
        for step in (1, 2):
            await ckpt.save({"w": torch.full((8,), float(step)), "n": step}, step=step)
        await ckpt.wait()
    path = tmp_path / "step-00000002" / "checksums.json"
    doc = json.loads(path.read_text())
    damage(doc)
    path.write_text(json.dumps(doc))
    async with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(IntegrityError):
            await ckpt.restore({"w": torch.zeros(8)}, fallback=False)
        out: dict[str, Any] = {"w": torch.zeros(8)}
        assert await ckpt.restore(out) == 1 and out["n"] == 1


async def test_restore_into_a_mismatched_state_names_the_key_and_both_shapes(tmp_path: Path) -> None:
    async with Checkpointer(tmp_path) as ckpt:
        await ckpt.save({"model": {"w": torch.ones(3, 4), "b": torch.ones(4)}}, step=1)
        await ckpt.wait()
        with pytest.raises(
            CheckpointError, match=r"state\['model'\]\['w'\] has shape \(5, 4\).*\(3, 4\)"
        ) as info:
            await ckpt.restore({"model": {"w": torch.zeros(5, 4), "b": torch.zeros(4)}})
        assert not isinstance(info.value, IntegrityError) and info.value.step == 1
        with pytest.raises(CheckpointError, match=r"state\['model'\]\['bias'\] is not in checkpoint step 1"):
            await ckpt.restore({"model": {"w": torch.zeros(3, 4), "bias": torch.zeros(4)}})


async def test_an_on_saved_callback_that_raises_never_cancels_the_caller(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def boom(stats: Any) -> None:
        raise RuntimeError("callback bug")

    steps_done = 0
    with caplog.at_level(logging.ERROR, logger="async_stager.checkpoint"):
        async with Checkpointer(tmp_path, on_saved=boom) as ckpt:
            for step in range(1, 4):
                await ckpt.save({"w": torch.full((4,), float(step))}, step=step)
                await anyio.sleep(0.05)  # the training loop's own awaits must not be cancelled
                steps_done += 1
            await ckpt.wait()
            assert ckpt.steps() == [1, 2, 3]
    assert steps_done == 3
    assert "callback bug" in caplog.text and "on_saved" in caplog.text


@ASYNCIO_ONLY
@pytest.mark.parametrize("step", [1.0, "1", None, True, -1])
async def test_a_bad_step_is_refused_naming_the_argument(tmp_path: Path, step: Any) -> None:
    async with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(InvalidOptionError, match=r"save\(step=\.\.\.\) must be an int >= 0"):
            ckpt.save({"w": torch.ones(2)}, step=step)  # type: ignore[unused-coroutine]
        assert await ckpt.save({"w": torch.ones(2)}, step=1)


@ASYNCIO_ONLY
async def test_a_read_only_folder_opens_for_restore(tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a tmpfs here (needs CAP_SYS_ADMIN)")
    try:
        folder = mnt / "ckpt"
        async with Checkpointer(folder) as ckpt:
            await ckpt.save({"w": torch.ones(4)}, step=1)
            await ckpt.wait()
        (folder / "latest").unlink()  # stale: an open that repairs it would need to write
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        async with Checkpointer(folder) as ckpt:  # an archive, a read-only mount
            assert ckpt.steps() == [1]
            out = {"w": torch.zeros(4)}
            assert await ckpt.restore(out) == 1 and out["w"].tolist() == [1.0] * 4
            with pytest.raises(CheckpointError, match="restore only"):
                ckpt.save({"w": torch.ones(4)}, step=2)  # type: ignore[unused-coroutine]
        async with Checkpointer(mnt / "missing") as ckpt:  # cannot even be created
            assert await ckpt.restore({"w": torch.zeros(4)}) is None
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


async def test_shutdown_after_a_missed_deadline_leaves_the_block_at_once(tmp_path: Path) -> None:
    import threading

    Slow.gate = threading.Event()
    try:
        with anyio.fail_after(10):
            async with Checkpointer(tmp_path) as ckpt, Shutdown() as stop:
                await ckpt.save({"w": torch.ones(2)}, step=1)
                await ckpt.wait()
                await ckpt.save({"w": torch.ones(2), "slow": Slow()}, step=2)  # stuck
                stop.request()
                assert await stop.final_checkpoint(ckpt, {"w": torch.ones(2)}, step=3, deadline=0.3) == 1
        assert ckpt.steps() == [1]  # step 2 was abandoned at exit; step 1 is the newest
    finally:
        Slow.gate.set()
        Slow.gate = None
    async with Checkpointer(tmp_path) as ckpt:
        assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")]
        assert ckpt.steps() == [1]


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_shutdown_puts_the_previous_handler_back_and_names_the_signal(anyio_backend: str) -> None:
    seen: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
    try:
        handler = signal.getsignal(signal.SIGTERM)
        async with Shutdown() as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            with anyio.fail_after(5):
                await stop.wait()
            assert stop.signal == signal.SIGTERM and getattr(stop.signal, "name", None) == "SIGTERM"
        assert signal.getsignal(signal.SIGTERM) == handler
        assert seen == []
    finally:
        signal.signal(signal.SIGTERM, previous)


# -- 2, several ranks: a step mismatch fails loudly ---------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _mismatch_rank(rank: int, world: int, port: int, folder: str) -> None:
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:

        async def main() -> None:
            async with Checkpointer(folder) as ckpt:
                await ckpt.save({"w": torch.ones(4) * rank}, step=10 + rank)  # ranks disagree
                try:
                    await ckpt.wait()
                except CheckpointError as exc:
                    assert "different steps" in str(exc), exc
                else:
                    raise AssertionError(f"rank {rank}: a step mismatch committed")
                assert ckpt.steps() == []

        anyio.run(main)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # 2 spawned gloo ranks: CI's second call
@pytest.mark.timeout(90)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_ranks_saving_different_steps_fail_loudly(tmp_path: Path, anyio_backend: str) -> None:
    folder = str(tmp_path / "ckpt")
    await anyio.to_thread.run_sync(
        lambda: mp.spawn(_mismatch_rank, args=(2, _free_port(), folder), nprocs=2, join=True)
    )
    assert not [p for p in os.listdir(folder) if p.startswith(("step-", ".tmp-"))]


async def test_stager_with_too_few_buffer_sets_is_refused(tmp_path: Path) -> None:
    async with Stager(max_buffer_sets=2) as stager:
        with pytest.raises(InvalidOptionError, match="max_buffer_sets=3"):
            Checkpointer(tmp_path, stager=stager, policy="coalesce")


# -- an interrupt inside DCP's reader stops the restore -----------------------------------------


@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("checksum", [True, False], ids=["verify_dcp", "load_dcp"])
async def test_an_interrupt_inside_dcps_reader_stops_restore_instead_of_falling_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, checksum: bool, stop: type[BaseException]
) -> None:
    """DCP's loader catches BaseException and raises a CheckpointException that carries
    it: a Ctrl-C while step 2 is read must stop ``restore(fallback=True)``, not count
    as a damaged step 2 and restore step 1 (with checksums, in ``verify_dcp``'s read;
    without, in ``load_dcp``'s)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    async with Checkpointer(tmp_path, keep=2, checksums=checksum) as ckpt:
        for step in (1, 2):
            await ckpt.save({"w": torch.full((64,), float(step))}, step=step)
        await ckpt.wait()
    reads: list[int] = []

    def interrupted(self: Any, plan: Any, planner: Any) -> Any:
        reads.append(1)
        raise stop()

    monkeypatch.setattr(dcp.FileSystemReader, "read_data", interrupted)
    # The premise: DCP wraps it (a bare interrupt would pass any except clause anyway).
    with pytest.raises(CheckpointException) as wrapped, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"w": torch.zeros(64)}, checkpoint_id=str(tmp_path / "step-00000001"), no_dist=True)
    assert any(isinstance(f[0] if isinstance(f, tuple) else f, stop) for f in wrapped.value.failures.values())
    reads.clear()
    async with Checkpointer(tmp_path, checksums=checksum) as ckpt:
        out = {"w": torch.zeros(64)}
        with pytest.raises(stop) as info:
            await ckpt.restore(out)
        assert not isinstance(info.value, IntegrityError)
        assert reads == [1]  # step 2 only: no fallback to step 1
        assert out["w"].unique().tolist() == [0.0]  # nothing loaded
        monkeypatch.undo()
        assert await ckpt.restore(out) == 2 and out["w"].unique().tolist() == [2.0]


# -- a damaged manifest says what is wrong ------------------------------------------------------


def _set_first(doc: dict[str, Any], field: str, value: Any) -> None:
    doc["tensors"]["w@0"][field] = value


def _first_format(doc: dict[str, Any], crc: Any) -> None:
    entry = doc["tensors"]["w@0"]
    entry["crc32"] = crc
    del entry["digest"]
    doc.update(format="async_stager-checksums/1", hash="crc32", piece_bytes=16 * 2**20)


@ASYNCIO_ONLY
@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            lambda doc: _set_first(doc, "digest", None),
            "entry 'w@0': 'digest' is null, not a list of unsigned",
        ),
        (lambda doc: _set_first(doc, "digest", [2**64]), "'digest' is [18446744073709551616], not a list"),
        (lambda doc: doc["tensors"]["w@0"].pop("fqn"), "entry 'w@0' has no 'fqn'"),
        (lambda doc: _set_first(doc, "hash", 7), "entry 'w@0': 'hash' is 7, not a string"),
        (lambda doc: doc.update(tensors=[]), "'tensors' is a list, not an object"),
        (lambda doc: doc.update(files=None), "'files' is null, not an object"),
        (lambda doc: doc.pop("objects"), "has no 'objects' table"),
        (lambda doc: doc["objects"].update(n={"file": "x"}), "value 'n' has no 'offset'"),
        (lambda doc: _first_format(doc, [2**40]), "'crc32' is [1099511627776], not a list of unsigned"),
        (lambda doc: _first_format(doc, None), "'crc32' is null"),
        (lambda doc: doc.update(format="async_stager-checksums/1"), "this version reads"),
        (
            lambda doc: doc.update(format="async_stager-checksums/1", hash="crc32", piece_bytes=16 * 2**20),
            "entry 'w@0' has no 'crc32'",
        ),
    ],
    ids=[
        "null-digest",
        "digest-over-64-bits",
        "no-fqn",
        "hash-not-a-string",
        "tensors-is-a-list",
        "files-is-null",
        "no-objects",
        "object-entry-short",
        "crc-over-32-bits",
        "crc-null",
        "format-1-named-with-xxh3",
        "format-1-digest-without-crc",
    ],
)
async def test_a_damaged_manifest_names_what_is_wrong_on_restore(
    tmp_path: Path, damage: Any, message: str
) -> None:
    """``restore`` and ``python -m async_stager verify`` share one check of
    ``checksums.json``: restore's IntegrityError names the field and what it holds,
    and the older step still restores."""
    async with Checkpointer(tmp_path) as ckpt:
        for step in (1, 2):
            await ckpt.save({"w": torch.full((8,), float(step)), "n": step}, step=step)
        await ckpt.wait()
    path = tmp_path / "step-00000002" / "checksums.json"
    doc = json.loads(path.read_text())
    damage(doc)
    path.write_text(json.dumps(doc))
    async with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(IntegrityError) as info:
            await ckpt.restore({"w": torch.zeros(8)}, fallback=False)
        assert message in str(info.value) and "checksums.json" in str(info.value), info.value
        assert info.value.step == 2
        out: dict[str, Any] = {"w": torch.zeros(8)}
        assert await ckpt.restore(out) == 1 and out["n"] == 1


@ASYNCIO_ONLY
@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: p.unlink(), "checksums.json is missing"),
        (lambda p: p.write_text("[]"), "checksums.json holds a list, not an object"),
        (lambda p: p.write_text("{"), "checksums.json is not valid JSON"),
        (lambda p: p.write_text("[" * 100_000 + "]" * 100_000), "checksums.json is not valid JSON"),
        (lambda p: p.write_bytes(b"\xff\xfe{}"), "checksums.json is not UTF-8 text"),
    ],
    ids=["missing", "a-list", "invalid-json", "nested-too-deep", "not-utf8"],
)
async def test_an_unreadable_manifest_names_why_on_restore(tmp_path: Path, damage: Any, message: str) -> None:
    async with Checkpointer(tmp_path) as ckpt:
        for step in (1, 2):
            await ckpt.save({"w": torch.full((8,), float(step))}, step=step)
        await ckpt.wait()
    damage(tmp_path / "step-00000002" / "checksums.json")
    async with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(IntegrityError, match=message) as info:
            await ckpt.restore({"w": torch.zeros(8)}, fallback=False)
        assert info.value.step == 2
        out = {"w": torch.zeros(8)}
        assert await ckpt.restore(out) == 1 and out["w"].unique().tolist() == [1.0]


# -- found by the hostile probe -----------------------------------------------------------


async def test_awaiting_two_saves_in_reverse_order_does_not_deadlock(tmp_path: Path) -> None:
    async with Checkpointer(tmp_path) as ckpt:
        first = ckpt.save({"t": torch.zeros(10)}, step=1)
        second = ckpt.save({"t": torch.ones(10)}, step=2)
        with anyio.fail_after(20):
            assert await second
            assert await first
            await ckpt.wait()
        assert ckpt.steps() == [1, 2]


@pytest.mark.parametrize("policy", ["wait", "coalesce"])
async def test_a_save_cancelled_before_it_returned_is_never_committed(tmp_path: Path, policy: Any) -> None:
    import random

    rnd = random.Random(1)
    returned: list[int] = []
    cancelled: list[int] = []
    t = torch.zeros(1 << 14)
    async with Checkpointer(tmp_path, keep=10**6, max_in_flight=3, policy=policy) as ckpt:
        for step in range(60):
            t.fill_(float(step))
            with anyio.move_on_after(rnd.choice([1e-4, 5e-4, 1e-3, 3e-3])) as scope:
                await ckpt.save({"t": t}, step=step)
            (cancelled if scope.cancelled_caught else returned).append(step)
            await ckpt.fence()
        await ckpt.wait()
        committed = ckpt.steps()
        assert not set(committed) & set(cancelled), "a cancelled save was committed"
        assert set(committed) == set(returned) - set(ckpt.dropped)
        for step in committed[-3:]:
            out = {"t": torch.empty(1 << 14)}
            assert await ckpt.restore(out, step=step) == step and out["t"].unique().tolist() == [float(step)]
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")]


@ASYNCIO_ONLY
async def test_a_dict_keyed_by_ints_restores_as_a_dict_into_an_empty_state(tmp_path: Path) -> None:
    async with Checkpointer(tmp_path) as ckpt:
        await ckpt.save({"d": {0: torch.ones(2), 10: torch.zeros(3)}, "l": [torch.ones(1), 5]}, step=1)
        await ckpt.wait()
        out: dict[str, Any] = {}
        assert await ckpt.restore(out) == 1
    assert sorted(out["d"]) == [0, 10] and torch.equal(out["d"][10], torch.zeros(3))
    assert isinstance(out["l"], list) and out["l"][1] == 5 and torch.equal(out["l"][0], torch.ones(1))


@ASYNCIO_ONLY
async def test_torch_format_refuses_a_mismatched_restore_target(tmp_path: Path) -> None:
    async with Checkpointer(tmp_path, format="torch") as ckpt:
        await ckpt.save({"model": {"w": torch.ones(3)}}, step=1)
        await ckpt.wait()
        w = torch.zeros(4)
        with pytest.raises(CheckpointError, match=r"state\['model'\]\['w'\] has shape \(4,\).*\(3,\)"):
            await ckpt.restore({"model": {"w": w}})
        with pytest.raises(CheckpointError, match=r"state\['extra'\] is not in checkpoint step 1"):
            await ckpt.restore({"model": {"w": torch.zeros(3)}, "extra": 5})
        assert w.tolist() == [0.0] * 4  # nothing loaded


async def test_budgeted_saves_back_to_back_commit_and_a_cancelled_one_commits_nothing(tmp_path: Path) -> None:
    state = {f"w{i}": torch.zeros(1 << 18) for i in range(8)}  # 8 x 1 MiB through a 2 MiB ring

    def fill(v: float) -> None:
        for t in state.values():
            t.fill_(v)

    async with Checkpointer(tmp_path, keep=10, host_budget_bytes=2 << 20) as ckpt:
        fill(1.0)
        first = ckpt.save(state, step=1)
        second = ckpt.save({k: v.clone() + 1 for k, v in state.items()}, step=2)
        with anyio.fail_after(30):
            assert await first and await second
            await ckpt.wait()
        assert ckpt.steps() == [1, 2]
        fill(3.0)
        with anyio.move_on_after(0.001) as scope:
            await ckpt.save(state, step=3)
        fill(4.0)  # "nothing is saved": a cancelled save must not commit these values
        await ckpt.wait()
        assert scope.cancelled_caught, "the save finished within 1 ms: make the state bigger"
        assert ckpt.steps() == [1, 2]
        out = {k: torch.empty(1 << 18) for k in state}
        step = await ckpt.restore(out)
        assert all(t.unique().tolist() == [float(step or 0)] for t in out.values())
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")]


async def test_skip_gives_the_background_write_its_turns(tmp_path: Path) -> None:
    """A loop whose only await is save() with policy "skip" still gets its writes done."""
    import time

    t = torch.zeros(1 << 12)
    accepted = 0
    async with Checkpointer(tmp_path, keep=100, policy="skip") as ckpt:
        for step in range(2000):
            time.sleep(0.002)  # a training step: blocks the loop, as compute does
            t.fill_(float(step))
            accepted += await ckpt.save({"t": t}, step=step)
            await ckpt.fence()
            if len(ckpt.steps()) >= 2:
                break
        assert accepted >= 2 and len(ckpt.steps()) >= 2, "nothing committed while the loop ran"
        await ckpt.wait()


_EXIT_CHILD = textwrap.dedent(
    """
    import sys, tempfile, anyio, torch
    from async_stager import Checkpointer, Shutdown
    async def main():
        async with Shutdown() as stop, Checkpointer(sys.argv[2]) as ckpt:
            await ckpt.save({"t": torch.randn(2**25)}, step=1)
            return await stop.final_checkpoint(ckpt, {"t": torch.randn(2**25)}, step=2, deadline=0.01)
    sys.exit(anyio.run(main, backend=sys.argv[1]))
    """
)


@pytest.mark.timeout(300)  # a hang guard, not a speed check (see CONTRIBUTING.md, "Tests")
async def test_a_missed_final_checkpoint_exits_with_its_status(tmp_path: Path, anyio_backend: str) -> None:
    """The abandoned write's thread is still in torch when the interpreter exits:
    finalizing under it used to abort (status 134) instead of the 1 a scheduler reads."""
    run = await anyio.run_process(
        [sys.executable, "-c", _EXIT_CHILD, anyio_backend, str(tmp_path / "ckpt")], check=False
    )
    assert run.returncode == 1, run.stderr.decode()[-2000:]
    assert b"terminate called" not in run.stderr


@ASYNCIO_ONLY
@pytest.mark.parametrize("damage", ["garbage", "missing"])
async def test_a_damaged_commit_record_never_demotes_the_newest_step(tmp_path: Path, damage: str) -> None:
    async with Checkpointer(tmp_path, keep=2) as ckpt:
        for step in (1, 2):
            await ckpt.save({"t": torch.full((4,), float(step))}, step=step)
        await ckpt.wait()
    record = tmp_path / "step-00000002" / "COMMIT"
    if damage == "garbage":
        record.write_text("{")
    else:
        record.unlink()
    async with Checkpointer(tmp_path, keep=2) as ckpt:
        assert ckpt.steps() == [1]  # step 2 cannot be placed in commit order: not listed
        out = {"t": torch.zeros(4)}
        assert await ckpt.restore(out) == 1
        await ckpt.save({"t": torch.full((4,), 3.0)}, step=3)
        await ckpt.wait()
        assert ckpt.steps() == [1, 3]
    assert (tmp_path / "step-00000002").is_dir()  # never retired in another's place
