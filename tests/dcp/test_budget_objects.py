"""Budgeted saves (``dcp.save(..., host_budget_bytes=N)``, ``Checkpointer(host_budget_bytes=N)``)
of values DCP pickles whole (its *bytes items*: dataclasses, tuples, user objects, numpy
arrays, lists of numbers, with the tensors inside them).

A tensor inside such a value is streamed through the ring in pieces: a fresh process's
peak RSS growth stays within the budget plus a constant while the value is 64 times
the budget, and the files are byte-identical to plain DCP's. What ``torch.save`` must
hold whole (a value's pickle) is refused with BudgetTooSmallError naming the value,
at the call when it can be seen there, else when it is serialized; small plain values
keep working. A save cancelled after one value was streamed, while the next is being
serialized, leaves no ``.metadata``, releases the fence and leaves the stager usable."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import bits

import async_stager.dcp as adcp
from async_stager import BudgetTooSmallError, Checkpointer, Stager
from async_stager.dcp import BudgetStats

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]

KIB = 1024
MIB = 1 << 20


@dataclasses.dataclass
class Cfg:
    table: torch.Tensor
    name: str


@dataclasses.dataclass
class Holder:
    cfg: Cfg
    scale: float


class Blob:
    """A value whose pickle cannot be seen without pickling it (its own reduce)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __reduce__(self) -> Any:
        return (bytes, (b"x" * self.n,))


def objects_sd(seed: int = 0) -> dict[str, Any]:
    """Tensor items and bytes items of every kind, the inner tensors bigger than the
    64 KiB budget the tests use."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(50_000, generator=g)
    return {
        "w": torch.randn(4000, generator=g),
        "extra": Holder(Cfg(torch.randn(100_000, generator=g), "table"), 0.5),  # 400 KB inside
        "pair": (torch.randn(30_000, generator=g).to(torch.bfloat16), 3),  # a tuple: pickled whole
        "view": (base[10:20],),  # torch.save writes the whole 200 KB storage
        "np": np.arange(3000, dtype=np.int64),
        "lst": [0.25] * 500,
        "optim": {"step": 7, "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0, 1]}]},
    }


def like(sd: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {k: None for k in sd}
    out["w"] = torch.zeros_like(sd["w"])
    # DCP walks into a list of dicts: the skeleton has its shape.
    out["optim"] = {"step": 0, "param_groups": [{"lr": None, "betas": None, "params": None}]}
    return out


def assert_loaded(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert torch.equal(got["w"], want["w"])
    assert torch.equal(bits(got["extra"].cfg.table), bits(want["extra"].cfg.table))
    assert got["extra"].cfg.name == "table" and got["extra"].scale == 0.5
    assert torch.equal(bits(got["pair"][0]), bits(want["pair"][0])) and got["pair"][1] == 3
    assert torch.equal(got["view"][0], want["view"][0])
    assert (got["np"] == want["np"]).all() and got["lst"] == want["lst"]
    assert got["optim"] == want["optim"]


def load(path: Path, sd: dict[str, Any]) -> dict[str, Any]:
    out = like(sd)
    dcp.load(out, checkpoint_id=str(path), no_dist=True)
    return out


# -- within the budget, same files as DCP --------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.usefixtures("no_thread_leak")
async def test_tensors_inside_values_stream_through_the_ring_and_match_plain_dcp(tmp_path: Path) -> None:
    sd = objects_sd()
    stats: list[BudgetStats] = []
    budget = 64 * KIB
    async with Stager() as stager:
        await adcp.save(
            sd,
            stager=stager,
            checkpoint_id=tmp_path / "b",
            no_dist=True,
            host_budget_bytes=budget,
            on_budget_stats=stats.append,
        )
    assert_loaded(load(tmp_path / "b", sd), sd)
    (s,) = stats
    # Every value's bytes went through the ring, in pieces, never more than the budget.
    assert s.peak_bytes <= s.arena_bytes <= budget
    assert s.object_bytes > 400_000 + 60_000 + 200_000 and s.pieces == 1
    assert s.tensor_bytes == 4000 * 4
    # The same bytes plain DCP writes (the streaming changes nothing on disk).
    dcp.save(sd, checkpoint_id=str(tmp_path / "plain"), no_dist=True)
    ours = (tmp_path / "b" / "__0_0.distcp").read_bytes()
    assert ours == (tmp_path / "plain" / "__0_0.distcp").read_bytes()


@pytest.mark.anyio
async def test_small_plain_values_under_a_tiny_budget(tmp_path: Path) -> None:
    sd: dict[str, Any] = {
        "model": {f"b{i}": torch.full((16,), float(i)) for i in range(40)},
        "optim": {
            # str keys: plain DCP loads a bytes item under an int key back under str(key).
            "state": {f"p{i}": {"step": i, "exp_avg": torch.ones(8) * i} for i in range(40)},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "params": list(range(40))}],
        },
        "epoch": 3,
        "name": "run-1",
        "flag": None,
    }
    stats: list[BudgetStats] = []
    async with Stager() as stager:
        await adcp.save(
            sd,
            stager=stager,
            checkpoint_id=tmp_path,
            no_dist=True,
            host_budget_bytes=4096,
            on_budget_stats=stats.append,
        )
    out: dict[str, Any] = {
        "model": {k: torch.zeros(16) for k in sd["model"]},
        "optim": {
            "state": {f"p{i}": {"step": 0, "exp_avg": torch.zeros(8)} for i in range(40)},
            "param_groups": [{"lr": None, "betas": None, "eps": None, "params": None}],
        },
        "epoch": 0,
        "name": None,
        "flag": 1,
    }
    dcp.load(out, checkpoint_id=str(tmp_path), no_dist=True)
    for k, v in sd["model"].items():
        assert torch.equal(out["model"][k], v)
    for i in range(40):
        got = out["optim"]["state"][f"p{i}"]
        assert got["step"] == i and torch.equal(got["exp_avg"], torch.ones(8) * i)
    assert out["optim"]["param_groups"] == sd["optim"]["param_groups"]
    assert (out["epoch"], out["name"], out["flag"]) == (3, "run-1", None)
    assert stats[0].peak_bytes <= 4096


@pytest.mark.anyio
async def test_sources_inside_values_changed_after_the_fence_never_reach_the_checkpoint(
    tmp_path: Path,
) -> None:
    sd = objects_sd(seed=1)
    want = objects_sd(seed=1)
    stats: list[BudgetStats] = []
    async with Stager() as stager, anyio.create_task_group() as tg:
        coro = adcp.save(
            sd,
            stager=stager,
            checkpoint_id=tmp_path,
            no_dist=True,
            host_budget_bytes=64 * KIB,
            on_budget_stats=stats.append,
        )

        async def run() -> None:
            await coro

        tg.start_soon(run)
        await stager.fence()
        sd["extra"].cfg.table.fill_(-1.0)
        sd["extra"].scale = -1.0
        sd["pair"][0].fill_(-1.0)
        sd["w"].fill_(-1.0)
    assert_loaded(load(tmp_path, want), want)
    assert stats[0].blocked_seconds > 0  # the budget held the copies back


# -- what torch.save holds whole is refused ----------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("value", "needed"),
    [
        pytest.param(b"x" * 200_000, 200_000, id="bytes"),
        pytest.param(np.zeros(25_000), 200_000, id="numpy"),
        pytest.param("s" * 150_000, 150_000, id="str"),
        pytest.param(Cfg(torch.ones(1), "y" * 300_000), 300_000, id="in-a-dataclass"),
        pytest.param([0.5] * 100_000, 100_000, id="list-of-floats"),
    ],
)
async def test_a_value_whose_pickle_exceeds_the_budget_is_refused_at_the_call(
    tmp_path: Path, value: Any, needed: int
) -> None:
    sd: dict[str, Any] = {"w": torch.ones(100), "extra": {"blob": value}}
    async with Stager() as stager:
        with pytest.raises(BudgetTooSmallError) as err:
            _ = adcp.save(
                sd, stager=stager, checkpoint_id=tmp_path / "c", no_dist=True, host_budget_bytes=100_000
            )
        assert err.value.path == ("extra", "blob")
        assert err.value.needed_bytes >= needed  # a lower bound of the pickle: what it can see
        text = str(err.value)
        assert text.startswith("sd['extra']['blob']: ") and "host_budget_bytes=100000" in text
        assert "as a tensor" in text and f"host_budget_bytes >= {err.value.needed_bytes}" in text
        assert not (tmp_path / "c").exists()  # refused before anything was staged or written
        with anyio.fail_after(5):
            await stager.fence()  # nothing registered
        # The fix the message names: the data as a tensor, which DCP writes in pieces.
        sd["extra"]["blob"] = torch.zeros(20_000)
        await adcp.save(
            sd, stager=stager, checkpoint_id=tmp_path / "ok", no_dist=True, host_budget_bytes=100_000
        )
    assert (tmp_path / "ok" / ".metadata").exists()


@pytest.mark.anyio
@pytest.mark.usefixtures("no_thread_leak")
async def test_a_pickle_seen_only_when_serialized_is_refused_then_and_names_the_value(tmp_path: Path) -> None:
    sd = {"w": torch.ones(100), "opaque": {"c": Blob(300_000)}}
    async with Stager() as stager:
        with pytest.raises(BudgetTooSmallError) as err:
            await adcp.save(
                sd, stager=stager, checkpoint_id=tmp_path / "c", no_dist=True, host_budget_bytes=100_000
            )
        assert err.value.path == ("opaque", "c") and err.value.needed_bytes > 300_000
        assert str(err.value).startswith("sd['opaque']['c']: this non-tensor value pickles to")
        assert not (tmp_path / "c" / ".metadata").exists()  # no checkpoint became visible
        with anyio.fail_after(5):
            await stager.fence()
        del sd["opaque"]
        await adcp.save(
            sd, stager=stager, checkpoint_id=tmp_path / "ok", no_dist=True, host_budget_bytes=100_000
        )
    assert (tmp_path / "ok" / ".metadata").exists()


@pytest.mark.anyio
async def test_a_tensor_in_a_tuple_is_not_a_tensor_item_and_may_exceed_the_budget(tmp_path: Path) -> None:
    # DCP pickles a tuple whole: its tensor is streamed, so the budget only bounds the
    # tensors DCP writes as tensor items (the same tensor as one is refused).
    big = torch.arange(100_000, dtype=torch.float32)
    async with Stager() as stager:
        await adcp.save(
            {"t": (big, "x")}, stager=stager, checkpoint_id=tmp_path, no_dist=True, host_budget_bytes=64 * KIB
        )
        with pytest.raises(BudgetTooSmallError) as err:
            _ = adcp.save(
                {"t": [big]},
                stager=stager,
                checkpoint_id=tmp_path / "l",
                no_dist=True,
                host_budget_bytes=64 * KIB,
            )
        assert err.value.path == ("t", 0) and err.value.needed_bytes == 400_000
    out: dict[str, Any] = {"t": None}
    dcp.load(out, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(out["t"][0], big) and out["t"][1] == "x"


# -- cancellation in the middle of a value -------------------------------------------------------


class _Gate:
    armed = False
    reached = threading.Event()
    release = threading.Event()


def _rebuild(t: torch.Tensor) -> torch.Tensor:
    return t


class _GatedValue:
    """A value whose pickling (in the copier thread) stops at a gate while armed; it
    pickles as its tensor (``torch.save`` then streams that tensor's storage)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def __reduce__(self) -> Any:
        if _Gate.armed:
            _Gate.armed = False
            _Gate.reached.set()
            _Gate.release.wait(10)
        return (_rebuild, (self.t,))


@pytest.mark.anyio
@pytest.mark.usefixtures("no_thread_leak")
@pytest.mark.parametrize("how", ["scope", "task"])
async def test_cancelled_between_values_leaves_no_checkpoint_releases_the_fence_and_the_stager(
    tmp_path: Path, how: str, anyio_backend: Any
) -> None:
    if how == "task" and anyio_backend[0] != "asyncio":
        pytest.skip("a native Task.cancel() is asyncio's")
    table = torch.arange(4 * MIB, dtype=torch.float32)  # 16 MiB inside a dataclass
    second = torch.full((MIB,), 3.0)  # 4 MiB inside the gated value
    # Bytes items are serialized in the plan's order (the state dict's): "a" then "b",
    # then the tensor item "w".
    sd: dict[str, Any] = {"a": Cfg(table, "t"), "b": _GatedValue(second), "w": torch.ones(1000)}
    budget = 1 * MIB
    stats: list[BudgetStats] = []
    _Gate.reached.clear()
    _Gate.release.clear()
    _Gate.armed = True
    try:
        async with Stager() as stager:
            coro = adcp.save(
                sd,
                stager=stager,
                checkpoint_id=tmp_path / "c",
                no_dist=True,
                host_budget_bytes=budget,
                on_budget_stats=stats.append,
            )
            # "a" is streamed (the ring is 64 times smaller), "b" is being pickled: cancel,
            # and let its pickling go on a little later (into a stopped ring).
            if how == "scope":
                with anyio.CancelScope() as scope:
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(_await, coro)
                        while not _Gate.reached.is_set():
                            await anyio.sleep(0.001)
                        threading.Timer(0.1, _Gate.release.set).start()
                        scope.cancel()
                assert scope.cancelled_caught
            else:
                import asyncio

                task = asyncio.ensure_future(coro)
                while not _Gate.reached.is_set():
                    await anyio.sleep(0.001)
                threading.Timer(0.1, _Gate.release.set).start()
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            assert not (tmp_path / "c" / ".metadata").exists()
            (s,) = stats
            # "a" went through whole, nothing of "b" (stopped in its storage) nor of "w".
            assert 16 * MIB <= s.object_bytes < 20 * MIB and s.tensor_bytes == 0
            assert s.peak_bytes <= budget
            with anyio.fail_after(5):
                await stager.fence()  # the cancelled save's fence hook is gone
            await adcp.save(
                sd, stager=stager, checkpoint_id=tmp_path / "d", no_dist=True, host_budget_bytes=budget
            )
    finally:
        _Gate.armed = False
        _Gate.release.set()
    out: dict[str, Any] = {"a": None, "b": None, "w": torch.zeros(1000)}
    dcp.load(out, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    assert (
        torch.equal(out["a"].table, table)
        and torch.equal(out["b"], second)
        and torch.equal(out["w"], sd["w"])
    )


async def _await(coro: Any) -> None:
    await coro


@pytest.mark.cuda
@pytest.mark.anyio
async def test_cuda_tensor_inside_a_value_is_refused_over_the_budget_and_ordered_within_it(
    tmp_path: Path,
) -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    big = Holder(Cfg(torch.zeros(1 << 20, device=dev), "big"), 1.0)  # 4 MiB on the device
    async with Stager() as stager:
        # torch.save moves a device storage to host memory whole: over the budget, refused.
        with pytest.raises(BudgetTooSmallError) as err:
            _ = adcp.save(
                {"extra": big},
                stager=stager,
                checkpoint_id=tmp_path / "r",
                no_dist=True,
                host_budget_bytes=MIB,
            )
        assert str(err.value).startswith("sd['extra'].cfg.table: this cuda tensor")
        assert err.value.needed_bytes == 4 * MIB and not (tmp_path / "r").exists()
    small = Cfg(torch.zeros(64 * KIB, device=dev), "s")  # 256 KiB: within the budget
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # queued before the call: in the snapshot
        small.table.fill_(7.0)
        async with Stager() as stager, anyio.create_task_group() as tg:
            coro = adcp.save(
                {"extra": small, "w": torch.ones(10, device=dev)},
                stager=stager,
                checkpoint_id=tmp_path / "c",
                no_dist=True,
                host_budget_bytes=MIB,
            )
            tg.start_soon(_await, coro)
            await stager.fence()
            small.table.fill_(-1.0)  # after the fence: never in the checkpoint
    out: dict[str, Any] = {"extra": None, "w": torch.zeros(10, device=dev)}
    dcp.load(out, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    assert out["extra"].table.device.type == "cuda"
    assert torch.equal(out["extra"].table.cpu(), torch.full((64 * KIB,), 7.0))


# -- the Checkpointer ------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_checkpointer_budget_saves_values_with_tensors_and_restores_them_verified(
    tmp_path: Path,
) -> None:
    sd = objects_sd(seed=2)
    async with Checkpointer(tmp_path, host_budget_bytes=64 * KIB) as ckpt:
        assert await ckpt.save(sd, step=1)
        sd["extra"].cfg.table.add_(1.0)  # after save returned: not in the checkpoint
        await ckpt.wait()
        stats = ckpt.last
        assert stats is not None and stats.budget is not None
        assert stats.budget.peak_bytes <= 64 * KIB and stats.budget.object_bytes > 400_000
    want = objects_sd(seed=2)
    out = like(want)
    async with Checkpointer(tmp_path) as ckpt:
        assert await ckpt.restore(out, fallback=False) == 1
    assert_loaded(out, want)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        assert_loaded(load(tmp_path / "step-00000001", want), want)


# -- peak RSS in a fresh process -----------------------------------------------------------------------

#: What a budgeted save holds besides its ring (docs/concepts.md; the same constant as
#: tests/dcp/test_dcp_budget_procs.py): DCP's plan and metadata, the zip writer's buffers,
#: a bytes item's gathered small writes, thread stacks.
OVERHEAD_BYTES = 8 * MIB

_CHILD = r"""
import dataclasses, json, os, re, sys, threading, time, warnings
import anyio, torch
import async_stager.dcp as adcp
from async_stager import Checkpointer, Stager
warnings.filterwarnings("ignore")
mode, out, budget = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.set_num_threads(1)

@dataclasses.dataclass
class Cfg:
    table: torch.Tensor

def state(n):
    return {"w": torch.ones(n), "extra": {"cfg": Cfg(torch.full((n * 64,), 2.0))}, "step": 3}

async def save(path, sd):
    if mode == "dcp":
        async with Stager(pin_memory=False) as stager:
            await adcp.save(sd, stager=stager, checkpoint_id=path, no_dist=True, host_budget_bytes=budget)
    else:
        async with Checkpointer(path, host_budget_bytes=budget, checksums=False) as ckpt:
            await ckpt.save(sd, step=1)
            await ckpt.wait()

sd = state(1 << 18)  # 1 MiB tensor item, 64 MiB inside the dataclass
anyio.run(lambda: save(out + "-warm", state(64)))  # imports, DCP's lazy modules, pools
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
def hwm():
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1024
try:  # the peak since now, exactly (Linux: reset VmHWM to the current RSS)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    exact = True
except OSError:
    exact = False
peak = [0]
stop = threading.Event()
def sample():
    while not stop.is_set():
        peak[0] = max(peak[0], rss())
        time.sleep(0.0005)
base = rss()
t = threading.Thread(target=sample, daemon=True); t.start()
anyio.run(lambda: save(out, sd))
stop.set(); t.join()
print(json.dumps({"growth": (hwm() if exact else peak[0]) - base, "exact": exact}))
"""


@pytest.mark.timeout(600)  # a hang guard, not a speed check (see CONTRIBUTING.md, "Tests")
@pytest.mark.parametrize("mode", ["dcp", "checkpointer"])
def test_peak_rss_growth_with_a_64mib_tensor_inside_a_dataclass_stays_within_a_1mib_budget(
    tmp_path: Path, mode: str
) -> None:
    budget = 1 * MIB
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    res = subprocess.run(
        [sys.executable, "-c", _CHILD, mode, str(tmp_path / "c"), str(budget)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    growth: int = got["growth"]
    print(f"{mode}: peak RSS growth {growth / MIB:.1f} MiB (exact peak: {got['exact']})")
    # The value inside the dataclass is 64 MiB: pickled whole it would be all of it.
    assert growth <= budget + OVERHEAD_BYTES, f"grew RSS by {growth / MIB:.1f} MiB"
