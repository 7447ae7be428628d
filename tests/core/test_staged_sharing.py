"""torch's shared-memory calls on staged tensors (issue 41, section 3).

A staged tensor of a shared-memory stager lives in memory other processes map, and
says so (``is_shared()``); ``share_memory_()`` leaves it in place. A private stager's
staged tensor is moved by ``share_memory_()`` (torch's semantics), and the stager then
stages into its own memory again, never into the moved storage: later stages stay in
the arenas (and on a device, whose small tensors are gathered into the arena, their
results are never stale).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from async_stager import Stager
from async_stager._core.copy.simulated import SimulatedBackend, SimulatedDevice

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


def state(n: int = 4, value: float = 0.0) -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.full((256,), value + i) for i in range(n)}


def ptrs(staged: dict[str, torch.Tensor]) -> dict[str, int]:
    return {k: v.data_ptr() for k, v in staged.items()}


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_staged_tensors_of_a_shared_stager_say_they_are_shared(anyio_backend: Any) -> None:
    sd = state()
    async with Stager(share_memory=True) as shared, Stager(share_memory=False) as private:
        staged = await shared.stage(sd)
        assert all(t.is_shared() and t.untyped_storage().is_shared() for t in staged.values())
        mine = await private.stage(sd)
        assert not any(t.is_shared() or t.untyped_storage().is_shared() for t in mine.values())
    # torch's own answer for everything else, untouched.
    assert not torch.zeros(4).is_shared()
    assert torch.zeros(4).share_memory_().is_shared()


async def test_share_memory_leaves_a_shared_staged_tensor_in_place(anyio_backend: Any) -> None:
    sd = state()
    async with Stager(share_memory=True) as stager:
        staged = await stager.stage(sd)
        where = ptrs(staged)
        before = fds()
        assert all(t.share_memory_() is t for t in staged.values())
        assert ptrs(staged) == where
        assert fds() == before  # no shared-memory segment made for them
        del staged
        for v in sd.values():
            v.add_(10)
        again = await stager.stage(sd)
        assert ptrs(again) == where  # the same blocks of the stager's arena
        assert all(torch.equal(again[k], sd[k]) for k in sd)
        assert stager.stats is not None and stager.stats.fast_path


async def test_share_memory_moves_a_private_staged_tensor_and_the_stager_stays_in_its_memory(
    anyio_backend: Any,
) -> None:
    sd = state()
    async with Stager(share_memory=False) as stager:
        staged = await stager.stage(sd)
        where = ptrs(staged)
        moved = staged["w1"].share_memory_()  # torch's semantics: moved to new shared memory
        assert moved.is_shared() and moved.data_ptr() != where["w1"]
        del staged
        gc.collect()
        for _ in range(3):
            for v in sd.values():
                v.add_(1)
            again = await stager.stage(sd)
            # Back in the stager's own memory, the moved tensor's block reused.
            assert ptrs(again) == where
            assert all(torch.equal(again[k], sd[k]) for k in sd)
            # The moved tensor views other memory: it holds no buffer set, and keeps its values.
            assert stager.buffer_sets == 1
            assert torch.equal(moved, torch.full((256,), 1.0))
            del again
        assert stager.stats is not None and stager.stats.fast_path


@pytest.fixture
def sim() -> Iterator[SimulatedDevice]:
    with SimulatedDevice(seed=11, delay=(0.0, 0.002)) as device:
        yield device
    assert device.errors == []


@pytest.mark.parametrize("share_memory", [False, True])
async def test_after_share_memory_device_stages_are_never_stale(
    sim: SimulatedDevice, share_memory: bool, anyio_backend: Any
) -> None:
    """On a device, small tensors are gathered on the device and land in the arena in
    one copy; a staged tensor moved out of the arena used to keep its old values in
    every later result."""
    sd = {f"s{i}": sim.tensor(torch.full((3,), float(i))) for i in range(40)}
    async with Stager(
        backend=SimulatedBackend(sim), small_tensor_bytes=64, share_memory=share_memory
    ) as stager:
        staged = await stager.stage(sd)
        staged["s5"].share_memory_()
        del staged
        for _ in range(3):
            for v in sd.values():
                v.add_(1)
            sim.synchronize()
            again = await stager.stage(sd)
            stale = [k for k in sd if not torch.equal(again[k], sd[k])]
            assert stale == []
            del again


async def test_a_moved_tensor_does_not_keep_trim_from_returning_the_memory(anyio_backend: Any) -> None:
    sd = state()
    async with Stager(share_memory=False) as stager:
        staged = await stager.stage(sd)
        moved = staged["w2"].share_memory_()
        del staged
        assert stager.host_bytes > 0
        assert await stager.trim() > 0
        assert stager.host_bytes == 0
        assert torch.equal(moved, torch.full((256,), 2.0))
        again = await stager.stage(sd)
        assert all(torch.equal(again[k], sd[k]) for k in sd)


@pytest.mark.parametrize("share_memory", [False, True])
async def test_the_rest_of_a_result_stays_protected_after_one_tensor_moved(
    share_memory: bool, anyio_backend: Any
) -> None:
    sd = state()
    async with Stager(share_memory=share_memory, max_buffer_sets=2) as stager:
        staged = await stager.stage(sd)
        staged["w1"].share_memory_()
        kept = {k: v.clone() for k, v in staged.items()}
        for _ in range(3):
            for v in sd.values():
                v.add_(1)
            again = await stager.stage(sd)  # never into the set `staged` still lives in
            assert all(torch.equal(again[k], sd[k]) for k in sd)
            assert all(torch.equal(staged[k], kept[k]) for k in kept)
            del again
        assert stager.buffer_sets == 2
