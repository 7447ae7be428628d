"""Asyncio-only cases under pytest-asyncio in strict mode, as many users run them."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from async_stager import Stager

pytest_asyncio = pytest.importorskip("pytest_asyncio")

pytestmark = pytest.mark.timeout(60)


@pytest_asyncio.fixture
async def stager() -> Stager:  # type: ignore[misc]
    async with Stager() as s:
        yield s


@pytest.mark.asyncio
async def test_stage_under_pytest_asyncio(stager: Stager) -> None:
    sd: dict[str, Any] = {"w": torch.randn(8), "step": 1}
    staged = await stager.stage(sd)
    assert torch.equal(staged["w"], sd["w"]) and staged["step"] == 1


@pytest.mark.asyncio
async def test_stage_as_a_task_and_wrap_future_style(stager: Stager) -> None:
    sd = {f"w{i}": torch.randn(4) for i in range(100)}
    task = asyncio.create_task(stager.stage(sd))
    await asyncio.sleep(0)
    staged = await asyncio.wait_for(task, timeout=30)
    assert all(torch.equal(staged[k], sd[k]) for k in sd)


@pytest.mark.asyncio
async def test_cancelled_task_then_correct(stager: Stager) -> None:
    sd = {f"w{i}": torch.randn(4) for i in range(5000)}
    task = asyncio.create_task(stager.stage(sd))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    staged = await stager.stage(sd)
    assert all(torch.equal(staged[k], sd[k]) for k in sd)
