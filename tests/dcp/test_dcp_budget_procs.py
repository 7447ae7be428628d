"""Budgeted DCP saves across processes: the peak RSS growth of a fresh process during a
budgeted save stays within the budget plus a documented constant while an unbudgeted
save's does not, and a two-rank gloo job with DTensors saves within the budget and
loads back bit-exact with plain DCP."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.timeout(600)  # a hang guard, not a speed check (see CONTRIBUTING.md, "Tests")

MIB = 1 << 20
#: What a budgeted save holds besides its ring (docs/concepts.md): DCP's plan and
#: metadata, the serialized non-tensor values, the zip writer's buffers, thread stacks.
OVERHEAD_BYTES = 8 * MIB

_CHILD = r"""
import json, os, sys, threading, time, warnings
import anyio, torch
import async_stager.dcp as adcp
from async_stager import Stager
warnings.filterwarnings("ignore")
mode, out, state_mib, budget = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(1)
sd = {f"w{i}": torch.full((1 << 20,), float(i)) for i in range(state_mib // 4)}  # 4 MiB each
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
async def save(path, **kw):
    async with Stager(pin_memory=False) as stager:
        await adcp.save(sd, stager=stager, checkpoint_id=path, no_dist=True, **kw)
kw = {"host_budget_bytes": budget} if mode == "budget" else {}
# Warm-up (imports, DCP's lazy modules, allocator pools) on a small state.
small = {"w": torch.zeros(16)}
async def warm():
    async with Stager(pin_memory=False) as stager:
        await adcp.save(small, stager=stager, checkpoint_id=out + "-warm", no_dist=True, **({"host_budget_bytes": 4096} if kw else {}))
anyio.run(warm)
peak = [0]
stop = threading.Event()
def sample():
    while not stop.is_set():
        peak[0] = max(peak[0], rss())
        time.sleep(0.0005)
base = rss()
t = threading.Thread(target=sample); t.start()
anyio.run(lambda: save(out, **kw))
stop.set(); t.join()
print(json.dumps({"growth": peak[0] - base}))

"""


def _growth(tmp_path: Path, mode: str, state_mib: int, budget: int) -> int:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    out = str(tmp_path / mode)
    res = subprocess.run(
        [sys.executable, "-c", _CHILD, mode, out, str(state_mib), str(budget)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    growth: int = json.loads(res.stdout.strip().splitlines()[-1])["growth"]
    return growth


@pytest.mark.parametrize(
    ("state_mib", "budget_mib"),
    [(96, 16), pytest.param(1024, 64, marks=[pytest.mark.stress, pytest.mark.timeout(600)])],
)
def test_peak_rss_growth_stays_within_the_budget_while_an_unbudgeted_save_does_not(
    tmp_path: Path, state_mib: int, budget_mib: int
) -> None:
    budget = budget_mib * MIB
    budgeted = _growth(tmp_path, "budget", state_mib, budget)
    full = _growth(tmp_path, "full", state_mib, budget)
    print(f"peak RSS growth: budgeted {budgeted / MIB:.1f} MiB, unbudgeted {full / MIB:.1f} MiB")
    assert budgeted <= budget + OVERHEAD_BYTES, f"budgeted save grew RSS by {budgeted / MIB:.1f} MiB"
    assert full > budget + OVERHEAD_BYTES, f"unbudgeted save grew RSS by only {full / MIB:.1f} MiB"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _full_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(64, 512, generator=g),  # 128 KiB; Shard(0): 64 KiB per rank
        "b": torch.randn(512, generator=g),
        "e": torch.randn(30, 256, generator=g).to(torch.bfloat16),
        **{f"x{i}": torch.randn(32, 256, generator=g) for i in range(6)},  # 32 KiB each
    }


def _rank_main(rank: int, world: int, port: int, ckpt: str) -> None:
    import anyio
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import async_stager.dcp as adcp
    from async_stager import BudgetTooSmallError, Stager

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        full = _full_state()
        mesh = init_device_mesh("cpu", (world,))

        def as_dtensors(src: dict[str, torch.Tensor]) -> dict[str, Any]:
            return {
                "model": {
                    "w": distribute_tensor(src["w"], mesh, [Shard(0)]),
                    "b": distribute_tensor(src["b"], mesh, [Replicate()]),
                    "e": distribute_tensor(src["e"], mesh, [Shard(0)]),
                },
                "plain": {k: v.clone() for k, v in src.items() if k.startswith("x")},
                "step": 3,
            }

        sd = as_dtensors(full)
        stats: list[Any] = []

        async def save() -> None:
            async with Stager() as stager:
                try:  # below the largest local shard (64 KiB): refused at the call, on every rank
                    _ = adcp.save(sd, stager=stager, checkpoint_id=ckpt, host_budget_bytes=60 * 1024)
                    raise AssertionError("not refused")
                except BudgetTooSmallError as e:
                    assert e.path == ("model", "w") and e.needed_bytes == 64 * 1024
                await adcp.save(
                    sd,
                    stager=stager,
                    checkpoint_id=ckpt,
                    host_budget_bytes=96 * 1024,
                    on_budget_stats=stats.append,
                )

        anyio.run(save, backend="asyncio" if rank == 0 else "trio")
        (s,) = stats
        assert s.peak_bytes <= 96 * 1024 and s.pieces >= 2
        fresh = as_dtensors({k: torch.zeros_like(v) for k, v in full.items()})
        fresh["step"] = 0
        dcp.load(fresh, checkpoint_id=ckpt)
        for key in ("w", "b", "e"):
            assert torch.equal(fresh["model"][key].full_tensor(), full[key]), f"rank {rank}: {key}"
        for key, v in fresh["plain"].items():
            assert torch.equal(v, full[key]), f"rank {rank}: {key}"
        assert fresh["step"] == 3
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # 2 spawned gloo ranks: CI's second call
def test_two_ranks_gloo_dtensor_budgeted_save_loads_bit_exact(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    mp.spawn(_rank_main, args=(2, _free_port(), ckpt), nprocs=2, join=True)
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert ".metadata" in files and sum(f.endswith(".distcp") for f in files) == 2


def test_bench_budget_cli_runs_and_loads_back_bit_exact(capsys: pytest.CaptureFixture[str]) -> None:
    from async_stager._cli.main import main

    argv = [
        "bench-budget",
        "--state-mib",
        "8",
        "--tensor-mib",
        "1",
        "--budgets",
        "2,unlimited",
        "--repeat",
        "1",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "copy alone" in out and "write alone" in out
    assert "2 MiB" in out and "unlimited" in out and "False" not in out
