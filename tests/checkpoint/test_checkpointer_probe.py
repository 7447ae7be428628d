"""The defects a hostile probe found after the write moved into a thread of its own
(issue 24), each a regression test through the public API."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from async_stager import Checkpointer, CheckpointError

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("fmt", ["dcp", "torch"])
async def test_a_save_cancelled_while_its_write_started_is_never_committed(tmp_path: Path, fmt: Any) -> None:
    """Step 1 writes a big state; save(step=2) waits for the write slot under a deadline.
    The loop is blocked while step 1 ends and the deadline passes: the loop then starts
    step 2's write thread before it delivers the cancellation. The thread waits until
    its caller returned or gave up before it commits: step 2 is never committed."""
    big = {"t": torch.zeros(8_000_000)}  # 32 MB: its write outlasts the fence
    small = {"t": torch.ones(1000)}
    returned: list[bool] = []

    async def second(ckpt: Checkpointer) -> None:
        with anyio.move_on_after(0.2):
            await ckpt.save(small, step=2)
            returned.append(True)

    async with Checkpointer(tmp_path, format=fmt, on_saved=lambda s: time.sleep(0.3)) as ckpt:
        async with anyio.create_task_group() as tg:
            await ckpt.save(big, step=1)
            tg.start_soon(second, ckpt)
            await ckpt.fence()  # step 2 staged, waiting for the slot
            time.sleep(0.8)  # blocking work: step 1 ends, step 2's deadline passes
        await ckpt.wait()
        assert ckpt.steps() == ([1, 2] if returned else [1])


@pytest.mark.parametrize("fmt", ["dcp", "torch"])
async def test_skip_counts_only_writes_still_running(tmp_path: Path, fmt: Any) -> None:
    """A loop whose only await is save(), with blocking work between saves long enough
    for each write to end in its thread: "skip" skips nothing."""
    state: dict[str, Any] = {"t": torch.zeros(1000), "n": 0}
    results = []
    async with Checkpointer(tmp_path, format=fmt, policy="skip", max_in_flight=1) as ckpt:
        for i in range(4):
            deadline = time.monotonic() + 10
            while ckpt.in_flight() and time.monotonic() < deadline:
                time.sleep(0.01)  # training work, no await: the write ends in its thread
            state["t"].fill_(i)
            state["n"] = i
            results.append(await ckpt.save(state, step=i))
        await ckpt.wait()
    assert results == [True] * 4 and ckpt.dropped == []


async def test_a_plain_value_under_an_int_key_is_refused_in_the_dcp_format(tmp_path: Path) -> None:
    """DCP gives a pickled value back under the str of its int key ({'0': 5} beside
    {0: ...}): refused loudly, naming the path, instead of a wrong restore."""
    async with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(CheckpointError, match=r"\['counts'\]\[0\].*not a tensor under an int dict key"):
            ckpt.save({"counts": {0: 5}}, step=1).close()  # at the call (issue 41, section 4)
        assert ckpt.steps() == []
        await ckpt.save({"m": {0: torch.ones(2)}}, step=2)  # tensors under int keys are fine
        await ckpt.wait()
        out: dict[str, Any] = {}
        assert await ckpt.restore(out) == 2 and torch.equal(out["m"][0], torch.ones(2))
    async with Checkpointer(tmp_path / "torch", format="torch") as ckpt:  # the torch format keeps them
        await ckpt.save({"counts": {0: 5}}, step=1)
        await ckpt.wait()
        back: dict[str, Any] = {}
        assert await ckpt.restore(back) == 1 and back == {"counts": {0: 5}}


@pytest.mark.timeout(30)
async def test_a_state_that_refers_to_itself_fails_loudly_in_the_torch_format(tmp_path: Path) -> None:
    a: list[Any] = [1]
    a.append(a)
    async with Checkpointer(tmp_path, format="torch") as ckpt:
        with anyio.fail_after(20):  # it looped for ever, on the event loop
            try:
                await ckpt.save({"a": a}, step=1)
                await ckpt.wait()
            except CheckpointError:
                pass
        assert ckpt.steps() == []
