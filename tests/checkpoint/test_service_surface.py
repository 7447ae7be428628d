"""What a service sees of a Checkpointer (issue 37, section 3): SaveProgress as plain
data, the status line, a request's "taken, at step N", SaveStats as plain data, and
state_differences, through the public API."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from torch import nn

from async_stager import Checkpointer, SaveProgress, SaveRequest, state_differences

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


async def test_request_taken_reports_the_step_then_the_commit(tmp_path: Path) -> None:
    state = {"w": torch.arange(8.0)}
    async with Checkpointer(tmp_path) as ckpt:
        request = ckpt.request_save()
        assert isinstance(request, SaveRequest) and request.step is None
        seen: list[int | None] = []

        async def handler() -> None:
            seen.append(await request.taken())

        async with anyio.create_task_group() as tg:
            tg.start_soon(handler)
            await anyio.sleep(0.01)
            assert seen == []  # not taken yet: the handler still waits
            assert await ckpt.save_if_requested(state, step=7)
        assert seen == [7] and request.step == 7
        stats = await request.wait()
        assert stats is not None and stats.step == 7
        assert await request.taken() == 7  # again: returns at once


async def test_a_request_never_taken_answers_none(tmp_path: Path) -> None:
    async with Checkpointer(tmp_path) as ckpt:
        request = ckpt.request_save()
    assert await request.taken() is None
    assert await request.wait() is None


async def test_progress_and_stats_as_plain_data(tmp_path: Path) -> None:
    state = {"w": torch.randn(256, 256)}
    async with Checkpointer(tmp_path) as ckpt:
        assert ckpt.status_line() == "no save in flight"
        await ckpt.save(state, step=1)
        flying = ckpt.in_flight()
        line = ckpt.status_line()
        for p in flying:
            assert isinstance(p, SaveProgress)
            d = p.to_dict()
            assert json.loads(json.dumps(d)) == d
            assert set(d) == {
                "step",
                "phase",
                "seconds",
                "staged_seconds",
                "bytes",
                "eta_seconds",
                "waiting_for",
            }
            assert p.status() in line and p.status().startswith("step 1: ")
        await ckpt.wait()
        assert ckpt.status_line() == "no save in flight"
        assert ckpt.last is not None
        plain = ckpt.last.to_dict()
        assert json.loads(json.dumps(plain)) == plain
        assert plain["step"] == 1 and plain["bytes"] == 256 * 256 * 4 and plain["budget"] is None


async def test_budgeted_stats_plain_data_holds_the_budget(tmp_path: Path) -> None:
    state = {"a": torch.randn(64, 64), "b": torch.randn(64, 64)}
    async with Checkpointer(tmp_path, host_budget_bytes=1 << 20) as ckpt:
        await ckpt.save(state, step=2)
        await ckpt.wait()
        assert ckpt.last is not None
        plain = ckpt.last.to_dict()
    assert isinstance(plain["budget"], dict) and plain["budget"]
    assert json.loads(json.dumps(plain)) == plain


def test_state_differences_bit_exact() -> None:
    a = {"w": torch.tensor([0.0, math.nan]), "n": 3, "f": math.nan, "l": [1, (2, "x")]}
    assert (
        state_differences(a, {"w": torch.tensor([0.0, math.nan]), "n": 3, "f": math.nan, "l": [1, (2, "x")]})
        == []
    )
    b = {"w": torch.tensor([-0.0, math.nan]), "n": 3.0, "f": math.nan, "l": [1, [2, "x"]]}
    diffs = state_differences(a, b)
    assert "state.w: bytes differ" in diffs
    assert any(d.startswith("state.n: a float, not a int") for d in diffs)
    assert any(d.startswith("state.l[1]: a list, not a tuple") for d in diffs)
    assert state_differences({"w": torch.zeros(2)}, {"w": torch.zeros(3)}) == [
        "state.w: shape (3,), not (2,)"
    ]
    assert state_differences({"w": torch.zeros(2)}, {"w": torch.zeros(2, dtype=torch.float64)}) == [
        "state.w: dtype torch.float64, not torch.float32"
    ]
    assert state_differences({"a": 1, "b": 2}, {"a": 1, "c": 2}, name="sd") == [
        "sd: keys missing: 'b'",
        "sd: keys not expected: 'c'",
    ]


def test_state_differences_resolves_views_and_statefuls() -> None:
    base = torch.randn(4, 4, dtype=torch.complex64)
    assert state_differences({"c": base.conj()}, {"c": base.conj().resolve_conj()}) == []
    assert state_differences({"t": base.real.t()}, {"t": base.real.t().contiguous()}) == []
    torch.manual_seed(0)
    m1 = nn.Linear(3, 3)
    torch.manual_seed(0)
    m2 = nn.Linear(3, 3)
    assert state_differences(m1, m2) == []
    with torch.no_grad():
        m2.bias[0] += 1
    assert state_differences({"model": m1}, {"model": m2}) == ["state.model.bias: bytes differ"]
    assert state_differences({"model": m1}, {"model": 5}) == ["state.model: a int, without a state_dict()"]

    @dataclass
    class Point:
        x: int
        y: Any

    assert state_differences(Point(1, torch.ones(1)), Point(1, torch.ones(1))) == []
    assert state_differences(Point(1, 2), Point(1, 3)) == ["state.y: 3, not 2"]
    deep: list[Any] = []
    deep.append(deep)
    assert "nested more than" in state_differences(deep, deep)[0]
