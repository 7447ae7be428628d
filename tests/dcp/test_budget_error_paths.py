"""Every BudgetTooSmallError of a budgeted save names the tensor's path in the state
dict and the option to raise. ``dcp.save`` refuses at the call what it can see (a
top-level Stateful's ``state_dict()`` included); behind it, two checks stay for what
the call cannot see (a write item DCP makes from an object the survey does not size):
the pipeline's own when it starts (``records.too_small``) and the node budget's share
(``share.reserve_share``). Failed before: those two raised with ``path`` None,
naming DCP's flattened name only (the share: "the largest write item")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import async_stager.dcp as adcp
from async_stager import BudgetTooSmallError, Stager

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.timeout(60),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]


class _Model:
    """A Stateful (DCP calls its ``state_dict()`` when it plans, after the call)."""

    def __init__(self) -> None:
        self.layers = {"big": torch.zeros(1000, 100), "small": torch.ones(8)}

    def state_dict(self) -> dict[str, Any]:
        return {"layers": dict(self.layers)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.layers = dict(sd["layers"])


async def test_a_statefuls_tensor_is_refused_at_the_call_by_its_path(
    anyio_backend: Any, tmp_path: Path
) -> None:
    sd = {"model": _Model(), "step": 3}
    async with Stager() as stager:
        with pytest.raises(BudgetTooSmallError) as err:
            await adcp.save(
                sd, stager=stager, checkpoint_id=tmp_path / "c", no_dist=True, host_budget_bytes=300_000
            )
        assert err.value.path == ("model", "layers", "big"), err.value.path
        assert err.value.needed_bytes == 400_000
        msg = str(err.value)
        assert "['model']['layers']['big']" in msg and "host_budget_bytes >= 400000" in msg, msg
        assert not (tmp_path / "c" / ".metadata").exists()
        # The stager stays usable; a budget that fits saves it.
        await adcp.save(
            sd, stager=stager, checkpoint_id=tmp_path / "c", no_dist=True, host_budget_bytes=400_000
        )
    assert (tmp_path / "c" / ".metadata").exists()


def test_the_pipelines_own_check_names_the_path_and_the_option() -> None:
    """``too_small`` names the biggest item's path (the planner's mapping of DCP's
    flattened name) and ``host_budget_bytes``."""
    from torch.distributed.checkpoint.planner_helpers import _create_write_items

    from async_stager._dcp.budget.records import too_small

    items = _create_write_items("model.layers.big", torch.zeros(1000, 100))
    items += _create_write_items("model.layers.small", torch.ones(8))
    paths = {"model.layers.big": ("model", "layers", "big")}
    err = too_small(items, 300_000, lambda fqn: paths.get(fqn, (fqn,)))
    assert isinstance(err, BudgetTooSmallError)
    assert err.path == ("model", "layers", "big") and err.needed_bytes == 400_000
    msg = str(err)
    assert "['model']['layers']['big']" in msg and "host_budget_bytes >= 400000" in msg, msg


def test_the_planner_maps_dcp_names_to_state_dict_paths() -> None:
    """What the pipeline names a write item by: the planner's path of its flattened
    name (keys with dots and list indices kept apart), once the planner was set up."""
    from async_stager._dcp.budget.streaming import PipelinePlanner

    class _Side:
        source: Any = None
        lookup: Any = None
        path_of: Any = None

    side = _Side()
    planner = PipelinePlanner(side)  # type: ignore[arg-type]
    planner.set_up_planner({"m.x": {"w": torch.ones(2)}, "opt": [torch.ones(1), {"s": torch.ones(1)}]})
    assert side.path_of == planner._path_of
    assert side.path_of("m.x.w") == ("m.x", "w")
    assert side.path_of("opt.1.s") == ("opt", 1, "s")
    assert side.path_of("gone") == ("gone",)


def test_the_node_share_names_the_path_and_the_option(tmp_path: Path) -> None:
    """The node budget's share (reserved when the ring is made) refuses a piece bigger
    than the whole node budget naming the tensor's path and ``node_budget_bytes``."""
    from async_stager._core.memory.ledger import NodeLedger
    from async_stager._dcp.budget.share import reserve_share

    ledger = NodeLedger.open(1 << 20, path=tmp_path / "ledger")
    try:
        with pytest.raises(BudgetTooSmallError) as err:
            reserve_share(ledger, 2 << 20, 2 << 20, timeout=1.0, path=("model", "big"))
        assert err.value.path == ("model", "big") and err.value.needed_bytes == 2 << 20
        msg = str(err.value)
        assert "['model']['big']" in msg and f"node_budget_bytes >= {2 << 20}" in msg, msg
        assert ledger.usage().free == 1 << 20  # nothing reserved
    finally:
        ledger.close()
