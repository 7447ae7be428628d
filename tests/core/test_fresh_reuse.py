"""Host memory is reused by layout, not by identity: a state dict rebuilt with new
tensors every checkpoint (a full state dict, a converting state-dict hook) stages into
the memory the previous checkpoint used, with no new pin registration, no new mapping
and the same host addresses, and with the values of each checkpoint (issue 14)."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from async_stager import Stager
from async_stager.testing import FakePinner

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


def model_state(step: int, *, share: bool = False) -> dict[str, Any]:
    """A small model/optimizer state with new tensors each call, values per step."""
    flat = torch.full((64,), float(step))
    return {
        "model": {
            "w": torch.full((32, 32), float(step)),
            "b": torch.arange(32, dtype=torch.float32) + step,
            "tied": flat[:32] if share else torch.full((32,), float(step)),
            "tied2": flat[32:] if share else torch.full((32,), float(step)),
            "idx": torch.full((5,), step, dtype=torch.int64),
            "empty": torch.empty(0, 3),
        },
        "optim": {"state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.full((32, 32), -step)}}},
        "step": step,
    }


def host_ptrs(staged: dict[str, Any]) -> list[int]:
    m = staged["model"]
    return [
        m["w"].data_ptr(),
        m["b"].data_ptr(),
        m["tied"].data_ptr(),
        m["idx"].data_ptr(),
        staged["optim"]["state"][0]["exp_avg"].data_ptr(),
    ]


def assert_values(staged: dict[str, Any], step: int) -> None:
    expected = model_state(step)
    m, e = staged["model"], expected["model"]
    for k in ("w", "b", "tied", "tied2", "idx", "empty"):
        assert torch.equal(m[k], e[k]), k
    st = staged["optim"]["state"][0]
    assert torch.equal(st["step"], torch.tensor(float(step)))
    assert torch.equal(st["exp_avg"], torch.full((32, 32), -step))
    assert staged["step"] == step


async def test_fresh_tensors_reuse_memory_pins_and_addresses(anyio_backend: Any) -> None:
    pinner = FakePinner()
    async with Stager(pinner=pinner, copy_threads=1, max_buffer_sets=1) as stager:
        sd: Any = model_state(0)
        staged: Any = await stager.stage(sd)
        assert_values(staged, 0)
        pins = pinner.total_registrations
        arenas = [(id(a), a.base, a.nbytes) for s in stager._engine.sets.all() for a in s.pool.arenas]
        host = stager.host_bytes
        ptrs = host_ptrs(staged)
        assert pins >= 1
        del staged
        for step in range(1, 6):
            sd = None  # the predecessors die before the new state is built
            gc.collect()
            sd = model_state(step)
            staged = await stager.stage(sd)
            assert_values(staged, step)
            assert pinner.total_registrations == pins, "a fresh checkpoint pinned memory again"
            now = [(id(a), a.base, a.nbytes) for s in stager._engine.sets.all() for a in s.pool.arenas]
            assert now == arenas, "a fresh checkpoint mapped new host memory"
            assert stager.host_bytes == host
            assert host_ptrs(staged) == ptrs, "a fresh checkpoint moved to other host memory"
            stats = stager.stats
            assert stats is not None and stats.fast_path and stats.cache_misses == 0
            del staged


async def test_fresh_tensors_with_shared_storages_keep_their_sharing(anyio_backend: Any) -> None:
    async with Stager(copy_threads=1, max_buffer_sets=1) as stager:
        for step in range(4):
            sd: Any = model_state(step, share=True)
            staged: Any = await stager.stage(sd)
            del sd
            m = staged["model"]
            assert torch.equal(m["tied"], torch.full((32,), float(step)))
            assert torch.equal(m["tied2"], torch.full((32,), float(step)))
            # Two views of one source storage stay views of one host storage.
            assert m["tied"].untyped_storage().data_ptr() == m["tied2"].untyped_storage().data_ptr()
            del staged, m


async def test_a_changed_layout_is_not_taken_over(anyio_backend: Any) -> None:
    # Same shapes, but which leaves share a storage changes: the plan does not fit,
    # the slow path stages it (values and sharing as in the sources).
    async with Stager(copy_threads=1, max_buffer_sets=1) as stager:
        staged: Any = await stager.stage(model_state(1, share=False))
        del staged
        staged = await stager.stage(model_state(2, share=True))
        m = staged["model"]
        assert m["tied"].untyped_storage().data_ptr() == m["tied2"].untyped_storage().data_ptr()
        assert torch.equal(m["tied"], torch.full((32,), 2.0))
        assert stager.stats is not None and not stager.stats.fast_path
        del staged, m
        staged = await stager.stage(model_state(3, share=False))
        m = staged["model"]
        assert m["tied"].untyped_storage().data_ptr() != m["tied2"].untyped_storage().data_ptr()
        assert_values(staged, 3)
        del staged, m


async def test_live_predecessors_keep_their_memory(anyio_backend: Any) -> None:
    # Two live state dicts of one layout staged in turn: neither takes the other's
    # memory (a live source keeps its block), each stage holds its own values.
    async with Stager(copy_threads=1, max_buffer_sets=1) as stager:
        a, b = model_state(1), model_state(2)
        for _ in range(3):
            for sd, step in ((a, 1), (b, 2)):
                staged: Any = await stager.stage(sd)
                assert_values(staged, step)
                del staged
        # In place changes of either are seen at its next stage.
        a["model"]["w"].fill_(7.0)
        staged = await stager.stage(a)
        assert torch.equal(staged["model"]["w"], torch.full((32, 32), 7.0))
        del staged


async def test_a_fresh_stage_never_writes_into_a_result_still_held(anyio_backend: Any) -> None:
    async with Stager(copy_threads=1, max_buffer_sets=2) as stager:
        first: Any = await stager.stage(model_state(1))
        second: Any = await stager.stage(model_state(2))  # the other set: the first is held
        assert_values(first, 1)
        assert_values(second, 2)
        del first
        third: Any = await stager.stage(model_state(3))  # takes the first's memory over
        assert_values(second, 2)
        assert_values(third, 3)
        del second, third
