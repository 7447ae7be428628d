"""Errors that must show their cause (issue 36, section 3), through the public API:
exceptions raised inside ``async with Shutdown()`` come out as raised; a checkpoint
write on a full disk says so and names the file (both formats, the OSError chained);
the torch format refuses a restore whose structure differs, as DCP does; an abandoned
``saved()`` iterator holds nothing."""

from __future__ import annotations

import errno
import gc
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from async_stager import Checkpointer, CheckpointError, Shutdown
from tests.full_disk import full_disk

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]


class Mine(Exception):
    pass


@pytest.mark.parametrize("error", [ValueError("bad value"), KeyError("k"), Mine("mine")])
async def test_an_error_inside_shutdown_comes_out_as_raised(anyio_backend: Any, error: Exception) -> None:
    with pytest.raises(type(error)) as e:
        async with Shutdown():
            raise error
    assert e.value is error  # not an ExceptionGroup around it


async def test_an_error_inside_checkpointer_and_shutdown_comes_out_as_raised(
    anyio_backend: Any, tmp_path: Path
) -> None:
    """The documented service shape: ``except ValueError`` around it keeps working."""
    caught = None
    try:
        async with Checkpointer(tmp_path) as ckpt, Shutdown() as stop:
            await ckpt.save({"w": torch.ones(4)}, step=1)
            assert not stop.requested
            raise ValueError("in the loop")
    except ValueError as e:
        caught = e
    assert caught is not None and str(caught) == "in the loop"
    assert ckpt.steps() == [1]  # the save in flight was still committed
    async with Shutdown():  # usable again, handlers back
        pass


# -- a full disk ------------------------------------------------------------------------


def _full_disk_error(error: BaseException, root: Path, file: str) -> None:
    """A CheckpointError that says the disk is full, names the file, chains the OSError."""
    msg = str(error)
    assert "disk is full" in msg and "No space left on device" in msg, msg
    assert str(root) in msg and file in msg, msg
    assert "Traceback" not in msg and len(msg.splitlines()) == 1, msg
    cause = error.__cause__
    assert isinstance(cause, OSError) and cause.errno == errno.ENOSPC, repr(cause)
    assert cause.filename and cause.filename.endswith(file), cause.filename


@pytest.mark.parametrize(
    ("fmt", "file"), [("dcp", ".distcp"), ("torch", "state.pt"), ("budgeted", ".distcp")]
)
@pytest.mark.parametrize("after", [0, 700, 5000])
async def test_a_write_on_a_full_disk_says_so_and_names_the_file(
    anyio_backend: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str, file: str, after: int
) -> None:
    """The disk fills before the first byte, inside torch's zip header (torch then
    raises "unexpected pos"), or mid-data: each is a CheckpointError saying the disk is
    full and naming the file, the OSError chained; nothing is committed, the step's
    temporary folder is gone, and once there is room again saves work."""
    state = {"w": torch.arange(2000.0), "n": 3}
    opts: dict[str, Any] = {"host_budget_bytes": 1 << 20} if fmt == "budgeted" else {"format": fmt}
    async with Checkpointer(tmp_path, **opts) as ckpt:
        await ckpt.save(state, step=1)
        await ckpt.wait()
        disk = full_disk(monkeypatch, tmp_path, after=after)
        await ckpt.save(state, step=2)
        with pytest.raises(CheckpointError) as e:
            await ckpt.wait()
        assert disk.refused >= 1 and e.value.step == 2
        _full_disk_error(e.value, tmp_path, file)
        monkeypatch.undo()
        assert ckpt.steps() == [1]
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
        await ckpt.save(state, step=3)
        await ckpt.wait()
        assert ckpt.steps() == [1, 3]


def _unshare_ok() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=4k none /tmp"], capture_output=True, timeout=30
    )
    return probe.returncode == 0


@pytest.mark.parametrize(("fmt", "file"), [("dcp", ".distcp"), ("torch", "state.pt")])
def test_a_real_full_filesystem(tmp_path: Path, fmt: str, file: str) -> None:
    """The same on a real full filesystem: a 48 KiB tmpfs mounted in a user namespace
    (skipped where the machine allows none): the kernel's ENOSPC, torch's and DCP's
    own writers."""
    if not _unshare_ok():
        pytest.skip("no unprivileged user/mount namespaces here")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    code = textwrap.dedent(
        f"""
        import errno, anyio, torch
        from async_stager import Checkpointer, CheckpointError
        async def main():
            async with Checkpointer("{mnt}/ck", format="{fmt}") as ckpt:
                await ckpt.save({{"w": torch.arange(20000.0)}}, step=1)
                try:
                    await ckpt.wait()
                except CheckpointError as e:
                    c = e.__cause__
                    print("ERROR", e, "| CAUSE", isinstance(c, OSError) and c.errno == errno.ENOSPC, c.filename)
        anyio.run(main)
        """
    )
    out = subprocess.run(
        [
            "unshare",
            "-rm",
            "sh",
            "-c",
            f'mount -t tmpfs -o size=48k none {mnt} && "{sys.executable}" -c "$0"',
            code,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    [line] = [ln for ln in out.stdout.splitlines() if ln.startswith("ERROR")] or [out.stdout + out.stderr]
    assert "disk is full" in line and "No space left on device" in line and file in line, line
    assert "| CAUSE True" in line, line


# -- one structure rule for both formats ----------------------------------------------

STRUCTURES: dict[str, tuple[Any, Any]] = {
    # name: (what was saved as state["a"], what the state to restore into holds there)
    "a dict where a tensor was saved": (torch.ones(3), {"x": torch.zeros(3)}),
    "a dict of values where a tensor was saved": (torch.ones(3), {"n": 1}),
    "a plain value where a dict was saved": ({"x": torch.ones(3)}, 3),
    "None where a dict was saved": ({"x": torch.ones(3)}, None),
    "a tensor where a dict was saved": ({"x": torch.ones(3)}, torch.zeros(3)),
    "a list where a tensor was saved": (torch.ones(3), [torch.zeros(3)]),
    "a plain value where a tensor was saved": (torch.ones(3), 5),
}


@pytest.mark.parametrize("fmt", ["dcp", "torch"])
@pytest.mark.parametrize("case", list(STRUCTURES))
async def test_a_state_of_another_structure_is_refused_in_both_formats(
    anyio_backend: Any, tmp_path: Path, fmt: str, case: str
) -> None:
    """The torch format replaced the state's dict by the saved tensor; DCP refuses. One
    rule: CheckpointError naming the path, before anything is loaded."""
    saved, target = STRUCTURES[case]
    async with Checkpointer(tmp_path, format=fmt) as ckpt:  # type: ignore[arg-type]
        await ckpt.save({"a": saved, "b": torch.full((2,), 7.0)}, step=1)
        await ckpt.wait()
        state: dict[str, Any] = {"a": target, "b": torch.zeros(2)}
        with pytest.raises(CheckpointError, match=r"restore: state\['a'\]") as e:
            await ckpt.restore(state, fallback=False)
        assert e.value.step == 1
        assert state["a"] is target and torch.equal(state["b"], torch.zeros(2))  # nothing loaded
        # An empty dict there names nothing to load: the saved value is taken (both formats).
        state = {"a": {}, "b": torch.zeros(2)}
        assert await ckpt.restore(state) == 1 and torch.equal(state["b"], torch.full((2,), 7.0))


# -- saved(): an abandoned iterator holds nothing -----------------------------------------


async def test_an_abandoned_saved_iterator_holds_nothing(anyio_backend: Any, tmp_path: Path) -> None:
    """An iterator dropped after one commit kept receiving every later one (149 SaveStats
    alive after 150 saves). Now the Checkpointer holds iterators weakly: after 150 saves
    nothing but the live reader's own and ``ckpt.last`` is alive, and a reader that is
    kept gets every commit, in order, and ends at the close."""
    from async_stager import SaveStats

    state = {"w": torch.arange(16.0)}
    got: list[int] = []
    async with Checkpointer(tmp_path, format="torch", keep=1, checksums=False) as ckpt:
        live = ckpt.saved()
        abandoned = ckpt.saved()
        firsts: list[int] = []

        async def first_only() -> None:
            async for stats in ckpt.saved():  # abandoned by a break after one commit
                firsts.append(stats.step)
                break

        async with anyio.create_task_group() as tg:
            tg.start_soon(first_only)
            await anyio.sleep(0)
            await ckpt.save(state, step=1)
            await ckpt.wait()
        assert firsts == [1]
        assert (await abandoned.receive()).step == 1
        del abandoned
        for step in range(2, 151):
            await ckpt.save(state, step=step)
            if step % 10 == 0:
                await ckpt.wait()
                while True:  # the live reader keeps up
                    try:
                        got.append(live.receive_nowait().step)
                    except anyio.WouldBlock:
                        break
        await ckpt.wait()
        gc.collect()
        alive = [o for o in gc.get_objects() if type(o) is SaveStats]
        assert len(alive) <= 2, f"{len(alive)} SaveStats alive after 150 saves"  # last, and one queued
    got.extend([s.step async for s in live])  # what was left; then it ends at the close
    assert got == list(range(1, 151))
    live.close()
    live.close()  # idempotent


@pytest.mark.parametrize("budget", [None, 1 << 20], ids=["staged", "budgeted"])
@pytest.mark.parametrize("where", ["data", "metadata"])
async def test_dcp_save_on_a_full_disk_names_the_file_in_its_chain(
    anyio_backend: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, budget: int | None, where: str
) -> None:
    """A sibling: ``async_stager.dcp.save`` keeps DCP's own ``CheckpointException`` (its
    documented behaviour), staged or budgeted, but the rank's error in it is the OSError
    naming the file: a data file, or DCP's commit (its ``.metadata``, written last);
    nothing is committed, and the stager saves again once there is room."""
    from torch.distributed.checkpoint.api import CheckpointException

    import async_stager.dcp as adcp
    from async_stager import Stager

    folder = tmp_path / "x"
    file = ".distcp" if where == "data" else ".metadata.tmp"
    state = {"w": torch.arange(100.0)}
    kw: dict[str, Any] = {} if budget is None else {"host_budget_bytes": budget}
    async with Stager() as stager:
        disk = full_disk(monkeypatch, folder if where == "data" else folder / file)
        with pytest.raises(CheckpointException) as e:
            await adcp.save(state, stager=stager, checkpoint_id=str(folder), no_dist=True, **kw)
        assert disk.refused >= 1
        [failure] = e.value.failures.values()
        error = failure[0] if isinstance(failure, tuple) else failure
        assert isinstance(error, OSError) and error.errno == errno.ENOSPC
        assert error.filename and error.filename.endswith(file), error.filename
        assert str(folder / "") in error.filename
        assert error.filename in str(e.value)
        assert not (folder / ".metadata").exists()
        monkeypatch.undo()
        await adcp.save(state, stager=stager, checkpoint_id=str(folder), no_dist=True, **kw)
    assert (folder / ".metadata").exists()


@pytest.mark.parametrize("fmt", ["dcp", "torch", "budgeted"])
async def test_a_commit_failing_after_its_record_names_the_folder_not_a_file(
    anyio_backend: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    """The commit's fsyncs fail on a full disk (a quota or a network filesystem reports
    it there: an OSError naming nothing) after every file, the COMMIT record included,
    was written: the CheckpointError says the disk is full writing the step's folder,
    not the COMMIT record (written fine) nor another file; nothing is committed, the
    temporary folder is gone, and saves work again once the disk has room."""
    import stat

    state = {"w": torch.arange(2000.0), "n": 3}
    opts: dict[str, Any] = {"host_budget_bytes": 1 << 20} if fmt == "budgeted" else {"format": fmt}
    real_fsync = os.fsync
    refused: list[int] = []

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):  # the commit's own: a folder's names
            refused.append(fd)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    async with Checkpointer(tmp_path, **opts) as ckpt:
        await ckpt.save(state, step=1)
        await ckpt.wait()
        monkeypatch.setattr(os, "fsync", fsync)
        await ckpt.save(state, step=2)
        with pytest.raises(CheckpointError) as e:
            await ckpt.wait()
        assert refused and e.value.step == 2
        msg = str(e.value)
        assert "disk is full" in msg and "writing " in msg, msg
        named = msg.split("writing ", 1)[1].split(". ", 1)[0]
        assert Path(named).parent == tmp_path and Path(named).name.startswith(".tmp-step-00000002"), msg
        assert "COMMIT" not in msg, msg
        cause = e.value.__cause__
        assert isinstance(cause, OSError) and cause.errno == errno.ENOSPC, repr(cause)
        monkeypatch.undo()
        assert ckpt.steps() == [1]
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
        await ckpt.save(state, step=3)
        await ckpt.wait()
        assert ckpt.steps() == [1, 3]
