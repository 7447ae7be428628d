"""``async_stager.dcp.save(..., host_budget_bytes=N)``: the pipelined save within a
host-memory budget. Loaded back bit-exact with plain ``torch.distributed.checkpoint``;
the ring's accounting stays within the budget; sources changed right after the fence
never reach the checkpoint; cancellation mid-stream leaves no visible checkpoint; a
budget below the largest tensor is refused at the call."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import bits
from torch.distributed.checkpoint.api import CheckpointException

import async_stager.dcp as adcp
from async_stager import BudgetTooSmallError, Stager, UnsupportedError
from async_stager.dcp import BudgetStats

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.timeout(60),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.usefixtures("no_thread_leak"),
]

KIB = 1024


def make_sd(n: int = 24, numel: int = 16 * KIB, seed: int = 0) -> dict[str, Any]:
    """``n`` float32 tensors of ``numel`` elements (64 KiB each by default), a few odd
    layouts and non-tensor values."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(4 * KIB, generator=g)
    return {
        "layers": {f"w{i}": torch.randn(numel, generator=g) for i in range(n)},
        "odd": {
            "bf16": torch.randn(300, generator=g).to(torch.bfloat16),
            "view": base[100:1100],  # storage larger than the tensor
            "t": torch.randn(40, 30, generator=g).t(),  # not contiguous
            "empty": torch.empty(0, 3),
            "i64": torch.arange(11),
        },
        "step": 7,
        "note": {"lr": 0.5, "names": ["a", "b"]},
    }


def zeros_like_sd(sd: dict[str, Any]) -> dict[str, Any]:
    def z(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return torch.zeros(v.shape, dtype=v.dtype)
        if isinstance(v, dict):
            return {k: z(x) for k, x in v.items()}
        return None

    out = z(sd)
    out["step"] = 0
    out["note"] = {"lr": 0.0, "names": None}
    return out


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    for group in ("layers", "odd"):
        for k, v in want[group].items():
            assert torch.equal(bits(got[group][k]), bits(v)), f"{group}.{k} differs"
    assert got["step"] == want["step"] and got["note"] == want["note"]


def load(path: Path, like: dict[str, Any]) -> dict[str, Any]:
    out = zeros_like_sd(like)
    dcp.load(out, checkpoint_id=str(path), no_dist=True)
    return out


def clone_sd(sd: dict[str, Any]) -> dict[str, Any]:
    def c(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.clone()
        if isinstance(v, dict):
            return {k: c(x) for k, x in v.items()}
        if isinstance(v, list):
            return list(v)
        return v

    out: dict[str, Any] = c(sd)
    return out


@pytest.mark.parametrize("budget_kib", [64, 200, 100_000])
async def test_budgeted_save_loads_bit_exact_and_holds_the_budget(tmp_path: Path, budget_kib: int) -> None:
    sd = make_sd()
    stats: list[BudgetStats] = []
    async with Stager() as stager:
        md = await adcp.save(
            sd,
            stager=stager,
            checkpoint_id=tmp_path,
            no_dist=True,
            host_budget_bytes=budget_kib * KIB,
            on_budget_stats=stats.append,
        )
        assert stager.stats is None  # the stager's buffer sets were not used
    assert md is not None and (tmp_path / ".metadata").exists()
    assert_same(load(tmp_path, sd), sd)
    (s,) = stats
    tensor_bytes = sum(t.numel() * t.element_size() for g in ("layers", "odd") for t in sd[g].values())
    assert s.tensor_bytes == tensor_bytes and s.pieces == len(sd["layers"]) + len(sd["odd"])
    assert s.peak_bytes <= s.arena_bytes <= s.budget_bytes == budget_kib * KIB
    assert s.object_bytes > 0 and s.blocked_seconds >= 0 and s.fence_seconds <= s.total_seconds
    if budget_kib == 64:  # one 64 KiB piece at a time: the copier must have waited
        assert s.peak_bytes == 64 * KIB and s.blocked_seconds > 0


async def test_sources_changed_after_the_fence_never_reach_the_checkpoint(tmp_path: Path) -> None:
    sd = make_sd(n=32)
    want = clone_sd(sd)
    stats: list[BudgetStats] = []
    async with Stager() as stager, anyio.create_task_group() as tg:
        # Three pieces of budget for 37 items: the fence waits on the writer.
        coro = adcp.save(
            sd,
            stager=stager,
            checkpoint_id=tmp_path,
            no_dist=True,
            host_budget_bytes=3 * 64 * KIB,
            on_budget_stats=stats.append,
        )

        async def run() -> None:
            await coro

        tg.start_soon(run)
        await stager.fence()
        for group in ("layers", "odd"):
            for t in sd[group].values():
                t.fill_(-1) if t.numel() else None
        sd["step"] = -1
        sd["note"]["lr"] = -1.0
    assert_same(load(tmp_path, want), want)
    assert stats[0].peak_bytes <= 3 * 64 * KIB  # within the budget, however the copier and writer raced


async def test_too_small_budget_is_refused_at_the_call_naming_the_tensor(tmp_path: Path) -> None:
    sd = make_sd(n=2)
    sd["layers"]["big"] = torch.zeros(1000, 100)  # 400 000 bytes
    async with Stager() as stager:
        with pytest.raises(BudgetTooSmallError) as err:
            _ = adcp.save(
                sd, stager=stager, checkpoint_id=tmp_path / "c", no_dist=True, host_budget_bytes=300_000
            )
        assert err.value.path == ("layers", "big") and err.value.needed_bytes == 400_000
        assert "['layers']['big']" in str(err.value) and "host_budget_bytes >= 400000" in str(err.value)
        assert not (tmp_path / "c").exists()  # nothing staged, nothing written
        await stager.fence()  # nothing registered: returns at once
        other: Any = dcp.DefaultSavePlanner()
        with pytest.raises(UnsupportedError):
            _ = adcp.save(sd, stager=stager, checkpoint_id=tmp_path, host_budget_bytes=10**6, planner=other)
        # Exactly the largest tensor's size is enough.
        await adcp.save(
            sd, stager=stager, checkpoint_id=tmp_path / "ok", no_dist=True, host_budget_bytes=400_000
        )
    assert (tmp_path / "ok" / ".metadata").exists()


class _Gate:
    armed = False
    reached = threading.Event()
    release = threading.Event()


class _Gated(torch.Tensor):
    """A tensor whose first copy out of it (by the pipeline's copier) stops at a gate."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.Tensor.copy_, torch._foreach_copy_) and _Gate.armed:
            _Gate.armed = False
            _Gate.reached.set()
            _Gate.release.wait(10)
        return super().__torch_function__(func, types, args, kwargs or {})


async def test_cancelled_mid_stream_leaves_no_checkpoint_and_frees_the_budget(tmp_path: Path) -> None:
    sd = make_sd(n=16)
    sd["layers"]["w8"] = sd["layers"]["w8"].as_subclass(_Gated)
    _Gate.reached.clear()
    _Gate.release.clear()
    _Gate.armed = True
    stats: list[BudgetStats] = []
    budget = 2 * 64 * KIB
    async with Stager() as stager:
        with anyio.CancelScope() as scope:
            coro = adcp.save(
                sd,
                stager=stager,
                checkpoint_id=tmp_path / "c",
                no_dist=True,
                host_budget_bytes=budget,
                on_budget_stats=stats.append,
            )
            async with anyio.create_task_group() as tg:
                tg.start_soon(_await, coro)
                while not _Gate.reached.is_set():
                    await anyio.sleep(0.001)
                # Items 0..7 are copied (most written), 8 is mid-copy: cancel now, and
                # let the copy finish a little later (after the abort is in).
                threading.Timer(0.1, _Gate.release.set).start()
                scope.cancel()
        assert scope.cancelled_caught
        assert not (tmp_path / "c" / ".metadata").exists()
        # Data was written (mid-stream), but DCP sees no checkpoint there.
        assert any(p.suffix == ".distcp" for p in (tmp_path / "c").iterdir())
        with pytest.raises(CheckpointException, match="metadata"):
            load(tmp_path / "c", sd)
        (s,) = stats
        assert 0 < s.tensor_bytes < 16 * 64 * KIB
        await stager.fence()  # the cancelled save no longer holds the fence
        # The budget's memory is reusable: a second save with the same budget completes.
        sd["layers"]["w8"] = sd["layers"]["w8"].as_subclass(torch.Tensor)
        await adcp.save(
            sd, stager=stager, checkpoint_id=tmp_path / "d", no_dist=True, host_budget_bytes=budget
        )
    assert_same(load(tmp_path / "d", sd), sd)


async def _await(coro: Any) -> None:
    await coro


async def test_unawaited_budgeted_save_releases_the_fence(tmp_path: Path) -> None:
    import gc

    async with Stager() as stager:
        coro = adcp.save(
            make_sd(n=2), stager=stager, checkpoint_id=tmp_path, no_dist=True, host_budget_bytes=10**6
        )
        coro.close()
        del coro
        gc.collect()
        with anyio.fail_after(5):
            await stager.fence()
    assert not (tmp_path / ".metadata").exists()


@pytest.mark.cuda
async def test_cuda_budgeted_save_orders_after_the_callers_stream(tmp_path: Path) -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    sd = {f"w{i}": torch.zeros(256 * KIB, device=dev) for i in range(12)}
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        # Queued before the call on the caller's (side) stream: must be in the snapshot.
        torch.cuda._sleep(50_000_000)
        for i, t in enumerate(sd.values()):
            t.fill_(float(i))
        async with Stager() as stager, anyio.create_task_group() as tg:
            coro = adcp.save(
                sd, stager=stager, checkpoint_id=tmp_path, no_dist=True, host_budget_bytes=3 * 1024 * KIB
            )
            tg.start_soon(_await, coro)
            await stager.fence()
            for t in sd.values():
                t.fill_(-1.0)  # ordered after the copies by the fence
    out = {k: torch.zeros(256 * KIB) for k in sd}
    dcp.load(out, checkpoint_id=str(tmp_path), no_dist=True)
    for i, k in enumerate(sd):
        assert torch.equal(out[k], torch.full((256 * KIB,), float(i))), k


# The graph-capture refusal before any copier or event is made: tests/dcp/test_budget_seam.py
# (test_the_real_backends_capture_check_comes_before_any_copier), through the copiers' queries.
