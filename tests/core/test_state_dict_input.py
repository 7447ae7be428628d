"""What stage() takes (issue 41, section 4): a state dict, or anything that may hold a
tensor (a list, tuple, dataclass, a tensor itself). A plain value with nothing to stage
(None, a number, a string) and a module or optimizer (whose ``state_dict()`` is the
state) are refused with InvalidStateDictError, a TypeError, naming where; the stager
stays usable."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from async_stager import Stager, StagingError
from async_stager._core.aio.stager import stager_internals
from async_stager.errors import Attr, InvalidStateDictError

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

PLAIN = [42, "hello", None, 3.5, b"raw", True]


@dataclasses.dataclass
class Holder:
    note: str
    inner: Any


async def test_plain_values_are_refused_at_the_call(anyio_backend: Any) -> None:
    async with Stager() as stager:
        for value in PLAIN:
            for call in (stager.stage, stager.lease, stager_internals(stager).snapshot_point):
                with pytest.raises(InvalidStateDictError) as ei:
                    call(value)  # raised here, before any coroutine exists
                assert isinstance(ei.value, TypeError) and isinstance(ei.value, StagingError)
                assert ei.value.path == ()
                assert type(value).__name__ in str(ei.value) and "nothing to stage" in str(ei.value)
            with pytest.raises(InvalidStateDictError):
                async with stager.snapshot(value):
                    pass
            with pytest.raises(InvalidStateDictError):
                await stager.reserve(value)
        staged: Any = await stager.stage({"step": 3, "w": torch.ones(2)})
        assert staged["step"] == 3 and torch.equal(staged["w"], torch.ones(2))


async def test_modules_and_optimizers_name_state_dict(anyio_backend: Any) -> None:
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.AdamW(model.parameters())
    async with Stager() as stager:
        objs: list[Any] = [model, optim]
        for obj in objs:
            with pytest.raises(InvalidStateDictError) as ei:
                stager.stage(obj)  # type: ignore[unused-coroutine]  # raised at the call
            assert "state_dict()" in str(ei.value) and ei.value.path == ()
        sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1)
        cases: list[tuple[Any, tuple[Any, ...]]] = [
            ({"model": model}, ("model",)),
            ({"opt": [1, optim]}, ("opt", 1)),
            ({"h": Holder("x", model)}, ("h", Attr("inner"))),
            ({"sched": sched}, ("sched", Attr("optimizer"))),
        ]
        for sd, path in cases:
            with pytest.raises(InvalidStateDictError) as ei:
                await stager.stage(sd)
            assert ei.value.path == path, (sd, ei.value.path)
            assert "state_dict()" in str(ei.value)
        # The state dicts themselves stage, and so do a tensor, a list, a dataclass.
        staged = await stager.stage({"model": model.state_dict(), "optim": optim.state_dict()})
        assert torch.equal(staged["model"]["weight"], model.weight)
        del staged
        t = await stager.stage(torch.arange(4.0))
        assert torch.equal(t, torch.arange(4.0))
        del t
        lst = await stager.stage([torch.ones(1), 2])
        assert lst[1] == 2
        del lst
        h = await stager.stage(Holder("y", torch.zeros(2)))
        assert h.note == "y" and torch.equal(h.inner, torch.zeros(2))
