"""Commits are delivered in commit order (``on_saved``, ``saved()``) when the writes of
several saves end close together: a save's commit is queued for delivery before its end
releases the later commits waiting behind it (``saved()`` once saw step 125 before 124
on a loaded machine)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from async_stager import Checkpointer, SaveStats


@pytest.mark.anyio
@pytest.mark.timeout(300)
async def test_commits_are_delivered_in_commit_order_with_writes_in_parallel(tmp_path: Path) -> None:
    seen: list[int] = []

    def on_saved(stats: SaveStats) -> None:
        seen.append(stats.step)

    # Saves of alternating sizes, three writes in flight: their threads end in any
    # order and close together, which is when a later commit could pass an earlier one.
    small = {"w": torch.arange(4.0)}
    big = {"w": torch.randn(256, 1024)}
    async with Checkpointer(tmp_path, keep=2, format="torch", max_in_flight=3, on_saved=on_saved) as ckpt:
        for step in range(1, 61):
            await ckpt.save(big if step % 3 == 1 else small, step=step)
        await ckpt.wait()
    assert seen == sorted(seen)
    assert seen == list(range(1, 61))
