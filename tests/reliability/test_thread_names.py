"""Every thread the library starts is the library's to its exit hook and leak checks.

The hook that leaves with the exit status after a missed exit deadline
(``exiting.exit_fast_if_abandoned``) looks for the library's daemon threads still alive
(one inside torch aborts the interpreter's finalization): it matched names starting
``async-stager-``, while the stager's worker was named ``async-stager`` (and a
``DefaultStager``'s is named by its config, as torch's), so the thread most likely to
be inside torch was the one it never saw. Failed before: the worker was not
recognised, and the hook let the process finalize under it.
"""

from __future__ import annotations

import sys
import threading
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import async_stager.dcp as adcp
from async_stager import Checkpointer, CheckpointStagerConfig, DefaultStager, Stager
from async_stager._checkpoint import exiting
from async_stager._core.interp import THREAD_PREFIX, library_thread

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.timeout(120),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]

#: async_stager.testing's simulated device is a test double its test owns and closes.
_DOUBLES = ("async_stager._core.copy.simulated",)


def _started_by_the_library() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith(_DOUBLES):
            return False
        if name == "async_stager" or name.startswith("async_stager."):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _done(staged: Any) -> None:
    """A DefaultStager's stage (its Future when it stages asynchronously) finished."""
    if isinstance(staged, Future):
        staged.result(timeout=60)


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[threading.Thread]:
    """Every thread started from the library's code while the test runs."""
    seen: list[threading.Thread] = []
    real = threading.Thread.start

    def start(self: threading.Thread) -> None:
        if _started_by_the_library():
            seen.append(self)
        real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    return seen


async def test_every_thread_the_library_starts_is_recognised(
    anyio_backend: Any, tmp_path: Path, started: list[threading.Thread]
) -> None:
    state = {"w": torch.randn(1 << 20), "b": torch.ones(3), "step": 1}
    async with Stager(copy_threads=2) as stager:
        staged = await stager.stage(state)
        del staged
        await adcp.save(
            state, stager=stager, checkpoint_id=tmp_path / "budgeted", no_dist=True, host_budget_bytes=1 << 22
        )
    with DefaultStager(CheckpointStagerConfig(use_shared_memory=False, thread_name="ckpt-staging")) as ds:
        _done(ds.stage(state))
    for opts in ({"format": "dcp"}, {"format": "torch"}, {"host_budget_bytes": 1 << 22}):
        name = next(iter(opts.values()))
        async with Checkpointer(tmp_path / f"ck-{name}", **opts) as ckpt:  # type: ignore[arg-type]
            await ckpt.save(state, step=1)
            await ckpt.wait()
            await ckpt.restore(state)
    names = sorted({t.name.rstrip("0123456789_") for t in started})
    assert len(names) >= 5, names  # the worker, copies, writes, commits, the DefaultStager's
    bad = [t.name for t in started if not library_thread(t)]
    assert not bad, f"threads the library started that its exit hook does not see: {bad}"
    odd = [t.name for t in started if not t.name.startswith(THREAD_PREFIX) and t.name != "ckpt-staging"]
    assert not odd, odd


@pytest.mark.parametrize("thread_name", [None, "ckpt-staging"])
def test_the_exit_hook_sees_a_stagers_worker(
    monkeypatch: pytest.MonkeyPatch, thread_name: str | None
) -> None:
    """The hook leaves with the code it was given while a stager's worker (a daemon
    thread that may be inside torch) is alive: the plain Stager's, and a DefaultStager's
    named by its config. Only the process exit is replaced."""
    hooks: list[Any] = []
    exits: list[int] = []
    # The exiting module's own names only: the interpreter's other exit hooks stay.
    monkeypatch.setattr(exiting, "atexit", SimpleNamespace(register=hooks.append))
    monkeypatch.setattr(exiting, "os", SimpleNamespace(_exit=exits.append))
    monkeypatch.setattr(exiting, "_exit_hook", [])
    state = {"w": torch.ones(16)}
    if thread_name is None:
        import anyio

        stager = Stager()

        async def stage() -> None:
            staged = await stager.stage(state)
            del staged

        anyio.run(stage)
        close = stager.close
    else:
        ds = DefaultStager(CheckpointStagerConfig(use_shared_memory=False, thread_name=thread_name))
        _done(ds.stage(state))
        close = ds.close
    try:
        worker = [t for t in threading.enumerate() if t.name == (thread_name or f"{THREAD_PREFIX}worker")]
        assert worker and worker[0].daemon, [t.name for t in threading.enumerate()]
        exiting.exit_fast_if_abandoned(3)
        [hook] = hooks
        hook()
        assert exits == [3]
    finally:
        close()
