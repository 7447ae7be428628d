"""The release rule: an explicit release (the end of ``async with stager.snapshot(sd)``
or ``async with lease``, ``lease.release()``) hands the buffer set back at once, even
when the name ``staged`` still refers to the staged copy: release empties the copy's
top level. Whatever was taken out of it and is still referenced (a tensor, a nested
dict, a view, a numpy array) stays a protected staged result: its values never change
and it holds its set until dropped. And ``trim()`` returns the memory of every set
that holds no result.
"""

from __future__ import annotations

import collections
import gc
import threading
import time
from typing import Any, NamedTuple

import anyio
import pytest
import torch
import torch.utils.dlpack

from async_stager import BuffersHeldError, Lease, Stager, StagingError
from async_stager.testing import FakeBackend, FakePinner

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


def _sd(step: float) -> dict[str, Any]:
    return {
        "model": {"w": torch.full((64, 64), step), "b": torch.full((64,), step)},
        "optim": {"state": {0: {"exp_avg": torch.full((64, 64), step + 0.5)}}, "param_groups": [{"lr": 0.1}]},
        "step": step,
    }


def _set_step(sd: dict[str, Any], step: float) -> None:
    sd["model"]["w"].fill_(step)
    sd["model"]["b"].fill_(step)
    sd["optim"]["state"][0]["exp_avg"].fill_(step + 0.5)
    sd["step"] = step


def _assert_step(staged: dict[str, Any], step: float) -> None:
    assert staged["step"] == step
    assert torch.equal(staged["model"]["w"], torch.full((64, 64), step))
    assert torch.equal(staged["model"]["b"], torch.full((64,), step))
    assert torch.equal(staged["optim"]["state"][0]["exp_avg"], torch.full((64, 64), step + 0.5))


# -- the documented patterns free their memory at the end of the block ----------------


async def test_snapshot_loop_uses_one_buffer_set(anyio_backend: Any) -> None:
    """The quickstart loop: ``staged`` stays bound after each block, and still every
    iteration stages into the same buffer set, on the fast path, with the same memory."""
    sd = _sd(0.0)
    written: list[float] = []
    async with Stager() as stager:
        host = None
        for step in range(8):
            _set_step(sd, float(step))
            async with stager.snapshot(sd) as staged:
                _assert_step(staged, float(step))
                written.append(staged["step"])
            assert staged == {}  # what the name still bound after the block sees
            stats = stager.stats
            assert stats is not None and stats.buffer_set == 0
            if step:
                assert stats.fast_path
                assert stager.host_bytes == host
            host = stager.host_bytes
        assert stager.buffer_sets == 1
    assert written == [float(s) for s in range(8)]


async def test_lease_writer_task_then_a_stage_does_not_stall(anyio_backend: Any) -> None:
    """A writer task releases with ``async with lease as staged:`` and lives on (its
    frame keeps ``staged``): with one buffer set, the next stage still goes ahead."""
    sd = _sd(1.0)
    written = anyio.Event()
    finish = anyio.Event()
    seen: list[Any] = []

    async def writer(lease: Lease[dict[str, Any]]) -> None:
        async with lease as staged:
            await anyio.sleep(0.02)
            _assert_step(staged, 1.0)
        written.set()
        await finish.wait()  # the frame, and the name ``staged``, live on
        seen.append(staged)

    async with Stager(max_buffer_sets=1, buffer_wait_timeout=20) as stager:
        async with anyio.create_task_group() as tg:
            tg.start_soon(writer, await stager.lease(sd))
            await written.wait()
            _set_step(sd, 2.0)
            with anyio.fail_after(10):  # before the rule: BuffersHeldError after 20 s
                again = await stager.stage(sd)
            _assert_step(again, 2.0)
            finish.set()
        assert stager.buffer_sets == 1
    assert seen == [{}]


async def test_writer_loop_with_a_queue_keeps_one_set(anyio_backend: Any) -> None:
    """A writer loop fed leases through a stream, ``async with lease as staged`` each
    time, and a trainer that never waits for it: two sets at most, never a stall."""
    sd = _sd(0.0)
    send, receive = anyio.create_memory_object_stream[Lease[dict[str, Any]]](1)
    steps: list[float] = []

    async def writer() -> None:
        async with receive:
            async for lease in receive:
                async with lease as staged:
                    await anyio.sleep(0.005)
                    steps.append(staged["step"])
                    _assert_step(staged, staged["step"])

    async with Stager(max_buffer_sets=2, buffer_wait_timeout=20) as stager:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(writer)
                async with send:
                    for step in range(10):
                        _set_step(sd, float(step))
                        await send.send(await stager.lease(sd))
        assert stager.buffer_sets <= 2
    assert steps == [float(s) for s in range(10)]


# -- what a kept reference sees after the block -------------------------------------


@pytest.mark.parametrize(
    "keep", ["tensor", "nested-dict", "view", "numpy", "storage", "dlpack", "loop-variable"]
)
async def test_what_is_taken_out_stays_valid_and_holds_its_set(anyio_backend: Any, keep: str) -> None:
    """A tensor (or anything viewing its memory) taken out of a released copy is an
    ordinary staged result: never overwritten, it keeps the snapshot's values through
    later stages and holds its set (a later stage uses the other one) until dropped."""
    sd = _sd(1.0)
    async with Stager(max_buffer_sets=2) as stager:
        async with stager.snapshot(sd) as staged:
            w = staged["model"]["w"]
            kept: Any
            if keep == "tensor":
                kept = w
            elif keep == "nested-dict":
                kept = staged["model"]
            elif keep == "view":
                kept = w[3:5, 1:]
            elif keep == "numpy":
                kept = w.numpy()
            elif keep == "storage":
                kept = w.untyped_storage()
            elif keep == "dlpack":
                kept = torch.utils.dlpack.to_dlpack(w)
            else:
                for _name, kept in staged["model"].items():  # noqa: B007 - kept after the loop
                    pass
            del w
        assert staged == {}
        for step in (2.0, 3.0, 4.0):
            _set_step(sd, step)
            later = await stager.stage(sd)
            _assert_step(later, step)
            assert stager.stats is not None and stager.stats.buffer_set == 1
            del later
        # The kept reference still sees exactly the snapshot.
        if keep == "tensor":
            assert torch.equal(kept, torch.full((64, 64), 1.0))
        elif keep == "nested-dict":
            assert torch.equal(kept["w"], torch.full((64, 64), 1.0))
            assert torch.equal(kept["b"], torch.full((64,), 1.0))
        elif keep == "view":
            assert torch.equal(kept, torch.full((2, 63), 1.0))
        elif keep == "numpy":
            assert (kept == 1.0).all()
        elif keep == "storage":
            assert torch.equal(torch.empty(0).set_(kept), torch.full((64 * 64,), 1.0))
        elif keep == "dlpack":
            assert torch.equal(torch.from_dlpack(kept), torch.full((64, 64), 1.0))
        else:
            assert torch.equal(kept, torch.full((64,), 1.0))  # the last item: "b"
        del kept
        # Dropped: both sets are free, no third is made.
        for step in (5.0, 6.0):
            _set_step(sd, step)
            async with stager.snapshot(sd) as staged:
                _assert_step(staged, step)
        assert stager.buffer_sets == 2


async def test_a_kept_tensor_with_one_set_waits_then_errors(anyio_backend: Any) -> None:
    sd = _sd(1.0)
    async with Stager(max_buffer_sets=1, buffer_wait_timeout=0.3) as stager:
        async with stager.snapshot(sd) as staged:
            w = staged["model"]["w"]
        with pytest.raises(BuffersHeldError, match="released lease"):
            await stager.stage(sd)
        assert torch.equal(w, torch.full((64, 64), 1.0))
        del w
        _set_step(sd, 2.0)
        again = await stager.stage(sd)
        _assert_step(again, 2.0)


async def test_top_levels_that_are_emptied_and_those_that_are_not(anyio_backend: Any) -> None:
    """Dicts, lists and sets are cleared, also inside a top-level tuple or namedtuple;
    a tensor (or a tuple of tensors) cannot be emptied and holds its set while
    reachable, as a plain result does."""

    class Pair(NamedTuple):
        model: dict[str, torch.Tensor]
        extra: list[torch.Tensor]

    async with Stager(max_buffer_sets=2) as stager:
        od = collections.OrderedDict(w=torch.ones(4))
        async with stager.snapshot(od) as staged_od:
            assert type(staged_od) is collections.OrderedDict
        assert staged_od == collections.OrderedDict()

        async with stager.snapshot([torch.ones(4), {"x": torch.ones(2)}]) as staged_list:
            pass
        assert staged_list == []

        async with stager.snapshot(({"w": torch.ones(4)}, [torch.ones(2)], 3)) as staged_tuple:
            pass
        assert staged_tuple == ({}, [], 3)

        async with stager.snapshot(Pair({"w": torch.ones(4)}, [torch.ones(2)])) as staged_pair:
            pass
        assert staged_pair == Pair({}, [])
        assert stager.buffer_sets == 1

        source = torch.arange(8.0)
        async with stager.snapshot(source) as staged_t:
            pass
        # Not emptied: still the snapshot, and holding set 0.
        source.add_(100.0)
        later = await stager.stage({"w": torch.ones(4)})
        assert stager.stats is not None and stager.stats.buffer_set == 1
        assert torch.equal(staged_t, torch.arange(8.0))
        del later, staged_t


async def test_the_source_is_never_emptied(anyio_backend: Any) -> None:
    """Release empties the stager's copy only: the source's containers are untouched."""
    sd = _sd(1.0)
    inner = sd["optim"]["param_groups"]
    async with Stager() as stager:
        async with stager.snapshot((sd, inner)) as staged:
            assert staged[1] is not inner
        assert staged == ({}, [])
    assert sd["optim"]["param_groups"] is inner and inner == [{"lr": 0.1}]
    _assert_step(sd, 1.0)


async def test_use_after_release_through_the_lease_raises(anyio_backend: Any) -> None:
    async with Stager() as stager:
        lease = await stager.lease({"w": torch.ones(4)})
        async with lease as staged:
            assert torch.equal(staged["w"], torch.ones(4))
        assert lease.released and staged == {}
        with pytest.raises(StagingError, match="released"):
            _ = lease.state_dict


async def test_an_error_inside_the_block_still_frees_the_set(anyio_backend: Any) -> None:
    """The traceback's frames keep ``staged``: the set is free all the same."""
    sd = _sd(1.0)
    async with Stager(max_buffer_sets=1, buffer_wait_timeout=5) as stager:
        with pytest.raises(ZeroDivisionError) as info:
            async with stager.snapshot(sd) as staged:
                staged["self"] = staged  # a cycle too: no garbage collection needed
                _ = 1 / 0
        _set_step(sd, 2.0)
        with anyio.fail_after(4):
            again = await stager.stage(sd)
        _assert_step(again, 2.0)
        assert staged == {}
        del info


async def test_a_lease_collected_unreleased_empties_nothing(anyio_backend: Any) -> None:
    """Garbage collection is not the consumer saying "done": the copy taken from the
    lease stays whole and protected while reachable."""
    sd = _sd(1.0)
    async with Stager(max_buffer_sets=1, buffer_wait_timeout=0.3) as stager:
        lease = await stager.lease(sd)
        staged = lease.state_dict
        del lease
        gc.collect()
        with pytest.raises(BuffersHeldError, match="still reachable"):
            await stager.stage(sd)
        _assert_step(staged, 1.0)
        del staged
        _set_step(sd, 2.0)
        again = await stager.stage(sd)
        _assert_step(again, 2.0)


async def test_plain_results_keep_the_reachability_rule(anyio_backend: Any) -> None:
    sd = _sd(1.0)
    async with Stager(max_buffer_sets=2) as stager:
        first = await stager.stage(sd)
        _set_step(sd, 2.0)
        second = await stager.stage(sd)
        assert stager.buffer_sets == 2
        _assert_step(first, 1.0)
        _assert_step(second, 2.0)


# -- release: twice, from another thread, while a stage waits -------------------------


async def test_release_twice_gives_back_once(anyio_backend: Any) -> None:
    """A second release of one lease must not end another lease's hold."""
    sd = _sd(1.0)
    async with Stager(max_buffer_sets=1, buffer_wait_timeout=0.3) as stager:
        first = await stager.lease(sd)
        first.release()
        first.release()
        second = await stager.lease(sd)
        first.release()
        with pytest.raises(StagingError, match="released"):
            async with first:  # entering a released lease is a use after release
                pass
        with pytest.raises(BuffersHeldError, match="lease"):
            await stager.stage(sd)
        _assert_step(second.state_dict, 1.0)
        second.release()
        second.release()
        again = await stager.stage(sd)
        _assert_step(again, 1.0)


async def test_release_from_other_threads(anyio_backend: Any) -> None:
    sd = _sd(1.0)
    async with Stager(max_buffer_sets=1, buffer_wait_timeout=5) as stager:
        for step in range(3):
            _set_step(sd, float(step))
            lease = await stager.lease(sd)
            staged = lease.state_dict
            _assert_step(staged, float(step))
            threads = [threading.Thread(target=lease.release) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert lease.released and staged == {}
        with anyio.fail_after(4):
            again = await stager.stage(sd)
        _assert_step(again, 2.0)
        assert stager.buffer_sets == 1


@pytest.mark.parametrize("how", ["block-exit", "release", "thread"])
async def test_release_wakes_a_waiting_stage(anyio_backend: Any, how: str) -> None:
    """A stage waiting for the only set goes ahead when the lease is released, while
    ``staged`` is still bound, well before its wait would time out."""
    sd = _sd(1.0)
    done: list[float] = []
    async with Stager(max_buffer_sets=1, buffer_wait_timeout=30) as stager:

        async def later() -> None:
            staged = await stager.stage(sd)
            done.append(time.monotonic())
            _assert_step(staged, 2.0)

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                lease = await stager.lease(sd)
                async with lease as staged:
                    _set_step(sd, 2.0)
                    tg.start_soon(later)
                    await anyio.sleep(0.3)  # the stage is waiting for the set now
                    assert not done
                    _assert_step(staged, 1.0)  # the lease protects meanwhile
                    released = time.monotonic()
                    if how == "release":
                        lease.release()
                    elif how == "thread":
                        t = threading.Thread(target=lease.release)
                        t.start()
                        t.join()
        assert staged == {}
        assert done and done[0] >= released


# -- trim ---------------------------------------------------------------------------


async def test_trim_returns_the_memory_of_free_sets(anyio_backend: Any) -> None:
    """With the sources alive (a model's storages live all run) and every result
    dropped or released, trim returns every arena: host bytes and pins go to zero."""
    pinner = FakePinner()
    sd = _sd(1.0)
    async with Stager(backend=FakeBackend(), pinner=pinner) as stager:
        staged = await stager.stage(sd)
        _assert_step(staged, 1.0)
        del staged
        async with stager.snapshot(sd) as snap:
            _assert_step(snap, 1.0)
        held = stager.host_bytes
        assert held > 0 and pinner.registered
        released = await stager.trim()
        assert released == held
        assert stager.host_bytes == 0 and pinner.registered == {}
        assert await stager.trim() == 0
        # The next stage is a first stage again, and right.
        _set_step(sd, 2.0)
        again = await stager.stage(sd)
        _assert_step(again, 2.0)
        assert stager.stats is not None and not stager.stats.fast_path
        assert stager.stats.host_bytes == stager.host_bytes == held


@pytest.mark.parametrize("hold", ["result", "lease", "taken-out"])
async def test_trim_never_trims_a_held_result(anyio_backend: Any, hold: str) -> None:
    pinner = FakePinner()
    sd = _sd(1.0)
    async with Stager(backend=FakeBackend(), pinner=pinner, max_buffer_sets=2) as stager:
        kept: Any
        if hold == "result":
            kept = await stager.stage(sd)
        elif hold == "lease":
            kept = await stager.lease(sd)
        else:
            async with stager.snapshot(sd) as staged:
                kept = staged["model"]["w"]
            assert staged == {}
        one_set = stager.host_bytes
        # A second set, then freed: the only one trim may return.
        _set_step(sd, 2.0)
        other = await stager.stage(sd)
        assert stager.stats is not None and stager.stats.buffer_set == 1
        del other
        assert stager.host_bytes == 2 * one_set
        assert await stager.trim() == one_set
        assert stager.host_bytes == one_set
        assert await stager.trim() == 0
        for step in (3.0, 4.0):
            _set_step(sd, step)
            later = await stager.stage(sd)
            _assert_step(later, step)
            del later
        if hold == "result":
            _assert_step(kept, 1.0)
        elif hold == "lease":
            _assert_step(kept.state_dict, 1.0)
            kept.release()
        else:
            assert torch.equal(kept, torch.full((64, 64), 1.0))
        del kept
        # Nothing is held now: everything goes.
        before = stager.host_bytes
        assert before > 0
        assert await stager.trim() == before
        assert stager.host_bytes == 0 and pinner.registered == {}
