"""Result lifetimes: a staged result the caller can still reach is never overwritten;
dropping it frees its buffer set; leases hand a result to another task; a wait that can
never end fails loudly instead of hanging."""

from __future__ import annotations

import gc
import logging
import threading
from typing import Any

import anyio
import pytest
import torch

from async_stager import BuffersHeldError, Lease, Stager, StagingError
from async_stager.testing import FakeBackend

pytestmark = pytest.mark.anyio


def _sd(step: int) -> dict[str, Any]:
    return {
        "model": {"w": torch.full((64, 64), float(step)), "b": torch.full((64,), float(step))},
        "optim": {"state": {0: {"exp_avg": torch.full((64, 64), float(step) + 0.5)}}},
        "step": step,
    }


def _set_step(sd: dict[str, Any], step: int) -> None:
    sd["model"]["w"].fill_(float(step))
    sd["model"]["b"].fill_(float(step))
    sd["optim"]["state"][0]["exp_avg"].fill_(float(step) + 0.5)
    sd["step"] = step


def _assert_step(staged: dict[str, Any], step: int) -> None:
    assert staged["step"] == step
    assert torch.equal(staged["model"]["w"], torch.full((64, 64), float(step)))
    assert torch.equal(staged["model"]["b"], torch.full((64,), float(step)))
    assert torch.equal(staged["optim"]["state"][0]["exp_avg"], torch.full((64, 64), float(step) + 0.5))


async def test_slow_writer_never_sees_a_later_step(anyio_backend: Any) -> None:
    """The reported pattern: each staged result goes to a writer task that is slower
    than the checkpoint interval. Every checkpoint must hold its own step."""
    sd = _sd(0)
    written: list[int] = []

    async def writer(staged: dict[str, Any], step: int) -> None:
        await anyio.sleep(0.03)  # slower than the training steps below
        _assert_step(staged, step)
        written.append(step)

    async with Stager() as stager, anyio.create_task_group() as tg:
        for step in range(1, 11):
            _set_step(sd, step)
            staged = await stager.stage(sd)
            tg.start_soon(writer, staged, step)
            del staged
            await anyio.sleep(0.005)
        assert stager.buffer_sets == 2
    assert sorted(written) == list(range(1, 11))


async def test_dropping_the_result_frees_its_buffer_set(anyio_backend: Any) -> None:
    sd = _sd(1)
    async with Stager() as stager:
        host = None
        for step in range(5):
            _set_step(sd, step)
            staged = await stager.stage(sd)
            _assert_step(staged, step)
            assert stager.stats is not None
            assert stager.stats.buffer_set == 0
            if step:
                assert stager.stats.fast_path
                assert stager.host_bytes == host
            host = stager.host_bytes
            del staged
        assert stager.buffer_sets == 1


@pytest.mark.parametrize("keep", ["dict", "tensor", "view", "storage", "numpy", "attr-holder"])
async def test_anything_reachable_keeps_the_result(anyio_backend: Any, keep: str) -> None:
    sd = _sd(1)
    async with Stager() as stager:
        staged = await stager.stage(sd)
        w = staged["model"]["w"]
        kept: Any
        if keep == "dict":
            kept = staged
        elif keep == "tensor":
            kept = w
        elif keep == "view":
            kept = w[3:5, 1:]
        elif keep == "storage":
            kept = w.untyped_storage()
        elif keep == "numpy":
            kept = w.numpy()
        else:
            kept = [{"deep": (w,)}]
        del staged, w
        _set_step(sd, 2)
        second = await stager.stage(sd)
        _assert_step(second, 2)
        assert stager.buffer_sets == 2
        # What was kept still holds step 1.
        if keep == "dict":
            _assert_step(kept, 1)
        elif keep == "tensor":
            assert torch.equal(kept, torch.full((64, 64), 1.0))
        elif keep == "view":
            assert torch.equal(kept, torch.full((2, 63), 1.0))
        elif keep == "storage":
            assert torch.equal(torch.empty(0).set_(kept), torch.full((64 * 64,), 1.0))
        elif keep == "numpy":
            assert (kept == 1.0).all()
        else:
            assert torch.equal(kept[0]["deep"][0], torch.full((64, 64), 1.0))
        # Once both are dropped, the next stages reuse the sets: no third one.
        del kept, second
        for step in (3, 4):
            _set_step(sd, step)
            staged = await stager.stage(sd)
            _assert_step(staged, step)
            del staged
        assert stager.buffer_sets == 2


async def test_caller_holding_every_set_gets_a_clear_error(
    anyio_backend: Any, caplog: pytest.LogCaptureFixture
) -> None:
    sd = _sd(1)
    caplog.set_level(logging.WARNING, logger="async_stager")
    async with Stager(max_buffer_sets=2, buffer_wait_timeout=0.5) as stager:
        a = await stager.stage(sd)
        b = await stager.stage(sd)
        with anyio.fail_after(10):
            with pytest.raises(BuffersHeldError, match="max_buffer_sets=2") as info:
                await stager.stage(sd)
        assert "still reachable" in str(info.value)
        assert any(r.name == "async_stager" and "waited" in r.getMessage() for r in caplog.records)
        # Nothing was staged and the stager stays usable once a result is dropped.
        _assert_step(a, 1)
        _assert_step(b, 1)
        del a
        _set_step(sd, 2)
        c = await stager.stage(sd)
        _assert_step(c, 2)
        _assert_step(b, 1)


async def test_one_buffer_set_waits_then_errors(anyio_backend: Any) -> None:
    sd = _sd(1)
    async with Stager(max_buffer_sets=1, buffer_wait_timeout=0.3) as stager:
        a = await stager.stage(sd)
        with pytest.raises(BuffersHeldError):
            await stager.stage(sd)
        _assert_step(a, 1)
        del a
        _set_step(sd, 2)
        b = await stager.stage(sd)
        _assert_step(b, 2)


async def test_wait_ends_when_another_task_drops_the_result(anyio_backend: Any) -> None:
    sd = _sd(1)
    holder: dict[str, Any] = {}
    async with Stager(max_buffer_sets=1, buffer_wait_timeout=30) as stager:
        holder["r"] = await stager.stage(sd)

        async def drop_later() -> None:
            await anyio.sleep(0.2)
            _assert_step(holder.pop("r"), 1)

        async with anyio.create_task_group() as tg:
            tg.start_soon(drop_later)
            _set_step(sd, 2)
            with anyio.fail_after(10):
                staged = await stager.stage(sd)
        _assert_step(staged, 2)
        assert stager.buffer_sets == 1


async def test_waiting_for_a_set_is_cancellable(anyio_backend: Any) -> None:
    sd = _sd(1)
    async with Stager(max_buffer_sets=1, buffer_wait_timeout=None) as stager:
        a = await stager.stage(sd)
        with anyio.move_on_after(0.2) as scope:
            await stager.stage(sd)
        assert scope.cancelled_caught
        _assert_step(a, 1)
        del a
        _set_step(sd, 3)
        with anyio.fail_after(10):
            b = await stager.stage(sd)
        _assert_step(b, 3)


async def test_result_in_a_reference_cycle_is_collected_not_waited_for(anyio_backend: Any) -> None:
    sd = _sd(1)
    async with Stager(max_buffer_sets=1, buffer_wait_timeout=5) as stager:
        a = await stager.stage(sd)
        a["self"] = a  # unreachable once dropped, but only the cycle collector frees it
        del a
        _set_step(sd, 2)
        with anyio.fail_after(4):
            b = await stager.stage(sd)
        _assert_step(b, 2)


async def test_lease_handed_to_a_writer_task(anyio_backend: Any) -> None:
    sd = _sd(1)
    done = anyio.Event()

    async def writer(lease: Lease[dict[str, Any]], step: int) -> None:
        async with lease as staged:
            await anyio.sleep(0.05)
            _assert_step(staged, step)
        assert lease.released
        done.set()

    async with Stager(max_buffer_sets=2) as stager:
        lease = await stager.lease(sd)
        assert isinstance(lease, Lease) and not lease.released
        async with anyio.create_task_group() as tg:
            tg.start_soon(writer, lease, 1)
            del lease
            # Training goes on while the writer holds the lease: another set.
            _set_step(sd, 2)
            staged = await stager.stage(sd)
            _assert_step(staged, 2)
            del staged
        await done.wait()
        # The writer released: a third stage reuses a set, no new one.
        _set_step(sd, 3)
        staged = await stager.stage(sd)
        _assert_step(staged, 3)
        assert stager.buffer_sets == 2


async def test_lease_release_is_idempotent_and_thread_safe(anyio_backend: Any) -> None:
    sd = _sd(1)
    async with Stager(max_buffer_sets=1, buffer_wait_timeout=5) as stager:
        lease = await stager.lease(sd)
        staged = lease.state_dict
        _assert_step(staged, 1)
        del staged
        threads = [threading.Thread(target=lease.release) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        lease.release()
        assert lease.released
        with pytest.raises(StagingError, match="released"):
            _ = lease.state_dict
        # Exactly one release happened: the only set is free again.
        _set_step(sd, 2)
        with anyio.fail_after(4):
            again = await stager.stage(sd)
        _assert_step(again, 2)


async def test_lease_as_sync_context_manager_and_gc(anyio_backend: Any) -> None:
    sd = _sd(1)
    async with Stager(max_buffer_sets=1, buffer_wait_timeout=5) as stager:
        with await stager.lease(sd) as staged:
            _assert_step(staged, 1)
        del staged
        _set_step(sd, 2)
        lease = await stager.lease(sd)
        del lease  # released when collected
        gc.collect()
        _set_step(sd, 3)
        with anyio.fail_after(4):
            staged = await stager.stage(sd)
        _assert_step(staged, 3)


async def test_leased_set_is_not_reused_after_its_result_is_dropped(anyio_backend: Any) -> None:
    """A lease protects even when no reference shows a consumer (a writer process)."""
    sd = _sd(1)
    async with Stager(max_buffer_sets=1, buffer_wait_timeout=0.3) as stager:
        lease = await stager.lease(sd)
        with pytest.raises(BuffersHeldError, match="lease"):
            await stager.stage(sd)
        lease.release()
        staged = await stager.stage(sd)
        _assert_step(staged, 1)


async def test_fake_device_results_are_not_overwritten(anyio_backend: Any) -> None:
    sd = _sd(1)
    async with Stager(backend=FakeBackend(), max_buffer_sets=2) as stager:
        a = await stager.stage(sd)
        _set_step(sd, 2)
        b = await stager.stage(sd)
        _assert_step(a, 1)
        _assert_step(b, 2)
        del a
        _set_step(sd, 3)
        c = await stager.stage(sd)
        _assert_step(b, 2)
        _assert_step(c, 3)
        assert stager.buffer_sets == 2


async def test_reserve_holds_nothing(anyio_backend: Any) -> None:
    sd = _sd(1)
    async with Stager(max_buffer_sets=1, buffer_wait_timeout=2) as stager:
        await stager.reserve(sd)
        staged = await stager.stage(sd)
        _assert_step(staged, 1)
        assert stager.buffer_sets == 1


async def test_fresh_tensors_reuse_memory_and_trim_returns_it(anyio_backend: Any) -> None:
    """Fresh tensors every checkpoint (full state dicts, converting hooks): the memory
    of the dead ones is reused, never unpinned and pinned again in the hot path; trim()
    returns what no result uses."""
    from async_stager.testing import FakePinner

    pinner = FakePinner()
    async with Stager(backend=FakeBackend(), pinner=pinner) as stager:
        registrations = []
        for step in range(6):
            staged = await stager.stage(_sd(step))
            _assert_step(staged, step)
            del staged
            registrations.append(pinner.total_registrations)
        assert registrations == [1] * 6, registrations
        held = stager.host_bytes
        assert held > 0
        # The last sources died with their dict: nothing uses the arena any more.
        assert await stager.trim() == held
        assert stager.host_bytes == 0 and pinner.registered == {}
        staged = await stager.stage(_sd(9))
        _assert_step(staged, 9)
        # A held result is never trimmed away.
        assert await stager.trim() == 0
        _assert_step(staged, 9)


async def test_a_plan_does_not_keep_a_tensor_key_alive(anyio_backend: Any) -> None:
    import weakref

    key = torch.ones(2)
    ref = weakref.ref(key)
    async with Stager() as stager:
        staged = await stager.stage({key: torch.zeros(3)})
        del staged, key
        gc.collect()
        assert ref() is None, "the stager kept a source tensor (a dict key) alive"
