"""Host memory: arenas, exact-size blocks, one pin registration and one fd per arena."""

from __future__ import annotations

import os

import pytest
import torch

from async_stager import PinningError
from async_stager._core.memory.arena import ALIGN, HostPool
from async_stager.testing import FakePinner

pytestmark = pytest.mark.timeout(30)


def test_blocks_are_exact_size_and_aligned() -> None:
    pool = HostPool(shared=False, pinner=None)
    try:
        blocks = pool.allocate([3, 100, 0, 4096, 1])
        assert [b.nbytes for b in blocks] == [3, 100, 0, 4096, 1]
        assert [b.tensor.numel() for b in blocks] == [3, 100, 0, 4096, 1]
        for b in blocks:
            if b.nbytes:
                assert b.offset % ALIGN == 0
                assert b.tensor.untyped_storage().nbytes() == b.nbytes
        # One call, one arena, blocks adjacent in order.
        assert len(pool.arenas) == 1
        assert blocks[1].offset == blocks[0].offset + ALIGN
    finally:
        pool.close()


def test_free_space_is_reused_and_empty_arenas_kept_until_trim() -> None:
    pinner = FakePinner()
    pool = HostPool(shared=False, pinner=pinner)
    try:
        a = pool.allocate([1 << 20, 1 << 20])
        assert pinner.total_registrations == 1 and len(pinner.registered) == 1
        pool.free([a[0]])
        b = pool.allocate([1 << 19])
        assert b[0].arena is a[0].arena and b[0].offset == 0  # reused, no new arena
        assert pinner.total_registrations == 1
        pool.free([a[1], b[0]])
        # A wholly free arena stays mapped and pinned for the next checkpoint...
        assert len(pool.arenas) == 1 and len(pinner.registered) == 1
        c = pool.allocate([2 << 20])
        assert c[0].arena is a[0].arena and pinner.total_registrations == 1
        pool.free(c)
        # ...until trim() gives it back.
        assert a[0].arena is not None
        assert pool.trim() == a[0].arena.nbytes
        assert pool.arenas == [] and pinner.registered == {}
    finally:
        pool.close()
    assert pinner.registered == {}


def test_pinning_failure_leaves_nothing_registered() -> None:
    pinner = FakePinner(fail=True)
    pool = HostPool(shared=True, pinner=pinner)
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(PinningError):
        pool.allocate([1024])
    assert pool.arenas == [] and pinner.registered == {}
    assert len(os.listdir("/proc/self/fd")) == before


def test_shared_arena_is_one_memfd() -> None:
    pool = HostPool(shared=True, pinner=None)
    try:
        pool.allocate([64] * 1000)
        (arena,) = pool.arenas
        assert arena.fd >= 0
        assert os.readlink(f"/proc/self/fd/{arena.fd}").startswith("/memfd:async_stager")
    finally:
        pool.close()
    assert not any(
        os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:async_stager")
        for fd in os.listdir("/proc/self/fd")
        if os.path.exists(f"/proc/self/fd/{fd}")
    )


def test_tensor_held_after_close_stays_valid() -> None:
    pool = HostPool(shared=False, pinner=None)
    (b,) = pool.allocate([16])
    t = b.tensor.view(torch.float32)
    t.copy_(torch.arange(4.0))
    pool.close()  # the mapping lives on while the tensor does
    assert torch.equal(t, torch.arange(4.0))
