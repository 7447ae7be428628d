"""What DefaultStager.stage() and async_stager.dcp.save take (issue 41, section 4):
plain values and module or optimizer objects inside a state dict are refused with
InvalidStateDictError, as Stager.stage() refuses them; dcp.save takes a dict, whose
top-level module or optimizer is saved as its state_dict() (DCP's Stateful rule)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import torch.distributed.checkpoint as torch_dcp

from async_stager import CheckpointStagerConfig, DefaultStager, Stager, dcp
from async_stager.errors import InvalidStateDictError

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("use_async", [False, True])
def test_default_stager_refuses_plain_values_and_modules(use_async: bool) -> None:
    model = torch.nn.Linear(2, 2)
    config = CheckpointStagerConfig(use_async_staging=use_async)
    with DefaultStager(config) as stager:
        bad: list[Any] = [42, "hello", None, model, torch.optim.SGD(model.parameters(), lr=0.1)]
        for value in bad:
            with pytest.raises(InvalidStateDictError):
                stager.stage(value)  # at the call, whatever the config
        with pytest.raises(InvalidStateDictError) as ei:
            got = stager.stage({"m": model})  # sync: raised here; async: by the Future
            assert not isinstance(got, dict)
            got.result(timeout=30)
        assert ei.value.path == ("m",) and "state_dict()" in str(ei.value)
        out: Any = stager.stage({"m": model.state_dict()})
        staged = out if isinstance(out, dict) else out.result()
        assert torch.equal(staged["m"]["bias"], model.bias)


@pytest.mark.parametrize("budget", [None, 1 << 20])
def test_dcp_save_takes_a_dict_and_saves_a_top_level_module_as_its_state_dict(
    tmp_path: Path, budget: int | None
) -> None:
    model = torch.nn.Linear(4, 3)

    async def main() -> None:
        async with Stager() as stager:
            bad: list[Any] = [42, None, model, torch.ones(2)]
            for value in bad:
                with pytest.raises(InvalidStateDictError):
                    dcp.save(  # type: ignore[unused-coroutine]  # raised at the call
                        value,
                        stager=stager,
                        checkpoint_id=tmp_path / "bad",
                        host_budget_bytes=budget,
                        no_dist=True,
                    )
            with pytest.raises(InvalidStateDictError) as ei:
                await dcp.save(
                    {"ms": [model]},
                    stager=stager,
                    checkpoint_id=tmp_path / "bad",
                    host_budget_bytes=budget,
                    no_dist=True,
                )
            assert ei.value.path == ("ms", 0)
            await dcp.save(
                {"model": model, "step": 7},
                stager=stager,
                checkpoint_id=tmp_path / "ok",
                host_budget_bytes=budget,
                no_dist=True,
            )

    anyio.run(main)
    fresh = torch.nn.Linear(4, 3)
    target: dict[str, Any] = {"model": fresh.state_dict(), "step": 0}
    with warnings.catch_warnings():
        # dcp.load(no_dist=True) warns that it assumes a single process: we asked for that.
        warnings.simplefilter("ignore", UserWarning)
        torch_dcp.load(target, checkpoint_id=tmp_path / "ok", no_dist=True)
    assert torch.equal(target["model"]["weight"], model.weight.detach())
    assert target["step"] == 7
