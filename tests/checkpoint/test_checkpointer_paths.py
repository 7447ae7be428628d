"""The Checkpointer's less walked paths (issue 36, section 1; issue 35, finding 1),
through the public API: a folder whose steps were written in two formats, a reader
process beside a writer process, budgeted and coalesced writes while the training loop
never yields, leaving the block after ``final_checkpoint`` missed its deadline, a save
coroutine dropped before its node-budget admission, and deferred saves whose snapshot
point is the call (on the caller's current stream) whenever they stage."""

from __future__ import annotations

import functools
import gc
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from async_stager import Checkpointer, IntegrityError, Shutdown, Stager
from async_stager.testing import FakeBackend, FakeStream

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).resolve().parent / "paths_child.py"
MiB = 2**20


def full(value: float, n: int = 1024) -> torch.Tensor:
    return torch.full((n,), float(value))


# -- a write held open ------------------------------------------------------------------

_HELD: dict[int, threading.Event] = {}


class Held:
    """A value whose write waits until ``_HELD[key]`` is set: staging copies it through
    the pickle protocol (a marked copy), the write pickles that copy, which waits, then
    stores a plain int. A user value, not a double of the library."""

    def __init__(self, key: int, copy: bool = False) -> None:
        self.key, self.copy = key, copy

    def __reduce_ex__(self, protocol: Any) -> Any:
        if not self.copy:
            return (Held, (self.key, True))
        if not _HELD[self.key].wait(60):
            raise TimeoutError("never released")
        return (int, (self.key,))


def held(key: int) -> tuple[Held, threading.Event]:
    ev = _HELD[key] = threading.Event()
    return Held(key), ev


def blocking_wait(cond: Any, seconds: float) -> bool:
    """Poll ``cond()`` for up to ``seconds`` WITHOUT yielding to the event loop: a
    training step's compute, as a loop that never yields does."""
    deadline = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


# -- 1. a folder written in two formats -------------------------------------------------


@pytest.mark.parametrize(("first", "second"), [("torch", "dcp"), ("dcp", "torch")])
async def test_restore_reads_each_step_in_the_format_it_was_written_in(
    tmp_path: Path, first: Any, second: Any
) -> None:
    """A job that switched formats: the newer step is not damaged, and restore never
    falls back past it (nor raises IntegrityError with fallback=False)."""
    async with Checkpointer(tmp_path, format=first, keep=3) as ckpt:
        await ckpt.save({"t": full(1), "n": 1}, step=1)
        await ckpt.wait()
    async with Checkpointer(tmp_path, format=second, keep=3) as ckpt:
        await ckpt.save({"t": full(2), "n": 2}, step=2)
        await ckpt.wait()
    for opened in (first, second):
        async with Checkpointer(tmp_path, format=opened, keep=3) as ckpt:
            assert ckpt.steps() == [1, 2]
            out: dict[str, Any] = {"t": full(0), "n": 0}
            assert await ckpt.restore(out, fallback=False) == 2
            assert torch.equal(out["t"], full(2)) and out["n"] == 2
            out = {"t": full(0), "n": 0}
            assert await ckpt.restore(out) == 2
            assert torch.equal(out["t"], full(2))
            out = {"t": full(0), "n": 0}
            assert await ckpt.restore(out, step=1) == 1
            assert torch.equal(out["t"], full(1)) and out["n"] == 1


async def test_a_damaged_step_of_the_other_format_is_still_named_damaged(tmp_path: Path) -> None:
    """Reading each step in its own format does not hide damage: a flipped byte of the
    newer (DCP) step is an IntegrityError when the folder is opened as torch."""
    async with Checkpointer(tmp_path, format="torch", keep=3) as ckpt:
        await ckpt.save({"t": full(1)}, step=1)
        await ckpt.wait()
    async with Checkpointer(tmp_path, format="dcp", keep=3) as ckpt:
        await ckpt.save({"t": full(2)}, step=2)
        await ckpt.wait()
    data = next((tmp_path / "step-00000002").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    async with Checkpointer(tmp_path, format="torch") as ckpt:
        with pytest.raises(IntegrityError):
            await ckpt.restore({"t": full(0)}, fallback=False)
        out = {"t": full(0)}
        assert await ckpt.restore(out) == 1 and torch.equal(out["t"], full(1))


# -- 2. a reader process beside a writer process ----------------------------------------


def _child(*args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, str(CHILD), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("steps", "fmt"),
    # One pair in the default run; the other three (two processes each, saving and
    # restoring as fast as they can) in CI's second call.
    [
        ("new", "torch"),
        pytest.param("same", "dcp", marks=pytest.mark.slow),
        pytest.param("new", "dcp", marks=pytest.mark.slow),
        pytest.param("same", "torch", marks=pytest.mark.slow),
    ],
)
def test_a_reader_process_beside_a_writer_process_restores_only_whole_steps(
    tmp_path: Path, fmt: str, steps: str
) -> None:
    """A trainer saves with keep=1 (new steps, or one step over and over) while an
    evaluation process restores again and again: every restore returns a step whose
    values are that save's, none raises (retention and replacement wait for the
    reader's hold)."""
    folder = tmp_path / "ckpt"
    stop = tmp_path / "stop"
    writer = _child("writer", str(folder), fmt, steps, str(stop))
    try:
        # The first commit, then the reader.
        deadline = time.monotonic() + 60
        while not (folder / "latest").exists() and time.monotonic() < deadline and writer.poll() is None:
            time.sleep(0.01)
        reader = _child("reader", str(folder), fmt, "6")
        out, err = reader.communicate(timeout=120)
    finally:
        stop.touch()
        w_out, w_err = writer.communicate(timeout=120)
    assert writer.returncode == 0, w_err[-3000:]
    assert reader.returncode == 0, err[-3000:]
    got = json.loads(out.strip().splitlines()[-1])
    wrote = json.loads(w_out.strip().splitlines()[-1])
    assert got["errors"] == [], (
        f"{len(got['errors'])} of {got['restores']} restores failed: {got['errors'][:3]}"
    )
    assert got["restores"] >= 5 and wrote["commits"] >= 5, (got, wrote)


# -- 3. writes that need no turn of the loop --------------------------------------------


def _big(value: float) -> dict[str, Any]:
    return {f"w{i}": torch.full((MiB // 4,), value) for i in range(4)}


@pytest.mark.parametrize("how", ["host_budget", "node_budget_streamed"])
async def test_a_budgeted_save_commits_while_the_loop_never_yields(tmp_path: Path, how: str) -> None:
    opts: dict[str, Any] = (
        {"host_budget_bytes": MiB + 4096}
        if how == "host_budget"
        # A node budget too small for a staged copy: the save streams.
        else {"node_budget_bytes": 2 * MiB, "node_budget_path": str(tmp_path / "ledger")}
    )
    sd = _big(1.0)
    async with Checkpointer(tmp_path / "ckpt", **opts) as ckpt:
        assert await ckpt.save(sd, step=1)
        for t in sd.values():
            t.fill_(-1.0)  # after save returned: never in the checkpoint
        # Training compute, no await: the write goes on in its thread and commits.
        committed = blocking_wait(lambda: ckpt.steps() == [1], 20)
        assert committed, f"nothing committed while the loop did not yield: {ckpt.in_flight()}"
        await ckpt.wait()
        if how == "node_budget_streamed":
            assert ckpt.last is not None and ckpt.last.admission == "streamed"
        out = _big(0.0)
        assert await ckpt.restore(out) == 1
        assert all(torch.equal(t, torch.full((MiB // 4,), 1.0)) for t in out.values())


@pytest.mark.parametrize("fmt", ["dcp", "torch"])
async def test_plain_saves_commit_while_the_loop_never_yields(tmp_path: Path, fmt: Any) -> None:
    """The unbudgeted path, both formats (the reference the budgeted one must match)."""
    async with Checkpointer(tmp_path, format=fmt) as ckpt:
        assert await ckpt.save(_big(1.0), step=1)
        assert blocking_wait(lambda: ckpt.steps() == [1], 20), ckpt.in_flight()
        await ckpt.wait()


@pytest.mark.parametrize("fmt", ["dcp", "torch"])
async def test_coalesce_writes_the_queued_save_when_the_write_ends_without_the_loop(
    tmp_path: Path, fmt: Any
) -> None:
    gate, release = held(1)
    with torch.serialization.safe_globals([Held]):  # the torch format takes it at save
        async with Checkpointer(tmp_path, format=fmt, policy="coalesce", keep=3) as ckpt:
            assert await ckpt.save({"t": full(1), "g": gate}, step=1)  # its write waits
            assert await ckpt.save({"t": full(2)}, step=2)  # queued behind it
            assert [p.phase for p in ckpt.in_flight()] == ["writing", "queued"]
            release.set()
            # No await from here: write 1 ends in its thread, and save 2 must follow.
            committed = blocking_wait(lambda: ckpt.steps() == [1, 2], 20)
            assert committed, f"steps {ckpt.steps()}, in flight {ckpt.in_flight()}"
            await ckpt.wait()


# -- 4. leaving after a missed deadline -------------------------------------------------


class Slow:
    """A value whose pickling waits until ``_HELD[key]`` is set, whoever pickles it (a
    budgeted save's pipeline serializes the original)."""

    def __init__(self, key: int) -> None:
        self.key = key

    def __reduce_ex__(self, protocol: Any) -> Any:
        if not _HELD[self.key].wait(60):
            raise TimeoutError("never released")
        return (int, (self.key,))


@pytest.mark.parametrize("how", ["staged", "budgeted"])
async def test_leaving_after_a_missed_final_checkpoint_is_prompt(tmp_path: Path, how: str) -> None:
    """``async with Checkpointer(...), Shutdown()``: final_checkpoint misses its deadline
    behind a slow write; leaving the block then does not wait for that write, and the
    abandoned write commits nothing (even when it ends while the process lives on)."""
    key = 2 if how == "staged" else 4
    gate, release = held(key)
    slow: Any = gate if how == "staged" else Slow(key)
    opts: dict[str, Any] = {"host_budget_bytes": 1 << 16} if how == "budgeted" else {}
    try:
        async with Checkpointer(tmp_path, **opts) as ckpt, Shutdown() as stop:
            with anyio.fail_after(20):
                saving = ckpt.save({"t": full(1), "g": slow}, step=1)  # a slow write
                if how == "staged":
                    await saving
                else:  # it returns only once its pipeline has serialized everything
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(lambda: saving)
                        await anyio.sleep(0.3)
                        tg.cancel_scope.cancel()  # nothing is saved for it
                code = await stop.final_checkpoint(ckpt, {"t": full(2)}, step=2, deadline=0.5)
            assert code == 1
            t0 = time.monotonic()
        left = time.monotonic() - t0
        # A hang guard: a block that waited for the abandoned write would take its 60 s.
        assert left < 30, f"leaving the block took {left:.1f} s (the abandoned write's)"
        assert ckpt.steps() == []
    finally:
        release.set()
    # The abandoned write's thread goes on until it ends; it commits nothing.
    await anyio.sleep(0.5)
    assert Checkpointer(tmp_path).steps() == []


# -- 5. node budget: a save dropped before its admission --------------------------------


@pytest.mark.parametrize("how", ["closed", "cancelled"])
async def test_a_node_budget_save_dropped_before_its_admission_is_just_not_saved(
    tmp_path: Path, how: str
) -> None:
    opts: dict[str, Any] = {"node_budget_bytes": 64 * MiB, "node_budget_path": str(tmp_path / "ledger")}
    async with Checkpointer(tmp_path / "ckpt", **opts) as ckpt:
        if how == "closed":
            coro = ckpt.save({"t": full(1)}, step=1)
            coro.close()  # a forgotten await: the coroutine dies unawaited
            del coro
            gc.collect()
        else:
            with anyio.CancelScope() as scope:
                scope.cancel()
                await ckpt.save({"t": full(1)}, step=1)
        await anyio.sleep(0.3)  # its admission task runs, and must find it gone
        assert await ckpt.save({"t": full(2)}, step=2)
        await ckpt.wait()
        assert ckpt.steps() == [2]
        out = {"t": full(0)}
        assert await ckpt.restore(out) == 2 and torch.equal(out["t"], full(2))


async def test_a_save_coroutine_that_dies_in_another_thread_is_just_not_saved(tmp_path: Path) -> None:
    """Sibling of the dropped save: a coroutine collected in a worker thread (the cyclic
    collector runs wherever it runs) must not touch the loop's tasks from there."""
    gate, release = held(5)
    async with Checkpointer(tmp_path, keep=5) as ckpt, anyio.create_task_group() as tg:
        await ckpt.save({"t": full(1), "g": gate}, step=1)  # writing, held
        tg.start_soon(functools.partial(ckpt.save, {"t": full(2)}, step=2))  # staged, queued
        await anyio.sleep(0.2)
        box = [ckpt.save({"t": full(3)}, step=3)]  # deferred: no buffer set is free

        def drop() -> None:
            coro = box.pop()
            coro.close()
            del coro  # dies here, in a worker thread

        await anyio.to_thread.run_sync(drop)
        release.set()
        await ckpt.wait()
        assert ckpt.steps() == [1, 2]
        assert await ckpt.save({"t": full(4)}, step=4)
        await ckpt.wait()
        assert ckpt.steps() == [1, 2, 4]


# -- issue 35, finding 1: a deferred save's snapshot point is its call -------------------


async def test_a_deferred_save_captures_on_the_callers_stream_at_the_call(tmp_path: Path) -> None:
    """``"wait"`` with a staged save already queued: the third save waits for a buffer
    set. Its capture is taken at the call, on the caller's current (side) stream: work
    queued there before the call is in the checkpoint, work queued after it is not; and
    a ``fence()`` called there orders that stream after the save's copies."""
    backend = FakeBackend(delay=0.01)  # the CPU as a fake accelerator
    side = FakeStream("side")
    cpu = torch.device("cpu")
    gate, release = held(3)
    t = full(0)
    async with (
        Stager(backend=backend, max_buffer_sets=2) as stager,
        Checkpointer(tmp_path, stager=stager, keep=5) as ckpt,
        anyio.create_task_group() as tg,
    ):
        await ckpt.save({"t": full(1), "g": gate}, step=1)  # writing, held
        tg.start_soon(functools.partial(ckpt.save, {"t": full(2)}, step=2))  # staged, waits for the slot
        await anyio.sleep(0.2)
        assert [p.phase for p in ckpt.in_flight()] == ["writing", "queued"]
        before = backend.captures
        with backend.use_stream(cpu, side):
            side.enqueue(lambda: t.fill_(3.0))  # a producer kernel, not run yet
            third = ckpt.save({"t": t}, step=3)  # deferred: no buffer set is free
            assert backend.captures == before + 1, "no capture at the call"
            side.enqueue(lambda: t.fill_(9.0))  # after the call: not in step 3
            fence = ckpt.fence()  # its streams read now: the side stream

        async def run() -> None:
            await third

        tg.start_soon(run)
        release.set()
        await fence
        assert side in backend.fence_points, f"the fence ordered {backend.fence_points}, not the side stream"
        await ckpt.wait()
        side.run()
        out = {"t": full(0)}
        assert await ckpt.restore(out, step=3) == 3
        assert torch.equal(out["t"], full(3)), f"step 3 holds {out['t'][0].item()}, not the value at the call"
