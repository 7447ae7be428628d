"""``dcp.save(..., node_budget_bytes=N)``: the budgeted pipeline's ring is reserved from
the node ledger before it is allocated (a share of what the node has free when other
holders have some), given back when the save ends (also when it fails or is
cancelled), and a tensor bigger than the whole node budget is refused at the call.
Two saves with ledger handles of their own (as two ranks would) share one budget and
both complete within it."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from helpers import assert_equal

import async_stager.dcp as adcp
from async_stager import BudgetTooSmallError, InvalidOptionError, Stager
from async_stager._core.memory.ledger import NodeLedger

pytestmark = pytest.mark.timeout(60)

MiB = 2**20


def state(n: int = 6, seed: int = 1) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"w{i}": torch.randn(MiB // 4, generator=g) for i in range(n)}, "step": 3}


def zeros_like(sd: Any) -> Any:
    if isinstance(sd, dict):
        return {k: zeros_like(v) for k, v in sd.items()}
    return torch.zeros_like(sd) if isinstance(sd, torch.Tensor) else sd


def load(path: Path, like: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    out = zeros_like(like)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP: "assuming ... a single process"
        dcp.load(out, checkpoint_id=str(path), no_dist=True)
    return out


@pytest.mark.anyio
async def test_dcp_save_with_a_node_budget_reserves_its_ring(tmp_path: Path) -> None:
    ledger_dir = str(tmp_path / "ledger")
    sd = state(6)
    budget = 2 * MiB + 4096
    seen: list[adcp.BudgetStats] = []
    async with Stager(pin_memory=False) as stager:
        # Another holder of the node budget: the save gets a share of what is left.
        with NodeLedger.open(budget, path=ledger_dir) as other:
            held = other.try_reserve(MiB // 2, "another rank")
            assert held is not None
            await adcp.save(
                sd,
                stager=stager,
                checkpoint_id=str(tmp_path / "ck"),
                no_dist=True,
                node_budget_bytes=budget,
                node_budget_path=ledger_dir,
                on_budget_stats=seen.append,
            )
            usage = other.usage()
            assert usage.reserved == MiB // 2 and usage.peak <= budget
            held.release()
    (stats,) = seen
    assert stats.arena_bytes <= budget - MiB // 2 and stats.peak_bytes <= stats.arena_bytes
    assert_equal(load(tmp_path / "ck", sd), sd)


@pytest.mark.anyio
async def test_dcp_save_refuses_a_tensor_bigger_than_the_node_budget(tmp_path: Path) -> None:
    ledger_dir = str(tmp_path / "ledger")
    async with Stager(pin_memory=False) as stager:
        with pytest.raises(BudgetTooSmallError, match="node budget") as info:
            await adcp.save(
                {"w": torch.zeros(MiB)},
                stager=stager,
                checkpoint_id=str(tmp_path / "ck"),
                no_dist=True,
                node_budget_bytes=MiB,
                node_budget_path=ledger_dir,
            )
        assert tuple(info.value.path or ()) == ("w",)
    assert not os.path.exists(ledger_dir)  # the call's own ledger was closed


@pytest.mark.anyio
async def test_two_savers_share_one_node_budget(tmp_path: Path) -> None:
    ledger_dir = str(tmp_path / "ledger")
    budget = 3 * MiB + 8192  # less than the two rings would take (6 MiB each)
    states = [state(6, seed) for seed in (1, 2)]
    seen: list[adcp.BudgetStats] = []
    peaks: list[int] = []

    async def one(i: int) -> None:
        # A ledger handle of its own: a slot of its own, as another rank's would be.
        with NodeLedger.open(budget, path=ledger_dir) as ledger:
            async with Stager(pin_memory=False) as stager:
                await adcp.save(
                    states[i],
                    stager=stager,
                    checkpoint_id=str(tmp_path / f"ck{i}"),
                    no_dist=True,
                    node_ledger=ledger,
                    on_budget_stats=seen.append,
                )
            peaks.append(ledger.usage().peak)

    async with anyio.create_task_group() as tg:
        for i in (0, 1):
            tg.start_soon(one, i)
    assert len(seen) == 2 and all(s.arena_bytes <= budget for s in seen)
    assert max(peaks) <= budget
    for i in (0, 1):
        assert_equal(load(tmp_path / f"ck{i}", states[i]), states[i])


@pytest.mark.anyio
async def test_a_cancelled_save_gives_its_share_back(tmp_path: Path) -> None:
    ledger_dir = str(tmp_path / "ledger")
    budget = 2 * MiB + 4096
    sd = state(12)
    async with Stager(pin_memory=False) as stager:
        with NodeLedger.open(budget, path=ledger_dir) as ledger:
            with anyio.move_on_after(0.05):
                await adcp.save(
                    sd, stager=stager, checkpoint_id=str(tmp_path / "ck"), no_dist=True, node_ledger=ledger
                )
            assert ledger.held == 0 and ledger.usage().reserved == 0


def test_node_budget_options_are_checked(tmp_path: Path) -> None:
    async def main() -> None:
        async with Stager(pin_memory=False) as stager:
            with pytest.raises(InvalidOptionError, match="need node_budget_bytes"):
                await adcp.save({}, stager=stager, checkpoint_id=str(tmp_path), node_budget_job="x")
            with (
                NodeLedger.open(MiB, path=str(tmp_path / "ledger")) as ledger,
                pytest.raises(InvalidOptionError, match="differs"),
            ):
                await adcp.save(
                    {},
                    stager=stager,
                    checkpoint_id=str(tmp_path),
                    node_ledger=ledger,
                    node_budget_bytes=2 * MiB,
                )

    anyio.run(main)
