"""The manager's edges (issue 41, section 2), through the public API: nested
``Shutdown`` blocks, a failure after the commit point, a folder that can only be read
(read-only, or a disk without a free inode), damaged hold files, and the small
messages (a save from another thread, a NaN deadline, a reader a commit waits for)."""

from __future__ import annotations

import errno
import functools
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from async_stager import Checkpointer, CheckpointError, InvalidOptionError, InvalidOptionTypeError, Shutdown

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


# -- Shutdown blocks inside each other ------------------------------------------------------


def _own_handler() -> tuple[list[int], Any]:
    seen: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
    return seen, previous


async def test_an_outer_shutdown_still_catches_sigterm_after_an_inner_one_left(anyio_backend: Any) -> None:
    seen, previous = _own_handler()
    try:
        handler = signal.getsignal(signal.SIGTERM)
        async with Shutdown() as outer:
            async with Shutdown() as inner:
                pass
            assert not inner.requested
            os.kill(os.getpid(), signal.SIGTERM)
            with anyio.fail_after(10):
                await outer.wait()
            assert outer.signal == signal.SIGTERM
            assert not inner.requested  # it had left
        assert signal.getsignal(signal.SIGTERM) == handler  # the one from before both
        assert seen == []
        os.kill(os.getpid(), signal.SIGTERM)  # reaches it again
        for _ in range(100):
            if seen:
                break
            await anyio.sleep(0.01)
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


async def test_a_signal_an_inner_shutdown_catches_reaches_the_outer_one_too(anyio_backend: Any) -> None:
    seen, previous = _own_handler()
    try:
        async with Shutdown() as outer:
            for _ in range(3):  # an inner block entered again and again (one per epoch)
                async with Shutdown():
                    pass
            async with Shutdown() as inner:
                os.kill(os.getpid(), signal.SIGTERM)
                with anyio.fail_after(10):
                    await inner.wait()
                    await outer.wait()
            assert outer.signal == inner.signal == signal.SIGTERM
        assert seen == []
    finally:
        signal.signal(signal.SIGTERM, previous)


async def test_shutdowns_that_leave_out_of_order_keep_catching(anyio_backend: Any) -> None:
    """Two blocks in sibling tasks: the first opened leaves first; the second still
    catches SIGTERM, and the handler from before both is back after the second."""
    seen, previous = _own_handler()
    try:
        handler = signal.getsignal(signal.SIGTERM)
        first_in, first_out = anyio.Event(), anyio.Event()
        second: list[Shutdown] = []

        async def first() -> None:
            async with Shutdown():
                first_in.set()
                await first_out.wait()

        async def later() -> None:
            await first_in.wait()
            async with Shutdown() as stop:
                second.append(stop)
                first_out.set()
                await anyio.sleep(0.05)  # the first leaves meanwhile
                os.kill(os.getpid(), signal.SIGTERM)
                with anyio.fail_after(10):
                    await stop.wait()

        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
            tg.start_soon(later)
        assert second[0].signal == signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) == handler
        assert seen == []
    finally:
        signal.signal(signal.SIGTERM, previous)


# -- after the commit point ---------------------------------------------------------------


def _hold(root: Path, step: int) -> Path:
    return root / f".hold-step-{step:08d}"


async def test_a_failure_after_the_commit_point_is_a_warning_and_retried(
    anyio_backend: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Retention fails (step 1's hold file is a folder): step 2 is committed and said
    so (``last``, ``saved()``, ``on_saved``), a warning names step 1 and the folder in the
    way, later saves commit and retention keeps working for the other steps; once the
    folder is moved away the next commit retires step 1."""
    seen: list[int] = []
    async with Checkpointer(tmp_path, keep=1, on_saved=lambda s: seen.append(s.step)) as ckpt:
        stream = ckpt.saved()
        await ckpt.save({"w": torch.ones(2)}, step=1)
        await ckpt.wait()
        _hold(tmp_path, 1).unlink()
        _hold(tmp_path, 1).mkdir()
        with caplog.at_level(logging.WARNING, logger="async_stager.checkpoint"):
            await ckpt.save({"w": torch.full((2,), 2.0)}, step=2)
            await ckpt.wait()  # no error: step 2 is committed
        assert ckpt.last is not None and ckpt.last.step == 2 and seen == [1, 2]
        assert [(await stream.__anext__()).step for _ in range(2)] == [1, 2]
        assert ckpt.steps() == [1, 2]
        assert any("step 1 not retired" in r.message and "is a folder" in r.message for r in caplog.records)
        await ckpt.save({"w": torch.full((2,), 3.0)}, step=3)
        await ckpt.wait()
        assert ckpt.steps() == [1, 3] and seen == [1, 2, 3]  # step 2 retired: keep works
        w = torch.zeros(2)
        assert await ckpt.restore({"w": w}) == 3 and w.tolist() == [3.0, 3.0]
        _hold(tmp_path, 1).rmdir()
        await ckpt.save({"w": torch.full((2,), 4.0)}, step=4)
        await ckpt.wait()
        assert ckpt.steps() == [4]


async def test_a_failed_commit_removes_its_hold_file(
    anyio_backend: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    """The commit's rename fails (the disk, at the lowest layer): nothing committed,
    and no ``.hold-step-N`` left behind until the next open."""
    real_rename = os.rename

    def rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if os.fspath(dst).endswith("step-00000002") and ".tmp-" in os.fspath(src):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_rename(src, dst, *args, **kwargs)

    async with Checkpointer(tmp_path) as ckpt:
        await ckpt.save({"w": torch.ones(2)}, step=1)
        await ckpt.wait()
        monkeypatch.setattr(os, "rename", rename)
        await ckpt.save({"w": torch.ones(2)}, step=2)
        with pytest.raises(CheckpointError, match="step 2 was not committed"):
            await ckpt.wait()
        assert ckpt.steps() == [1]
        assert not _hold(tmp_path, 2).exists()
        assert _hold(tmp_path, 1).exists()  # a committed step keeps its own
        monkeypatch.setattr(os, "rename", real_rename)
        await ckpt.save({"w": torch.ones(2)}, step=2)
        await ckpt.wait()
        assert ckpt.steps() == [1, 2]


@pytest.mark.parametrize("damage", ["folder", "broken link"])
async def test_a_damaged_hold_file_is_a_clear_error(anyio_backend: Any, tmp_path: Path, damage: str) -> None:
    """A hold path that is a folder or a broken link: ``restore(step=N)`` raises a
    CheckpointError naming it and what to do (not a raw OSError); a commit of that
    step says so too; the folder still opens and restores other steps."""
    async with Checkpointer(tmp_path) as ckpt:
        await ckpt.save({"w": torch.ones(2)}, step=1)
        await ckpt.save({"w": torch.full((2,), 2.0)}, step=2)
        await ckpt.wait()
    hold = _hold(tmp_path, 1)
    hold.unlink()
    if damage == "folder":
        hold.mkdir()
        what = "is a folder, where a lock file belongs: move it away"
    else:
        hold.symlink_to(tmp_path / "gone" / "hold")
        what = "is a symbolic link to"
    async with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(CheckpointError, match="step 1 cannot be held for reading") as info:
            await ckpt.restore({"w": torch.zeros(2)}, step=1)
        assert what in str(info.value) and str(hold) in str(info.value)
        assert info.value.step == 1
        w = torch.zeros(2)
        assert await ckpt.restore({"w": w}) == 2 and w.tolist() == [2.0, 2.0]
        await ckpt.save({"w": torch.ones(2)}, step=1)  # replacing step 1 needs its hold
        with pytest.raises(CheckpointError, match="step 1 was not committed") as info:
            await ckpt.wait()
        assert what in str(info.value)
        assert ckpt.steps() == [1, 2]


async def test_a_damaged_hold_of_a_gone_step_does_not_stop_the_open(
    anyio_backend: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with Checkpointer(tmp_path) as ckpt:
        await ckpt.save({"w": torch.ones(2)}, step=1)
        await ckpt.wait()
    _hold(tmp_path, 7).mkdir()  # no step 7: the open's cleaning would remove a file there
    with caplog.at_level(logging.WARNING, logger="async_stager.checkpoint"):
        async with Checkpointer(tmp_path) as ckpt:
            assert await ckpt.restore({"w": torch.zeros(2)}) == 1
    assert any(".hold-step-00000007 left as it is" in r.message for r in caplog.records)


# -- folders that can only be read --------------------------------------------------------


def _no_free_inode(monkeypatch: Any, folder: Path) -> list[str]:
    """``folder`` on a disk without a free inode, at the lowest layer: creating a file
    or a folder under it fails with ENOSPC, as the kernel does; existing files open,
    read and write. Returns the names refused."""
    refused: list[str] = []
    real_open, real_mkdir = os.open, os.mkdir
    top = os.path.realpath(folder)

    def under(path: Any) -> bool:
        real = os.path.realpath(os.fspath(path))
        return real == top or real.startswith(top + os.sep)

    def open_(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_CREAT and under(path) and not os.path.exists(path):
            refused.append(os.path.basename(os.fspath(path)))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(path))
        return real_open(path, flags, *args, **kwargs)

    def mkdir(path: Any, *args: Any, **kwargs: Any) -> None:
        if under(path) and not os.path.exists(path):
            refused.append(os.path.basename(os.fspath(path)))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(path))
        real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "mkdir", mkdir)
    return refused


@pytest.mark.parametrize("holds", ["kept", "missing"])
async def test_a_disk_without_a_free_inode_opens_for_restore(
    anyio_backend: Any, tmp_path: Path, monkeypatch: Any, holds: str, caplog: pytest.LogCaptureFixture
) -> None:
    """No new file can be made (no free inode, a quota): the folder opens for restore
    only (restore loads the newest step, with or without its hold file), and ``save``
    says why it cannot save."""
    async with Checkpointer(tmp_path) as ckpt:
        await ckpt.save({"w": torch.full((2,), 5.0)}, step=5)
        await ckpt.wait()
    if holds == "missing":
        _hold(tmp_path, 5).unlink()
    refused = _no_free_inode(monkeypatch, tmp_path)
    with caplog.at_level(logging.WARNING, logger="async_stager.checkpoint"):
        async with Checkpointer(tmp_path) as ckpt:
            w = torch.zeros(2)
            assert await ckpt.restore({"w": w}) == 5 and w.tolist() == [5.0, 5.0]
            assert await ckpt.restore({"w": w}, step=5) == 5
            with pytest.raises(CheckpointError, match="open for restore only") as info:
                await ckpt.save({"w": w}, step=6)
            assert "no free inode" in str(info.value) and str(tmp_path) in str(info.value)
    assert refused and any("open for restore only" in r.message for r in caplog.records)
    monkeypatch.undo()
    async with Checkpointer(tmp_path) as ckpt:  # room again: it saves
        await ckpt.save({"w": torch.ones(2)}, step=6)
        await ckpt.wait()
        assert ckpt.steps() == [5, 6]


_READ_ONLY_CHILD = """
import asyncio, json, os, sys
import torch
from async_stager import Checkpointer, CheckpointError

async def scenario(folder):
    out = {}
    async with Checkpointer(folder) as ckpt:
        w = torch.zeros(2)
        out["restored"] = await ckpt.restore({"w": w})
        out["w"] = w.tolist()
        try:
            await ckpt.save({"w": w}, step=9)
        except CheckpointError as exc:
            out["save"] = str(exc)
    return out

scratch, folder, uid = sys.argv[1], sys.argv[2], int(sys.argv[3])
async def warm():
    async with Checkpointer(scratch) as ckpt:
        await ckpt.save({"w": torch.ones(2)}, step=1)
        await ckpt.wait()
    await scenario(scratch)
asyncio.run(warm())  # every module imported while they can be read
if uid:
    os.setgid(uid)
    os.setuid(uid)
print(json.dumps(asyncio.run(scenario(folder))))
"""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_folder_its_owner_made_read_only_opens_for_restore(anyio_backend: str) -> None:
    """``chmod a-w DIR`` by its owner, its ``.lock`` still writable: it opens for
    restore only (a user who is not root: root's writes are never denied, so a child
    drops to another uid, the folder's owner)."""
    top = Path(tempfile.mkdtemp(prefix="async-stager-ro-"))  # /tmp: any user may enter
    try:
        folder = top / "ckpt"
        async with Checkpointer(folder) as ckpt:
            await ckpt.save({"w": torch.full((2,), 3.0)}, step=3)
            await ckpt.wait()
        uid = 0
        if os.geteuid() == 0:
            uid = 65534  # nobody
            os.chmod(top, 0o755)
            for dirpath, dirs, files in os.walk(folder):
                for name in [*dirs, *files]:
                    os.chown(os.path.join(dirpath, name), uid, uid)
            os.chown(folder, uid, uid)
        os.chmod(folder, 0o555)  # a-w; .lock keeps its own mode (writable by its owner)
        child = await anyio.run_process(
            [sys.executable, "-c", _READ_ONLY_CHILD, str(top / "scratch"), str(folder), str(uid)], check=False
        )
        assert child.returncode == 0, child.stderr.decode()[-3000:]
        out = json.loads(child.stdout.decode().strip().splitlines()[-1])
        assert out["restored"] == 3 and out["w"] == [3.0, 3.0]
        assert "open for restore only" in out["save"] and "not writable" in out["save"]
    finally:
        os.chmod(top / "ckpt", 0o755)
        shutil.rmtree(top, ignore_errors=True)


async def test_restore_from_a_folder_that_did_not_exist_says_so(
    anyio_backend: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A typo in the path: the open makes the folder and restore returns None, with
    one WARNING line naming the folder (not a silent start from scratch)."""
    typo = tmp_path / "chekpoints"
    with caplog.at_level(logging.INFO, logger="async_stager.checkpoint"):
        async with Checkpointer(typo) as ckpt:
            assert await ckpt.restore({"w": torch.zeros(2)}) is None
    lines = [r for r in caplog.records if "nothing to restore" in r.message]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert str(typo) in lines[0].message and "did not exist" in lines[0].message
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="async_stager.checkpoint"):
        async with Checkpointer(typo) as ckpt:  # it exists now, empty: said, quietly
            assert await ckpt.restore({"w": torch.zeros(2)}) is None
    lines = [r for r in caplog.records if "nothing to restore" in r.message]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO


# -- what a commit waits for ----------------------------------------------------------------

_READER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_SH)  # what restore() holds while it reads the step
print("held", flush=True)
time.sleep(120)
"""


async def test_a_commit_waiting_for_a_stopped_reader_says_so(anyio_backend: Any, tmp_path: Path) -> None:
    """A reader (another process, stopped) holds step 1; saving step 1 again waits for
    it: ``in_flight()`` and ``status_line()`` name the reader's pid and the step, not
    only "committing"; once the reader is gone the save commits."""
    async with Checkpointer(tmp_path) as ckpt:
        await ckpt.save({"w": torch.ones(2)}, step=1)
        await ckpt.wait()
        reader = await anyio.open_process([sys.executable, "-c", _READER, str(_hold(tmp_path, 1))])
        try:
            assert reader.stdout is not None
            with anyio.fail_after(30):
                assert b"held" in await reader.stdout.receive()
            reader.send_signal(signal.SIGSTOP)
            await ckpt.save({"w": torch.full((2,), 2.0)}, step=1)
            with anyio.fail_after(30):
                while not (ckpt.in_flight() and ckpt.in_flight()[0].waiting_for):
                    await anyio.sleep(0.01)
            progress = ckpt.in_flight()[0]
            assert progress.phase == "committing" and progress.waiting_for is not None
            assert f"pid {reader.pid}" in progress.waiting_for and "reader of step 1" in progress.waiting_for
            assert progress.to_dict()["waiting_for"] == progress.waiting_for
            line = ckpt.status_line()
            assert line.startswith("step 1: committing") and f"pid {reader.pid}" in line
        finally:
            reader.kill()
            reader.send_signal(signal.SIGCONT)
            await reader.aclose()
        with anyio.fail_after(30):
            await ckpt.wait()
        w = torch.zeros(2)
        assert await ckpt.restore({"w": w}) == 1 and w.tolist() == [2.0, 2.0]


# -- calls made wrong -----------------------------------------------------------------------


async def test_save_from_another_thread_says_how_to_reach_the_loop(
    anyio_backend: Any, tmp_path: Path
) -> None:
    async with Checkpointer(tmp_path) as ckpt:
        state = {"w": torch.ones(2)}
        errors: list[BaseException] = []

        def in_thread() -> None:
            for call in (
                lambda: ckpt.save(state, step=1),
                ckpt.fence,
                ckpt.request_save,
            ):
                try:
                    call()
                except BaseException as exc:  # noqa: BLE001 - kept for the assertions
                    errors.append(exc)

        await anyio.to_thread.run_sync(in_thread)
        assert len(errors) == 3 and all(isinstance(e, CheckpointError) for e in errors), errors
        assert "save() must run on the event loop" in str(errors[0])
        assert "anyio.from_thread.run(functools.partial(ckpt.save" in str(errors[0])
        assert str(errors[1]).startswith("fence() must run") and str(errors[2]).startswith("request_save()")
        assert ckpt.in_flight() == []  # nothing accepted; the Checkpointer stays usable

        # What the message says works (a thread of anyio's: no token needed).
        def through_the_loop() -> None:
            anyio.from_thread.run(functools.partial(ckpt.save, state, step=1))

        await anyio.to_thread.run_sync(through_the_loop)
        await ckpt.wait()
        assert ckpt.steps() == [1]


@pytest.mark.parametrize(
    ("deadline", "error"),
    [(math.nan, InvalidOptionError), ("5", InvalidOptionTypeError), (None, InvalidOptionTypeError)],
)
async def test_final_checkpoint_refuses_a_deadline_that_is_not_a_number(
    anyio_backend: Any, tmp_path: Path, deadline: Any, error: type[Exception]
) -> None:
    async with Checkpointer(tmp_path) as ckpt, Shutdown() as stop:
        with pytest.raises(error, match=r"final_checkpoint\(deadline=\.\.\.\) must be a number"):
            await stop.final_checkpoint(ckpt, {"w": torch.ones(2)}, step=1, deadline=deadline)
        assert ckpt.in_flight() == [] and ckpt.steps() == []  # nothing saved
        assert await stop.final_checkpoint(ckpt, {"w": torch.ones(2)}, step=1, deadline=math.inf) == 0
        assert ckpt.steps() == [1]


# -- leaving after a missed deadline --------------------------------------------------------


class SlowToCopy:
    """A value the stager copies in its thread (by its reduction), slowly: until
    ``gate`` is set (or 60 s)."""

    gate: threading.Event | None = None

    def __reduce_ex__(self, protocol: Any) -> Any:
        if SlowToCopy.gate is not None and threading.current_thread() is not threading.main_thread():
            SlowToCopy.gate.wait(60)
        return (SlowToCopy, ())


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_leaving_after_a_missed_deadline_does_not_wait_for_a_snapshot_being_taken(
    anyio_backend: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``final_checkpoint`` misses its deadline while the stager copies a slow value:
    leaving ``async with Checkpointer(...), Shutdown()`` does not wait for that copy
    (it waited until it ended: 4 s past a 0.5 s deadline), and says what it left."""
    SlowToCopy.gate = threading.Event()
    try:
        with caplog.at_level(logging.WARNING, logger="async_stager.checkpoint"):
            async with Checkpointer(tmp_path) as ckpt, Shutdown() as stop:
                await ckpt.save({"w": torch.ones(2)}, step=1)
                await ckpt.wait()
                stop.request()
                state = {"w": torch.ones(2), "slow": SlowToCopy()}
                assert await stop.final_checkpoint(ckpt, state, step=2, deadline=0.5) == 1
                t0 = time.monotonic()
            left = time.monotonic() - t0
        # A hang guard: a block that waited for the copy would take its 60 s.
        assert left < 30, f"leaving the block took {left:.1f} s (the slow copy's)"
        assert ckpt.steps() == [1]
        assert any("snapshot still being taken" in r.message for r in caplog.records)
    finally:
        SlowToCopy.gate.set()
        SlowToCopy.gate = None
    async with Checkpointer(tmp_path) as ckpt:  # the folder is usable; step 1 the newest
        assert await ckpt.restore({"w": torch.zeros(2)}) == 1


# -- values a format cannot restore, refused at save() (issue 41, section 4) -------------------


def _local_things() -> tuple[Any, Any]:
    class Local:
        def __init__(self) -> None:
            self.x = 1

    def inner() -> int:
        return 1

    return Local(), inner


@pytest.mark.parametrize("fmt", ["dcp", "torch"])
@pytest.mark.parametrize("what", ["lambda", "local function", "local class instance"])
async def test_a_value_the_format_cannot_restore_is_refused_at_save_naming_its_path(
    anyio_backend: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture, fmt: Any, what: str
) -> None:
    instance, function = _local_things()
    value = {"lambda": lambda x: x, "local function": function, "local class instance": instance}[what]
    async with Checkpointer(tmp_path, format=fmt) as ckpt:
        with caplog.at_level(logging.WARNING, logger="async_stager"), pytest.raises(CheckpointError) as info:
            ckpt.save({"w": torch.ones(2), "cfg": {"hooks": [1, value]}}, step=1).close()  # at the call
        assert "['cfg']['hooks'][1]" in str(info.value)
        assert fmt in str(info.value)
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # said once: raised
        assert ckpt.in_flight() == []
        await ckpt.save({"w": torch.ones(2)}, step=1)  # still usable
        await ckpt.wait()
        assert ckpt.steps() == [1]


@pytest.mark.parametrize("budgeted", [False, True])
async def test_a_dcp_key_it_cannot_restore_is_refused_at_save_once(
    anyio_backend: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture, budgeted: bool
) -> None:
    """A bool dict key (DCP would store it as 'True'), a value that is not a tensor
    under an int key: refused at ``save()`` with the path, raised once and not also
    logged (it was an ERROR record and then the same error raised at ``wait()``)."""
    opts: dict[str, Any] = {"host_budget_bytes": 1 << 16} if budgeted else {}
    async with Checkpointer(tmp_path, **opts) as ckpt:
        with caplog.at_level(logging.INFO, logger="async_stager"):
            with pytest.raises(CheckpointError, match="a dict key of type bool") as info:
                ckpt.save({"w": torch.ones(2), "m": {True: torch.ones(1)}}, step=1).close()
            assert info.value.path == ("m", True)
            with pytest.raises(CheckpointError, match="not a tensor under an int dict key") as info:
                ckpt.save({"optim": {"state": {0: {"momentum": None, "t": torch.ones(1)}}}}, step=1).close()
            assert info.value.path == ("optim", "state", 0, "momentum")
        assert not [r for r in caplog.records if "dict key" in r.getMessage()]
        assert ckpt.in_flight() == []
        ok = {"w": torch.ones(2), "optim": {"state": {0: {"t": torch.ones(1)}}, "groups": [{"lr": 0.1}]}}
        await ckpt.save(ok, step=1)
        await ckpt.wait()
        assert ckpt.steps() == [1]


# -- Ctrl-C during a write (issue 41, section 4) ---------------------------------------------

_CTRL_C_CHILD = """
import signal, sys, threading, time
import anyio, torch
from async_stager import Checkpointer

# Ctrl-C as at a terminal, even when the suite runs where SIGINT is ignored and every
# child inherits that (a background job of a non-interactive shell).
signal.signal(signal.SIGINT, signal.default_int_handler)

class SlowToWrite:
    def __reduce__(self):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(2)  # in the write's thread: Ctrl-C comes meanwhile
        return (SlowToWrite, ())

async def main(folder):
    async with Checkpointer(folder) as ckpt:
        await ckpt.save({"w": torch.ones(2)}, step=1)
        await ckpt.wait()
        await ckpt.save({"w": torch.ones(2), "slow": SlowToWrite()}, step=2)
        print("writing", flush=True)
        await anyio.sleep(60)

anyio.run(main, sys.argv[1], backend=sys.argv[2])
"""


@pytest.mark.timeout(240)
# asyncio in the default run; trio (its own signal path) in CI's second call.
@pytest.mark.parametrize("backend", ["asyncio", pytest.param("trio", marks=pytest.mark.slow)])
def test_ctrl_c_during_a_write_says_in_one_line_whether_it_committed(tmp_path: Path, backend: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _CTRL_C_CHILD, str(tmp_path), backend],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "writing"  # (a hang guard: the test's timeout)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    lines = [ln for ln in err.splitlines() if ln.startswith("checkpoint: left by")]
    assert len(lines) == 1, err[-3000:]
    assert "step 2 committed before leaving" in lines[0] and "the newest commit is step 2" in lines[0]
    assert (tmp_path / "step-00000002").is_dir()


class GatedWrite:
    """Pickled by the write's thread (DCP's bytes item): it waits for ``gate`` there."""

    gate: threading.Event | None = None

    def __reduce__(self) -> Any:
        if GatedWrite.gate is not None and "-save" in threading.current_thread().name:
            GatedWrite.gate.wait(60)
        return (GatedWrite, ())


async def test_a_cancelled_block_with_a_save_in_flight_says_what_committed(
    anyio_backend: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gate = threading.Event()
    GatedWrite.gate = gate
    try:
        with caplog.at_level(logging.WARNING, logger="async_stager.checkpoint"), anyio.CancelScope() as scope:
            async with Checkpointer(tmp_path) as ckpt:
                await ckpt.save({"w": torch.ones(2), "g": GatedWrite()}, step=1)
                scope.cancel()
                threading.Timer(0.3, gate.set).start()  # the write ends after the block is left
                await anyio.sleep(10)
    finally:
        gate.set()
        GatedWrite.gate = None
    lines = [r.getMessage() for r in caplog.records if "with saves in flight" in r.getMessage()]
    assert lines == [
        "checkpoint: left by a cancellation (Ctrl-C is one under asyncio) with saves in flight: "
        "step 1 committed before leaving; the newest commit is step 1"
    ]
    # The cancelled block closed (on trio its close's awaits raised again: the stager,
    # the writer lock and the Checkpointer itself stayed open).
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".writer-")]
    async with ckpt:  # opens again
        assert ckpt.steps() == [1]
    with anyio.CancelScope() as scope:
        async with ckpt:  # no save in flight: nothing said
            scope.cancel()
            await anyio.sleep(10)
    assert len([r for r in caplog.records if "with saves in flight" in r.getMessage()]) == 1
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".writer-")]


async def test_a_failed_replacement_puts_the_step_it_replaces_back(
    anyio_backend: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    """Saving step 1 again fails at the commit's rename: step 1 as it was stays listed
    and restorable at once (it stayed under its ``.old-`` name until the next open)."""
    real_rename = os.rename

    def rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if os.fspath(dst).endswith("step-00000001") and ".tmp-" in os.fspath(src):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_rename(src, dst, *args, **kwargs)

    async with Checkpointer(tmp_path) as ckpt:
        await ckpt.save({"w": torch.ones(2)}, step=1)
        await ckpt.wait()
        monkeypatch.setattr(os, "rename", rename)
        await ckpt.save({"w": torch.full((2,), 2.0)}, step=1)
        with pytest.raises(CheckpointError, match="step 1 was not committed"):
            await ckpt.wait()
        monkeypatch.setattr(os, "rename", real_rename)
        assert ckpt.steps() == [1]
        w = torch.zeros(2)
        assert await ckpt.restore({"w": w}) == 1 and w.tolist() == [1.0, 1.0]
        assert _hold(tmp_path, 1).exists()


async def test_a_dcp_state_that_holds_itself_is_refused_at_save(anyio_backend: Any, tmp_path: Path) -> None:
    """A dict or list that holds itself: DCP's traversal would recurse for ever; the
    check at ``save()`` must neither loop nor recurse, and names the place. A shared
    (not cyclic) container is fine; a 5000-deep one is left to the stager's own error."""
    looped: dict[str, Any] = {"t": torch.ones(1)}
    looped["me"] = looped
    ring: list[Any] = [torch.ones(1)]
    ring.append(ring)
    shared = {"t": torch.ones(1)}
    deep: list[Any] = []
    node = deep
    for _ in range(5000):
        node.append([])
        node = node[0]
    async with Checkpointer(tmp_path) as ckpt:
        with anyio.fail_after(20):
            for state, where in (
                ({"d": looped}, ("d", "me")),
                ({"x": looped, "y": looped}, None),
                ({"l": ring}, ("l", 1)),
            ):
                with pytest.raises(CheckpointError, match="holds itself") as info:
                    ckpt.save(state, step=1).close()
                if where is not None:
                    assert info.value.path == where
            with pytest.raises(Exception) as deep_info:
                await ckpt.save({"deep": deep}, step=1)
            assert "holds itself" not in str(deep_info.value)
        await ckpt.save({"x": shared, "y": shared, "z": [shared, 1]}, step=2)
        await ckpt.wait()
        assert ckpt.steps() == [2]


async def test_final_checkpoint_takes_any_real_number(anyio_backend: Any, tmp_path: Path) -> None:
    import numpy as np

    async with Checkpointer(tmp_path) as ckpt, Shutdown() as stop:
        assert await stop.final_checkpoint(ckpt, {"w": torch.ones(2)}, step=1, deadline=np.float32(60)) == 0
        assert stop.seconds is not None and ckpt.steps() == [1]
