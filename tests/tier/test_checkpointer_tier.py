"""The Checkpointer with a memory tier (``agent=``): routing, restore choice, faults.

An in-process agent on the test's event loop; a real folder for the disk tier.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from helpers import assert_same

from async_stager import Checkpointer
from async_stager._tier.agent import Agent
from async_stager._tier.client import AgentClient
from async_stager._tier.tier import MemoryTier
from async_stager.errors import InvalidOptionError
from tests.tier.helpers_tier import short_base

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]


def state_of(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    model = torch.nn.Linear(32, 16)
    with torch.no_grad():
        model.weight.copy_(torch.randn(16, 32, generator=g))
        model.bias.copy_(torch.randn(16, generator=g))
    return {"model": model, "extra": {"t": torch.randn(100, generator=g), "n": step}}


def values(state: dict[str, Any]) -> dict[str, Any]:
    return {"model": dict(state["model"].state_dict()), "extra": state["extra"]}


def blank() -> dict[str, Any]:
    return {"model": torch.nn.Linear(32, 16), "extra": {"t": torch.zeros(100), "n": -1}}


@asynccontextmanager
async def agent_on_loop(base: str, job: str = "ck") -> AsyncIterator[Agent]:
    agent = Agent(job, max_bytes=1 << 28, base=base)
    async with anyio.create_task_group() as tg:
        await tg.start(agent.serve)
        try:
            yield agent
        finally:
            await agent.stop()


async def settle(ckpt: Checkpointer) -> None:
    """Until no memory snapshot is in flight and every disk save committed."""
    await ckpt.wait()
    while ckpt.in_flight():
        await anyio.sleep(0.01)


async def test_routing_and_restore_from_memory(tmp_path: Path) -> None:
    with short_base() as base:
        async with agent_on_loop(base):
            client = AgentClient("ck", base=base)
            async with Checkpointer(tmp_path, agent=client, memory_every=1, persist_every=3) as ckpt:
                for step in range(1, 8):
                    assert await ckpt.save(state_of(step), step=step)
                    await settle(ckpt)
                assert ckpt.steps() == [3, 6]
                stats = ckpt.memory
                assert stats is not None and stats.saved == 7 and stats.last_step == 7 and stats.bytes > 0
            # A new Checkpointer (a restarted trainer) restores step 7 from memory, bit-exact.
            async with Checkpointer(tmp_path, agent=AgentClient("ck", base=base), persist_every=3) as ckpt:
                state = blank()
                assert await ckpt.restore(state) == 7
                assert_same(values(state), values(state_of(7)))
                # Step 6 is not in memory any more: from the folder.
                state = blank()
                assert await ckpt.restore(state, step=6) == 6
                assert_same(values(state), values(state_of(6)))


async def test_disk_newer_than_memory_and_other_world(tmp_path: Path) -> None:
    with short_base() as base:
        async with agent_on_loop(base), anyio.create_task_group() as tg:
            # A snapshot of another world size (rank 0 of 2) never restores here.
            other = MemoryTier(AgentClient("ck", base=base), world=2)
            other.open(tg)
            assert await other.save(dict(values(state_of(50))), 50)
            while other.in_flight():
                await anyio.sleep(0.01)
            assert other.stats.saved == 1
            await other.aclose()
            async with Checkpointer(
                tmp_path, agent=AgentClient("ck", base=base), memory_every=1, persist_every=2
            ) as ckpt:
                assert await ckpt.save(state_of(1), step=1)
                await settle(ckpt)
                assert await ckpt.save(state_of(2), step=2)
                await settle(ckpt)
                state = blank()
                assert await ckpt.restore(state) == 2  # in memory and on disk
                assert_same(values(state), values(state_of(2)))
                # Its writer (this process's own tier) still maps the memory: the kernel
                # refuses the seal, so the restore verified every byte itself.
                assert ckpt.memory is not None and ckpt.memory.restored_sealed is False
            # The agent's snapshots of step 2 and 50: the folder's step 4 is newer.
            async with Checkpointer(tmp_path) as ckpt:
                assert await ckpt.save(state_of(4), step=4)
            async with Checkpointer(tmp_path, agent=AgentClient("ck", base=base), persist_every=2) as ckpt:
                state = blank()
                assert await ckpt.restore(state) == 4
                assert_same(values(state), values(state_of(4)))


async def test_damaged_memory_restores_from_disk(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with short_base() as base:
        async with agent_on_loop(base):
            async with Checkpointer(tmp_path, agent=AgentClient("ck", base=base), persist_every=2) as ckpt:
                for step in (1, 2, 3):
                    assert await ckpt.save(state_of(step), step=step)
                    await settle(ckpt)
                # Flip a byte of step 3 in the agent's memory (what a stray write would
                # do), while the trainer lives: once it is gone the agent seals the
                # memory and the kernel refuses every write (test_sealed_restore).
                async with AgentClient("ck", base=base) as c:
                    fetched = await c.fetch(0, 3, ns=str(tmp_path.resolve()))
                    try:
                        ref = next(r for r in fetched.handle.refs if r[0] == "t")
                        fd = fetched.fds[ref[1]]
                        mm = mmap.mmap(fd, fetched.handle.arenas[ref[1]].nbytes, flags=mmap.MAP_SHARED)
                        mm[ref[2]] ^= 0xFF
                        mm.close()
                    finally:
                        fetched.close()
            caplog.set_level(logging.WARNING, "async_stager.checkpoint")
            async with Checkpointer(tmp_path, agent=AgentClient("ck", base=base), persist_every=2) as ckpt:
                state = blank()
                assert await ckpt.restore(state) == 2  # never the damaged step 3
                assert_same(values(state), values(state_of(2)))
            # Found by the agent's check after its seal, or by the trainer's own.
            assert "do not match their checksum" in caplog.text


async def test_no_agent_running_falls_back_to_disk(tmp_path: Path) -> None:
    """With no agent running, a memory-only save returns False (nothing was stored) and
    warns once; ``dropped`` lists the steps saved nowhere, never one committed to disk."""
    with short_base() as base:
        async with Checkpointer(
            tmp_path, agent=AgentClient("nobody", base=base, timeout=2), memory_every=1, persist_every=2
        ) as ckpt:
            with pytest.warns(RuntimeWarning, match="memory checkpoints are off") as warned:
                assert not await ckpt.save(state_of(1), step=1)  # memory only: nowhere to go
                assert await ckpt.save(state_of(2), step=2)  # disk goes on
                assert not await ckpt.save(state_of(3), step=3)  # memory only, and the tier is off
                assert await ckpt.save(state_of(4), step=4)
                await settle(ckpt)
            assert len([w for w in warned if "memory checkpoints are off" in str(w.message)]) == 1
            assert ckpt.steps() == [2, 4]
            assert ckpt.dropped == [1, 3]
            stats = ckpt.memory
            assert stats is not None and stats.failures == 1 and stats.saved == 0 and not stats.available
            state = blank()
            assert await ckpt.restore(state) == 4
            assert_same(values(state), values(state_of(4)))


async def test_skip_policy_when_both_slots_are_busy(tmp_path: Path) -> None:
    with short_base() as base:
        async with agent_on_loop(base):
            async with Checkpointer(
                tmp_path, agent=AgentClient("ck", base=base), policy="skip", persist_every=100
            ) as ckpt:
                assert await ckpt.save(state_of(1), step=1)
                phases = [p.phase for p in ckpt.in_flight()]
                assert phases == ["memory-committing"]
                # Its commit is in flight: the next snapshot is skipped, and says so.
                assert not await ckpt.save(state_of(2), step=2)
                assert ckpt.dropped == [2]
                await settle(ckpt)
                assert await ckpt.save(state_of(3), step=3)
                await settle(ckpt)
                stats = ckpt.memory
                assert stats is not None and stats.saved == 2 and stats.skipped == 1
            async with Checkpointer(
                tmp_path, agent=AgentClient("ck", base=base), policy="wait", persist_every=100
            ) as ckpt:
                assert await ckpt.save(state_of(4), step=4)
                assert await ckpt.save(state_of(5), step=5)  # waits for step 4's commit
                await settle(ckpt)
                stats = ckpt.memory
                assert stats is not None and stats.saved == 2 and stats.skipped == 0
                state = blank()
                assert await ckpt.restore(state) == 5
                assert_same(values(state), values(state_of(5)))


def test_options() -> None:
    with pytest.raises(InvalidOptionError, match="need agent"):
        Checkpointer("/tmp/unused-dev38", persist_every=5)
    with pytest.raises(InvalidOptionError, match="memory_every"):
        Checkpointer("/tmp/unused-dev38", agent="j", memory_every=0)
    with pytest.raises(InvalidOptionError, match="policy"):
        Checkpointer("/tmp/unused-dev38", agent="j", policy="coalesce")
    assert not os.path.exists("/tmp/unused-dev38")


async def test_two_folders_of_one_job_never_mix(tmp_path: Path) -> None:
    """One agent, two Checkpointers with different folders: each restores only its
    own snapshots (the folder is the snapshots' namespace)."""
    with short_base() as base:
        async with agent_on_loop(base):
            async with Checkpointer(
                tmp_path / "a", agent=AgentClient("ck", base=base), persist_every=100
            ) as a:
                assert await a.save(state_of(8), step=8)
                await a.wait()
            async with Checkpointer(tmp_path / "b", agent=AgentClient("ck", base=base), persist_every=2) as b:
                assert await b.save(state_of(2), step=2)
                await b.wait()
                state = blank()
                assert await b.restore(state) == 2
                assert_same(values(state), values(state_of(2)))
            async with Checkpointer(
                tmp_path / "a", agent=AgentClient("ck", base=base), persist_every=100
            ) as a:
                state = blank()
                assert await a.restore(state) == 8
                assert_same(values(state), values(state_of(8)))


async def test_fence_covers_memory_snapshots(tmp_path: Path) -> None:
    """``create_task(ckpt.save(...))`` then ``await ckpt.fence()``: the sources may
    change after the fence, and the memory snapshot still holds the values as of the
    call, also for a save that waited for a busy slot."""

    async def run(coro: Any) -> None:
        await coro

    with short_base() as base:
        async with (
            agent_on_loop(base),
            Checkpointer(tmp_path, agent=AgentClient("ck", base=base), persist_every=100) as ckpt,
        ):
            state = {"t": torch.zeros(1 << 20)}
            async with anyio.create_task_group() as tg:
                for step in (1, 2):
                    state["t"].fill_(step)
                    tg.start_soon(run, ckpt.save(dict(state), step=step))  # (the second waits for a slot)
                    await ckpt.fence()
                    state["t"].fill_(-1.0)  # training goes on
            await ckpt.wait()
            got = {"t": torch.zeros(1 << 20)}
            assert await ckpt.restore(got) == 2
            assert bool((got["t"] == 2.0).all())
            got = {"t": torch.zeros(1 << 20)}
            assert await ckpt.restore(got, step=1) == 1
            assert bool((got["t"] == 1.0).all())


async def test_deferred_wait_snapshot_point_is_the_call(tmp_path: Path) -> None:
    """A ``"wait"`` memory save behind one still committing stages later, but its
    snapshot point is the call: a generator drawn from right after the call is saved
    as it was at the call (as the Checkpointer's deferred disk saves do)."""

    async def run(coro: Any) -> None:
        await coro

    with short_base() as base:
        async with (
            agent_on_loop(base),
            Checkpointer(tmp_path, agent=AgentClient("ck", base=base), persist_every=100) as ckpt,
        ):
            gen = torch.Generator().manual_seed(7)
            state: dict[str, Any] = {"t": torch.zeros(1 << 20), "rng": gen}
            assert await ckpt.save(state, step=1)  # its commit is in flight: step 2 waits
            assert [p.phase for p in ckpt.in_flight()] == ["memory-committing"]
            at_call = gen.get_state().clone()
            async with anyio.create_task_group() as tg:
                tg.start_soon(run, ckpt.save(state, step=2))
                torch.randn(100, generator=gen)  # training goes on, drawing numbers
                await ckpt.fence()
            await ckpt.wait()
            got: dict[str, Any] = {"t": torch.zeros(1 << 20), "rng": torch.Generator()}
            assert await ckpt.restore(got) == 2
            assert torch.equal(got["rng"].get_state(), at_call)


async def test_close_with_a_memory_save_never_awaited(tmp_path: Path) -> None:
    """A memory save called and never awaited (its coroutine still referenced) does not
    hold the Checkpointer's close: its slot is given up at close."""
    with short_base() as base:
        async with agent_on_loop(base):
            with anyio.fail_after(60):  # a hang guard: the close used to wait for ever
                async with Checkpointer(
                    tmp_path, agent=AgentClient("ck", base=base), persist_every=100
                ) as ckpt:
                    pending = ckpt.save(state_of(1), step=1)  # staged at the call, never awaited
            assert await pending is False  # abandoned at the close
            async with Checkpointer(tmp_path, agent=AgentClient("ck", base=base), persist_every=100) as ckpt:
                assert await ckpt.save(state_of(2), step=2)
                await ckpt.wait()
                state = blank()
                assert await ckpt.restore(state) == 2
                assert_same(values(state), values(state_of(2)))


class Peer:
    """The other rank of a 2-rank job, at the lowest layer only: the tier's all-gather
    (``agree``) answers with this rank's steps and the peer's, which the test sets, and
    blocks while the peer is "still committing" (``hold``)."""

    def __init__(self) -> None:
        import threading

        self.steps: list[int] = []
        self.go = threading.Event()
        self.go.set()
        self.calls = 0

    def agree(self, mine: list[list[int]]) -> list[list[list[int]]]:
        # Each rank's (complete steps, those replicated, its replication): none here.
        self.go.wait(60)
        self.calls += 1
        return [mine, [list(self.steps), [], []]]


async def _held(agent: Agent) -> list[int]:
    return [h.step for h in agent.snapshots(0) if h.complete]


async def test_a_rank_keeps_the_step_a_slower_rank_needs() -> None:
    """Rank 0 commits steps 1-3 while the other rank is still committing step 2: rank 0
    keeps step 1 (the only step both hold), and its save of step 4, with no buffer set
    free, waits for the other rank instead of letting step 1 go. Once the other rank
    holds step 2, step 1 goes and the save proceeds. A rank that never commits (its agent refuses)
    does not stall the other for ever: after the exchanges of the saves before, the
    oldest step that is not the common one goes."""
    peer = Peer()
    with short_base() as base:
        async with agent_on_loop(base) as agent, anyio.create_task_group() as tg:
            tier = MemoryTier(
                AgentClient("ck", base=base), rank=0, world=2, keep=2, agree=peer.agree, timeline="t"
            )
            tier.open(tg)
            peer.steps = [1]
            assert await tier.save({"t": torch.full((1000,), 1.0)}, 1)
            await tier.wait()
            peer.go.clear()  # the other rank is still committing step 2 (its exchange waits)
            for step in (2, 3):
                assert await tier.save({"t": torch.full((1000,), float(step))}, step)
                with anyio.fail_after(30):
                    while tier.busy:
                        await anyio.sleep(0.01)
            assert await _held(agent) == [1, 2, 3]  # 1 is the only step both hold: kept
            saved = anyio.Event()

            async def save4() -> None:
                assert await tier.save({"t": torch.full((1000,), 4.0)}, 4)
                saved.set()

            tg.start_soon(save4)
            with anyio.move_on_after(0.5):
                await saved.wait()
            assert not saved.is_set() and await _held(agent) == [1, 2, 3]
            peer.steps = [1, 2]
            peer.go.set()
            with anyio.fail_after(30):
                await saved.wait()
            await tier.wait()
            assert 1 not in await _held(agent) and 4 in await _held(agent)
            # The other rank stops committing at all: this one goes on regardless.
            peer.steps = []
            for step in range(5, 10):
                with anyio.fail_after(30):
                    assert await tier.save({"t": torch.full((1000,), float(step))}, step)
                await tier.wait()
            assert 9 in await _held(agent) and len(await _held(agent)) <= 3
            await tier.aclose()
