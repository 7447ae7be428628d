"""The whole stack over the real accelerator copier on the simulated device: the
Checkpointer (saves, fence, a stage overlapping writes to the sources, budgeted saves),
DCP's ``async_save`` through ``DefaultStager``, and the writer-process handoff of a
shared staged copy, on asyncio, uvloop and trio; plus a ``stress``-marked run with
large delays and many seeds.

Training is modelled on the device: each step queues its writes to the parameters on
the caller's stream (``sim.launch``), so a stage that is not ordered after the work
queued before its call, or a write not ordered after the copies by ``fence()``, shows
up as wrong bytes in the restored checkpoint.
"""

from __future__ import annotations

import functools
import os
import pickle
import time
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import bits

from async_stager import Checkpointer, CheckpointStagerConfig, DefaultStager, Stager
from async_stager.testing import SimulatedBackend, SimulatedDevice

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.usefixtures("no_thread_leak"),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]


def model(sim: SimulatedDevice, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {f"layer{i}.weight": sim.tensor(torch.randn(64, 32, generator=g)) for i in range(4)}
    sd.update({f"layer{i}.bias": sim.tensor(torch.randn(32, generator=g)) for i in range(4)})
    sd["emb"] = sim.tensor(torch.randn(256, 64, generator=g).bfloat16())
    return sd


def train_step(sim: SimulatedDevice, sd: dict[str, torch.Tensor], step: int, seconds: float = 0.0) -> None:
    """One step's writes to every parameter, queued on the current stream (a slow
    kernel first when ``seconds``)."""

    def run() -> None:
        if seconds:
            time.sleep(seconds)
        for t in sd.values():
            t.add_(float(step))

    sim.launch(run)


def expected(sim: SimulatedDevice, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    sim.synchronize()
    return {k: bits(v.clone()) for k, v in sd.items()}


@pytest.mark.anyio
@pytest.mark.parametrize("budget", [None, 64 * 1024])
async def test_checkpointer_training_loop(tmp_path: Path, anyio_backend: Any, budget: int | None) -> None:
    with SimulatedDevice(seed=21, delay=(0.0, 0.003)) as sim:
        sd = model(sim)
        # What each parameter holds, kept on the host beside the device (the device is
        # never synchronized in the loop: a fence that did not order the next step
        # after the copies would show).
        host = {k: v.clone() for k, v in sd.items()}
        # A CPU leaf (a loss copied back every step, into pinned memory): the copy into
        # it is queued on the caller's stream before the save, so the host copier must
        # wait for the capture before reading it.
        loss_dev = sim.tensor(torch.zeros(256))
        loss = torch.zeros(256)
        train = sim.stream("train")
        saved: dict[int, dict[str, torch.Tensor]] = {}
        stager = Stager(backend=SimulatedBackend(sim))
        async with Checkpointer(tmp_path, keep=5, stager=stager, host_budget_bytes=budget) as ckpt:
            with sim.using(train):
                for step in range(1, 5):
                    # A step still running on the device at the call: its writes are
                    # in the checkpoint; the next step's writes (after fence) are not.
                    train_step(sim, sd, step, seconds=0.01)
                    sim.launch(lambda t, v=float(step): t.fill_(v), loss_dev)
                    sim.copy([loss], [loss_dev])
                    for v in host.values():
                        v.add_(float(step))
                    await ckpt.save({"model": dict(sd), "loss": loss, "step": step}, step=step)
                    saved[step] = {k: bits(v.clone()) for k, v in host.items()}
                    await ckpt.fence()
                    train_step(sim, sd, 100)  # the next step, overlapping the write
                    for v in host.values():
                        v.add_(100.0)
            await ckpt.wait()
            sim.synchronize()
            for k, v in expected(sim, sd).items():  # the mirror kept up with the device
                assert torch.equal(v, bits(host[k])), k
            for step in (2, 4):
                back: dict[str, Any] = {
                    "model": {k: torch.zeros_like(v) for k, v in sd.items()},
                    "loss": torch.zeros(256),
                    "step": 0,
                }
                assert await ckpt.restore(back, step=step) == step
                assert back["step"] == step
                assert torch.equal(back["loss"], torch.full((256,), float(step))), step
                for k, v in saved[step].items():
                    assert torch.equal(bits(back["model"][k]), v), (step, k)
        await stager.aclose()
        assert sim.errors == []


def test_dcp_async_save_through_default_stager(tmp_path: Path) -> None:
    with SimulatedDevice(seed=22) as sim:
        sd: dict[str, Any] = {"model": model(sim), "step": torch.tensor(7)}
        train = sim.stream("train")
        config = CheckpointStagerConfig(use_async_staging=True)
        stager = DefaultStager(config, backend=SimulatedBackend(sim))
        try:
            with sim.using(train):
                train_step(sim, sd["model"], 1, seconds=0.01)  # queued at the call
                want = None
                resp = dcp.async_save(sd, checkpoint_id=str(tmp_path), async_stager=stager, no_dist=True)
                upload = resp.upload_completion if hasattr(resp, "upload_completion") else resp
                if hasattr(resp, "staging_completion"):
                    resp.staging_completion.result(timeout=60)
                want = expected(sim, sd["model"])
                upload.result(timeout=60)
        finally:
            stager.close()
        back: dict[str, Any] = {
            "model": {k: torch.zeros_like(v) for k, v in sd["model"].items()},
            "step": torch.tensor(0),
        }
        dcp.load(back, checkpoint_id=str(tmp_path), no_dist=True)
        assert want is not None and int(back["step"]) == 7
        for k, v in want.items():
            assert torch.equal(bits(back["model"][k]), v), k
        assert sim.errors == []


@pytest.mark.anyio
async def test_shared_staged_copy_reaches_a_writer_without_a_copy(anyio_backend: Any) -> None:
    from async_stager._share import reducers as _mp_reduce

    with SimulatedDevice(seed=23, delay=(0.0, 0.004)) as sim:
        sd = model(sim)
        want = expected(sim, sd)
        async with Stager(backend=SimulatedBackend(sim), share_memory=True) as stager:
            staged = await stager.stage(sd)
            _mp_reduce.counters(reset=True)
            got = pickle.loads(ForkingPickler.dumps(staged))  # what a writer process receives
            assert _mp_reduce.counters().copied_bytes == 0
            for k, v in want.items():
                assert torch.equal(bits(got[k]), v), k
            del staged, got


# -- stress ------------------------------------------------------------------------------


@pytest.mark.stress
@pytest.mark.skipif(
    os.environ.get("ASYNC_STAGER_STRESS") != "1", reason="stress run: set ASYNC_STAGER_STRESS=1"
)
@pytest.mark.timeout(900)
@pytest.mark.parametrize("seed", range(40))
def test_stress_many_seeds_large_delays(tmp_path: Path, seed: int) -> None:
    import anyio

    async def run() -> None:
        with SimulatedDevice(seed=seed, delay=(0.0, 0.05)) as sim:
            sd = model(sim, seed)
            train = sim.stream("train")
            budget = None if seed % 2 else 48 * 1024
            async with Checkpointer(
                tmp_path, keep=2, stager=Stager(backend=SimulatedBackend(sim)), host_budget_bytes=budget
            ) as ckpt:
                with sim.using(train):
                    for step in range(1, 4):
                        train_step(sim, sd, step, seconds=0.02)
                        await ckpt.save({"model": dict(sd), "step": step}, step=step)
                        want = expected(sim, sd)
                        await ckpt.fence()
                        train_step(sim, sd, 100)
                await ckpt.wait()
                back: dict[str, Any] = {"model": {k: torch.zeros_like(v) for k, v in sd.items()}, "step": 0}
                assert await ckpt.restore(back) == 3
                for k, v in want.items():
                    assert torch.equal(bits(back["model"][k]), v), k
                await ckpt.stager.aclose()
            assert sim.errors == []

    anyio.run(functools.partial(run))
