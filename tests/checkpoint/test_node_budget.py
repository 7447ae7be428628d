"""The Checkpointer at a node budget, in one process (where the node
budget is a per-process budget): a save whose staged copy fits stages (then reuses
its cached buffer set), one that does not streams within the budget, a tensor bigger
than the whole budget is refused at ``save()`` naming it, SaveStats says which path
each save took, the ledger is given back at close, and every checkpoint restores
bit-exact. The multi-process versions are in test_node_budget_procs.py; ``dcp.save``'s
are in tests/dcp/test_node_budget.py."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_equal

from async_stager import BudgetTooSmallError, Checkpointer, InvalidOptionError, Stager
from async_stager._core.memory.ledger import NodeLedger

pytestmark = pytest.mark.timeout(60)

MiB = 2**20


def state(n: int = 4, seed: int = 1) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {f"w{i}": torch.randn(MiB // 4, generator=g) for i in range(n)},  # 1 MiB each
        "step": 3,
    }


def zeros_like(sd: Any) -> Any:
    if isinstance(sd, dict):
        return {k: zeros_like(v) for k, v in sd.items()}
    return torch.zeros_like(sd) if isinstance(sd, torch.Tensor) else sd


@pytest.mark.anyio
async def test_a_state_that_fits_stages_then_reuses_its_cached_set(tmp_path: Path) -> None:
    ledger_dir = str(tmp_path / "ledger")
    sd = state()
    budget = 16 * MiB
    async with Checkpointer(tmp_path / "ck", node_budget_bytes=budget, node_budget_path=ledger_dir) as ckpt:
        paths = []
        for step in (1, 2, 3):
            for t in sd["model"].values():
                t.add_(1)
            await ckpt.save(sd, step=step)
            await ckpt.wait()
            assert ckpt.last is not None
            paths.append(ckpt.last.admission)
            assert not ckpt.last.streamed
            with NodeLedger.open(budget, path=ledger_dir) as probe:
                usage = probe.usage()
            assert 0 < usage.reserved <= budget and usage.peak <= budget
        # The first save maps a set; later ones find a cached one free (or map the
        # second set while the first is still written), never more than the budget.
        assert paths[0] == "staged" and "cached" in paths
        expected = {k: v.clone() for k, v in sd["model"].items()}
    assert not os.path.exists(ledger_dir)  # the last one out removed it
    out = zeros_like(sd)
    async with Checkpointer(tmp_path / "ck") as ckpt:
        assert await ckpt.restore(out) == 3
    assert_equal(out["model"], expected)


@pytest.mark.anyio
async def test_a_state_bigger_than_the_budget_streams_within_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ledger_dir = str(tmp_path / "ledger")
    sd = state(6)
    budget = 2 * MiB + 4096
    caplog.set_level(logging.INFO, logger="async_stager.checkpoint")
    async with Checkpointer(tmp_path / "ck", node_budget_bytes=budget, node_budget_path=ledger_dir) as ckpt:
        await ckpt.save(sd, step=1)
        await ckpt.wait()
        stats = ckpt.last
        assert stats is not None and stats.admission == "streamed" and stats.streamed
        assert stats.budget is not None and stats.budget.peak_bytes <= stats.budget.arena_bytes <= budget
        assert stats.node_wait_seconds >= 0.0
        with NodeLedger.open(budget, path=ledger_dir) as probe:
            usage = probe.usage()
        assert usage.peak <= budget and usage.reserved == 0  # the ring's share went back
    assert any("streamed" in r.getMessage() for r in caplog.records)
    out = zeros_like(sd)
    async with Checkpointer(tmp_path / "ck") as ckpt:
        assert await ckpt.restore(out) == 1
    assert_equal(out, sd)


@pytest.mark.anyio
async def test_a_tensor_bigger_than_the_node_budget_is_refused_at_save(tmp_path: Path) -> None:
    sd = {"model": {"small": torch.zeros(16), "big": torch.zeros(MiB)}}  # 4 MiB
    async with Checkpointer(
        tmp_path / "ck", node_budget_bytes=MiB, node_budget_path=str(tmp_path / "ledger")
    ) as ckpt:
        with pytest.raises(BudgetTooSmallError, match="node_budget_bytes") as info:
            await ckpt.save(sd, step=1)
        assert tuple(info.value.path or ()) == ("model", "big")
        assert info.value.needed_bytes >= 4 * MiB
        assert ckpt.steps() == []
        # Usable afterwards: a smaller state fits.
        assert await ckpt.save({"w": torch.ones(1000)}, step=2)
        await ckpt.wait()
        assert ckpt.steps() == [2]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"node_budget_bytes": 10}, "node_budget_bytes"),
        ({"node_budget_bytes": MiB, "format": "torch"}, "format='dcp'"),
        ({"node_budget_bytes": MiB, "policy": "coalesce"}, "coalesce"),
        ({"node_budget_path": "/tmp/x"}, "need node_budget_bytes"),
    ],
)
def test_node_budget_options_are_checked(tmp_path: Path, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidOptionError, match=match):
        Checkpointer(tmp_path, **kwargs)


@pytest.mark.anyio
async def test_a_given_stager_and_a_node_budget_are_refused(tmp_path: Path) -> None:
    async with Stager() as stager:
        with pytest.raises(InvalidOptionError, match="Stager"):
            Checkpointer(tmp_path, node_budget_bytes=MiB, stager=stager)
