"""What a service sees of a Checkpointer and asks of it (issue 24): the in-flight view
(``in_flight()``) and saves requested from another task (``request_save()``), taken by
the training loop at its step boundary (``save_if_requested``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from async_stager import Checkpointer, CheckpointError, ClosedError, SaveRequest
from async_stager.errors import StagingError

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


class _FailsWhenWritten:
    def __reduce_ex__(self, protocol: Any) -> Any:
        raise OSError(28, "No space left on device (injected)")


class _Fails:
    """Stages (its copy is a ``_FailsWhenWritten``), fails to write."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (_FailsWhenWritten, ())


async def test_a_save_requested_from_another_task_is_taken_at_the_step_boundary(tmp_path: Path) -> None:
    state: dict[str, Any] = {"w": torch.zeros(64), "step": 0}
    answered: list[Any] = []
    async with Checkpointer(tmp_path, format="dcp") as ckpt:

        async def handler() -> None:  # a request handler: never touches the state
            request = ckpt.request_save()
            assert ckpt.request_save() is request  # not yet taken: the same request
            answered.append(await request.wait())

        async with anyio.create_task_group() as tg:
            tg.start_soon(handler)
            for step in range(1, 50):
                state["w"].add_(1.0)
                state["step"] = step
                if await ckpt.save_if_requested(state, step=step):
                    break
                await anyio.sleep(0.001)
        await ckpt.wait()
        (stats,) = answered
        assert stats is not None and stats.step == step and ckpt.steps() == [step]
        assert not ckpt.save_requested
        out: dict[str, Any] = {"w": torch.zeros(64), "step": -1}
        assert await ckpt.restore(out) == step
        assert out["step"] == step and torch.equal(out["w"], torch.full((64,), float(step)))


async def test_without_a_request_nothing_is_saved(tmp_path: Path) -> None:
    async with Checkpointer(tmp_path) as ckpt:
        assert await ckpt.save_if_requested({"w": torch.ones(2)}, step=1) is False
        await ckpt.wait()
        assert ckpt.steps() == [] and ckpt.in_flight() == []


async def test_in_flight_shows_each_save_until_it_ends(tmp_path: Path) -> None:
    async with Checkpointer(tmp_path, max_in_flight=2) as ckpt:
        await ckpt.save({"w": torch.ones(1 << 16)}, step=1)
        await ckpt.save({"w": torch.ones(1 << 16)}, step=2)
        seen = ckpt.in_flight()
        # Commits are in call order, so step 2 ends after step 1: what is still in flight
        # is both, step 2 alone (step 1 committed first), or neither.
        assert [p.step for p in seen] in ([1, 2], [2], [])
        for p in seen:
            assert p.phase in ("deferred", "staging", "queued", "writing", "committing") and p.seconds >= 0
        await ckpt.wait()
        assert ckpt.in_flight() == [] and ckpt.steps() == [1, 2]


async def test_a_request_never_taken_is_answered_at_the_close(tmp_path: Path) -> None:
    async with Checkpointer(tmp_path) as ckpt:
        request = ckpt.request_save()
    assert request.done and request.step is None
    assert await request.wait() is None
    with pytest.raises(ClosedError):
        ckpt.request_save()


async def test_a_skipped_request_is_answered_with_none(tmp_path: Path) -> None:
    async with Checkpointer(tmp_path, policy="skip") as ckpt:
        await ckpt.save({"w": torch.ones(1 << 18)}, step=1)
        request = ckpt.request_save()
        accepted = await ckpt.save_if_requested({"w": torch.ones(1 << 18)}, step=2)
        await ckpt.wait()
        result = await request.wait()
        if accepted:  # the first write had ended already: it was saved
            assert result is not None and result.step == 2
        else:
            assert result is None and 2 in ckpt.dropped


async def test_a_failed_requested_save_raises_in_its_request(tmp_path: Path) -> None:
    async with Checkpointer(tmp_path, format="dcp") as ckpt:
        request: SaveRequest = ckpt.request_save()
        assert await ckpt.save_if_requested({"w": torch.ones(4), "bad": _Fails()}, step=3)
        with pytest.raises(CheckpointError, match="No space left"):
            await request.wait()
        with pytest.raises(CheckpointError):  # raised by the Checkpointer too, as always
            await ckpt.wait()


async def test_a_bad_step_answers_the_request_with_its_error(tmp_path: Path) -> None:
    async with Checkpointer(tmp_path) as ckpt:
        request = ckpt.request_save()
        with pytest.raises(StagingError):
            await ckpt.save_if_requested({"w": torch.ones(4)}, step=-1)
        with pytest.raises(StagingError):
            await request.wait()


def _busy(seconds: float) -> None:
    """A training step's compute: blocks the loop's thread, never yields to the loop,
    and (as torch's kernels do) releases the GIL while it runs."""
    import time

    time.sleep(seconds)


async def test_writes_go_on_in_a_loop_that_yields_only_at_fence_and_save(tmp_path: Path) -> None:
    """The recipe's loop exactly as written (``await ckpt.fence()`` each step, ``await
    ckpt.save(...)`` every N steps, no other await): each write completes during the
    steps after its save, so the next save finds nothing in flight (before: the writes
    moved only inside the next ``save()``, which then waited for a whole write)."""
    state = {"w": torch.randn(1 << 18)}
    idle = 0
    async with Checkpointer(tmp_path, format="torch") as ckpt:
        for step in range(1, 201):
            _busy(0.005)
            await ckpt.fence()
            if step % 50 == 0:
                idle += not ckpt.in_flight()
                await ckpt.save(state, step=step)
        await ckpt.wait()
        assert ckpt.steps()[-1] == 200
    assert idle >= 3, f"only {idle} of 4 saves found the previous write done"


@pytest.mark.parametrize("fmt", ["dcp", "torch"])
async def test_a_write_commits_while_the_loop_never_yields(tmp_path: Path, fmt: Any) -> None:
    """Issue 24: the write, checksum, commit and retention of a save run in a thread of
    their own. A loop with no await at all between two saves (blocking steps) still
    finds the previous save committed on disk at the next save, and the write's wall
    time is a fraction of the loop's time between the saves."""
    import time

    state = {"w": torch.randn(1 << 16), "step": 0}
    found: list[int] = []
    async with Checkpointer(tmp_path, format=fmt, keep=2) as ckpt:
        for step in (1, 2, 3):
            state["step"] = step
            await ckpt.save(state, step=step)
            t0 = time.monotonic()
            deadline = t0 + 20.0
            # The training steps: no await, the loop gets no turn. The committed step
            # appears on disk anyway (the commit ran in the write's thread).
            while step not in ckpt.steps() and time.monotonic() < deadline:
                _busy(0.01)
            found.append(step if step in ckpt.steps() else -1)
        await ckpt.wait()
        stats = ckpt.last
    assert found == [1, 2, 3], found
    assert stats is not None and stats.step == 3 and ckpt.steps() == [2, 3]


async def test_a_long_save_logs_its_progress_at_a_bounded_rate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A save still writing after each PROGRESS_SECONDS logs one INFO record, then its
    outcome once; a short save logs nothing."""
    import time

    from async_stager._checkpoint import formats as write_mod, progress as module

    # A short save is one that ends within PROGRESS_SECONDS: an hour, so that a loaded
    # machine cannot make it long (0.05 s was a speed check: it failed under load).
    monkeypatch.setattr(module, "PROGRESS_SECONDS", 3600.0)
    caplog.set_level("INFO", logger="async_stager.checkpoint")
    async with Checkpointer(tmp_path, format="torch") as ckpt:
        await ckpt.save({"w": torch.ones(4)}, step=1)
        await ckpt.wait()
        assert not [r for r in caplog.records if "checkpoint step 1:" in r.getMessage()]
        monkeypatch.setattr(module, "PROGRESS_SECONDS", 0.05)
        real = getattr(write_mod, "torch_write")  # noqa: B009 - patched where the writer calls it

        def slow_write(staged: Any, path: Any) -> Any:  # a slow disk
            time.sleep(0.3)
            return real(staged, path)

        monkeypatch.setattr(write_mod, "torch_write", slow_write)
        await ckpt.save({"w": torch.ones(4)}, step=2)
        await ckpt.wait()
    lines = [r.getMessage() for r in caplog.records if "checkpoint step 2:" in r.getMessage()]
    writing = [m for m in lines if "writing for" in m]
    assert 1 <= len(writing) <= 8, lines  # bounded: about one per 0.05 s of 0.3 s
    assert lines[-1].startswith("checkpoint step 2: committed after"), lines
