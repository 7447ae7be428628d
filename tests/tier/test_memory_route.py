"""The memory route (issue 42 section 1): a Checkpointer's memory snapshots go through
a save queue of their own, like the disk saves, so ``in_flight()``, ``fence()``,
``wait()`` and ``dropped`` see them the same way."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from async_stager import Checkpointer
from async_stager._tier.client import AgentClient
from tests.tier.helpers_tier import short_base
from tests.tier.test_checkpointer_tier import agent_on_loop, settle, state_of

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]


async def test_a_memory_snapshot_waiting_for_its_slot_is_in_flight(tmp_path: Path) -> None:
    """With ``"wait"``, a snapshot called while the previous one is being handed over
    waits for the tier's buffer set: ``in_flight()`` lists it (``memory-staging``)
    after the one committing, and both are held by the agent in the end."""
    with short_base() as base:
        async with (
            agent_on_loop(base),
            Checkpointer(tmp_path, agent=AgentClient("ck", base=base), persist_every=100) as ckpt,
        ):
            assert await ckpt.save(state_of(1), step=1)
            second = ckpt.save(state_of(2), step=2)  # submitted at the call
            assert [(p.step, p.phase) for p in ckpt.in_flight()] == [
                (1, "memory-committing"),
                (2, "memory-staging"),
            ]
            with anyio.fail_after(60):  # a hang guard
                assert await second
                await settle(ckpt)
            stats = ckpt.memory
            assert stats is not None and stats.saved == 2 and stats.skipped == 0
            assert ckpt.in_flight() == [] and ckpt.dropped == []


async def test_a_memory_snapshot_given_up_while_it_waits_commits_nothing(tmp_path: Path) -> None:
    """A snapshot whose caller is cancelled while it waits for the tier's buffer set is
    not handed over; the next one is, and ``fence()`` does not wait for the one given
    up."""
    with short_base() as base:
        async with (
            agent_on_loop(base),
            Checkpointer(tmp_path, agent=AgentClient("ck", base=base), persist_every=100) as ckpt,
        ):
            assert await ckpt.save(state_of(1), step=1)
            with anyio.CancelScope() as scope:
                scope.cancel()
                await ckpt.save(state_of(2), step=2)  # given up before it staged
            with anyio.fail_after(60):
                await ckpt.fence()
                await settle(ckpt)
                assert await ckpt.save(state_of(3), step=3)
                await settle(ckpt)
            stats = ckpt.memory
            assert stats is not None and stats.saved == 2 and stats.last_step == 3
