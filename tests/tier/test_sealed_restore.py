"""Restore from memory at the copy limit (issue 45 s2): sealed snapshots are trusted,
read once, straight into the state; damage is still never restored.

An in-process agent on the test's event loop and a real folder. A snapshot whose
trainer is gone is sealed by the agent (the kernel's memfd seals) and verified once
after the seal; the restore then skips its own re-hash (``MemoryStats.restored_sealed``)
and reads each tensor from the arena's descriptor into the state's own tensor. Damage
is made the only ways there are: a stray writer's shared mapping, before the seal
(found by the agent's check after the seal, or by the trainer's own while the writer
still maps it); after the seal the kernel refuses every write.
"""

from __future__ import annotations

import gc
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
from helpers import bits

from async_stager import Checkpointer
from async_stager._tier.agent import Agent
from async_stager._tier.client import AgentClient
from tests.tier.helpers_tier import short_base

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]


class Net(torch.nn.Module):
    """Tied weights, a buffer, a parameter of another dtype: every kind of leaf."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(40, 16)
        self.out = torch.nn.Linear(16, 40, bias=False)
        self.out.weight = self.emb.weight  # tied
        self.norm = torch.nn.LayerNorm(16)
        self.lowp = torch.nn.Parameter(torch.zeros(8, 8, dtype=torch.bfloat16))
        self.register_buffer("count", torch.zeros(3, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.emb(x))) + self.lowp.float().sum()


def trained(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    for _ in range(2):
        net(torch.arange(5)).sum().backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        net.get_buffer("count").add_(seed)
        net.lowp.add_(seed)
    base = torch.randn(50) + seed
    return {
        "model": net,
        "optim": opt,
        "extra": {"t": torch.randn(64, 3).t(), "list": [torch.randn(7), seed], "n": seed},
        # A view of another tensor of the state, both saved: destinations that overlap.
        "alias": {"base": base, "view": base[10:20]},
    }


def fresh() -> dict[str, Any]:
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    net(torch.arange(5)).sum().backward()
    opt.step()  # its state exists (the restore copies into it)
    opt.zero_grad()
    # A transposed tensor where a contiguous one was saved, and the reverse.
    base = torch.zeros(50)
    return {
        "model": net,
        "optim": opt,
        "extra": {"t": torch.zeros(3, 64), "list": [torch.zeros(7), -1]},
        "alias": {"base": base, "view": base[10:20]},
    }


def values(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": dict(state["model"].state_dict()),
        "optim": state["optim"].state_dict()["state"],
        "extra": {k: state["extra"][k] for k in ("t", "list")},
        "alias": state["alias"],
    }


def assert_values(a: Any, b: Any, path: str = "state") -> None:
    """Same structure, bit-equal tensors of the same dtype and shape (the state's own
    tensors keep their strides)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(bits(a), bits(b)), f"{path}: values differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a, key=str) == sorted(b, key=str), path
        for k in a:
            assert_values(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_values(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


@asynccontextmanager
async def agent_on_loop(base: str) -> AsyncIterator[Agent]:
    agent = Agent("sr", max_bytes=1 << 28, base=base)
    async with anyio.create_task_group() as tg:
        await tg.start(agent.serve)
        try:
            yield agent
        finally:
            await agent.stop()


async def save_steps(folder: Path, base: str, steps: range, during: Any = None) -> None:
    """A trainer saving ``steps`` to memory (every second one to the folder too), then
    ``during(ns)`` while it is still open, then closed (its arenas unmapped)."""
    async with Checkpointer(folder, agent=AgentClient("sr", base=base), persist_every=2) as ckpt:
        for step in steps:
            assert await ckpt.save(trained(step), step=step)
            await ckpt.wait()
            while ckpt.in_flight():
                await anyio.sleep(0.01)
        if during is not None:
            await during(str(folder.resolve()))
    gc.collect()  # the trainer's staged tensors die: nothing maps its arenas any more


async def restore(folder: Path, base: str) -> tuple[int | None, dict[str, Any], bool | None]:
    async with Checkpointer(folder, agent=AgentClient("sr", base=base), persist_every=2) as ckpt:
        state = fresh()
        got = await ckpt.restore(state)
        stats = ckpt.memory
        assert stats is not None
        return got, state, stats.restored_sealed


async def test_sealed_snapshot_restores_bit_exact_without_a_second_read(tmp_path: Path) -> None:
    with short_base() as base:
        async with agent_on_loop(base) as agent:
            await save_steps(tmp_path, base, range(1, 4))
            got, state, sealed = await restore(tmp_path, base)
            assert got == 3 and sealed is True
            assert_values(values(state), values(trained(3)))
            # The state's own tensors hold the bytes (tied weights stay tied).
            net = state["model"]
            assert net.out.weight is net.emb.weight and net.lowp.dtype == torch.bfloat16
            assert state["extra"]["n"] == 3
            alias = state["alias"]
            assert alias["view"].untyped_storage().data_ptr() == alias["base"].untyped_storage().data_ptr()
            held = [h for h in agent.snapshots() if h.step == 3]
            assert held and held[0].seal.verified

            # Sealed: the kernel refuses every write to its memory from now on.
            async with AgentClient("sr", base=base) as c:
                fetched = await c.fetch(0, 3, ns=str(tmp_path.resolve()))
                try:
                    assert fetched.sealed
                    fd, n = fetched.fds[0], fetched.handle.arenas[0].nbytes
                    with pytest.raises(PermissionError):
                        mmap.mmap(fd, n, flags=mmap.MAP_SHARED)
                    with pytest.raises(PermissionError):
                        os.pwrite(fd, b"x", 0)
                    with pytest.raises(PermissionError):
                        os.ftruncate(fd, 0)
                finally:
                    fetched.close()
            # A second restore of the same sealed snapshot: the same bytes.
            got, state, sealed = await restore(tmp_path, base)
            assert got == 3 and sealed is True
            assert_values(values(state), values(trained(3)))


async def _flip(base: str, ns: str, keep_open: list[mmap.mmap]) -> None:
    """A stray writer: flips a byte of step 3's first tensor through a shared mapping
    (possible only while the trainer lives: its arenas are not sealed yet); keeps the
    mapping if ``keep_open`` is a list (the writer is still there)."""
    async with AgentClient("sr", base=base) as c:
        fetched = await c.fetch(0, 3, ns=ns)  # no wait: no seal is tried
        try:
            assert not fetched.sealed
            ref = next(r for r in fetched.handle.refs if r[0] == "t")
            mm = mmap.mmap(fetched.fds[ref[1]], fetched.handle.arenas[ref[1]].nbytes, flags=mmap.MAP_SHARED)
            mm[ref[2]] ^= 0xFF
            keep_open.append(mm)
        finally:
            fetched.close()


async def test_damage_before_the_seal_is_found_by_the_agent(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The writer is gone before the restore: the agent seals, its check finds the
    changed byte and drops the snapshot; the restore takes step 2, never step 3."""
    caplog.set_level(logging.WARNING)
    maps: list[mmap.mmap] = []
    with short_base() as base:
        async with agent_on_loop(base) as agent:

            async def damage(ns: str) -> None:
                await _flip(base, ns, maps)
                maps.pop().close()

            await save_steps(tmp_path, base, range(1, 4), damage)
            got, state, _ = await restore(tmp_path, base)
            assert got == 2
            assert_values(values(state), values(trained(2)))
            assert "do not match their checksums after its seal" in caplog.text
            assert 3 not in [h.step for h in agent.snapshots()]


async def test_damage_while_a_writer_maps_it_is_found_by_the_trainer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The writer still maps the memory at the restore: the kernel refuses the seal,
    nothing is trusted, the trainer re-hashes every byte and refuses step 3."""
    caplog.set_level(logging.WARNING)
    maps: list[mmap.mmap] = []
    with short_base() as base:
        async with agent_on_loop(base):

            async def damage(ns: str) -> None:
                await _flip(base, ns, maps)

            try:
                await save_steps(tmp_path, base, range(1, 4), damage)
                got, state, _ = await restore(tmp_path, base)
            finally:
                for mm in maps:
                    mm.close()
            assert got == 2
            assert_values(values(state), values(trained(2)))
            assert "do not match their checksum" in caplog.text


async def test_a_failed_check_after_the_seal_never_stops_the_agent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The agent's hash after the seal fails (here: out of memory in its thread): the
    agent serves on, nothing is trusted, and the restore verifies every byte itself."""
    from async_stager._tier import sealing

    def no_memory(*args: Any, **kw: Any) -> Any:
        raise MemoryError("no memory for the hash")

    monkeypatch.setattr(sealing, "digests_in", no_memory)
    caplog.set_level(logging.WARNING)
    with short_base() as base:
        async with agent_on_loop(base) as agent:
            await save_steps(tmp_path, base, range(1, 3))
            got, state, sealed = await restore(tmp_path, base)
            assert got == 2 and sealed is False
            assert_values(values(state), values(trained(2)))
            assert "its check after the seal failed" in caplog.text
            assert not agent.closed and 2 in [h.step for h in agent.snapshots() if h.complete]
