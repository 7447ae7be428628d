"""The on-disk commit protocol of a Checkpointer directory.

Layout of ``DIR``::

    DIR/step-00000040/            committed checkpoints (the only names listed or restored),
    DIR/step-00000050/            each with a COMMIT record (its place in commit order)
    DIR/latest                    "step-00000050\\n": the newest commit, for tools and people
    DIR/.lock                     flock'ed while committing, retiring or cleaning (short)
    DIR/.writer-<token>           flock'ed by a live writer (one open Checkpointer) for its session
    DIR/.tmp-step-00000060.<token>.<seq>/   save number <seq> of that writer, being written

Order is commit order, not step number: ``committed_steps`` lists steps oldest commit
first, ``latest`` names the newest commit, and retention deletes the oldest commits. A
save of a lower step than one already committed (a rollback, a new run in an old folder)
is therefore the newest checkpoint, which a resume wants; saving a step again replaces
it and makes it the newest. Folders committed before COMMIT records existed order by
step number, before every recorded commit.

A save is written into its own ``.tmp-`` folder (two saves never share one, even of the
same step). Once every rank's files are durable (DCP fsyncs each file before it reports
the write done), the coordinator, holding ``DIR/.lock``, writes ``checksums.json`` and
``COMMIT``, fsyncs every file and the folder, renames it to ``step-N`` (the commit
point: one atomic ``rename``), fsyncs ``DIR``, then rewrites ``latest`` (temporary file,
fsync, rename, fsync ``DIR``) and retires old checkpoints (rename to ``.del-``, then
delete). Replacing a committed step moves the old folder to ``.old-step-N.<token>``
first; a crash between the two renames leaves it there, and the next cleaning puts it
back.

Leftovers are removed only when their writer is dead: the ``<token>`` in a leftover's
name names a ``.writer-<token>`` file that its writer holds an exclusive ``flock`` on
for as long as it is open; the kernel drops the lock when the process dies (SIGKILL
included). So a second Checkpointer on the folder (an eval job, a restarted trainer
while the old one finishes) never deletes a live writer's folder. ``flock`` must work
on the file system (local disks do; some network file systems do not). The writer's
session and the cleaning of leftovers are ``session``'s.

A folder the process cannot write (read-only mount, archive, a folder its owner made
read-only) or where no new file can be made (no free inode, a quota) opens for restore
only: nothing is cleaned, locked or repaired there.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from async_stager._checkpoint import holds as _holds
from async_stager._dcp.files import naming_file
from async_stager.errors import CheckpointError

__all__ = [
    "COMMIT",
    "LATEST",
    "StepGone",
    "commit",
    "committed_steps",
    "folder_lock",
    "fsync_dir",
    "read_latest",
    "reading",
    "recorded_layout",
    "remove_tmp",
    "retain",
    "step_dir",
    "step_name",
    "steps_for_reading",
    "tmp_dir",
    "unordered_steps",
    "write_latest",
]

_log = logging.getLogger("async_stager.checkpoint")

LATEST = "latest"
#: The record of a committed folder's place in commit order.
COMMIT = "COMMIT"
#: Format 1: ``seq`` and ``step``. Format 2 adds ``manifest`` (the byte size and digest
#: of ``checksums.json`` as written, or null without checksums) and ``check`` (XXH3-64
#: of the record's other fields in compact canonical JSON): a flipped byte of either
#: file is found, even one that leaves valid JSON behind.
_COMMIT_FORMAT_1 = "async_stager-commit/1"
_COMMIT_FORMAT = "async_stager-commit/2"
_MANIFEST = "checksums.json"


def _canonical(doc: dict[str, Any]) -> str:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def _record_check(doc: dict[str, Any]) -> int:
    from async_stager._core.checksum.digest import hasher

    return int(
        hasher().xxh3_64_intdigest(_canonical({k: v for k, v in doc.items() if k != "check"}).encode())
    )


def _read_record(folder: Path) -> dict[str, Any] | None:
    """A folder's COMMIT record, checked (format 2: its own check and its step); None
    when it is missing, unreadable or damaged."""
    try:
        doc = json.loads((folder / COMMIT).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if not isinstance(doc, dict):
        return None
    if doc.get("format") == _COMMIT_FORMAT:
        if doc.get("check") != _record_check(doc):
            return None
        m = _STEP.match(folder.name)
        if m is not None and doc.get("step") != int(m.group(1)):
            return None
    elif doc.get("format") != _COMMIT_FORMAT_1:
        return None
    return doc


def recorded_manifest(folder: Path) -> dict[str, Any] | None:
    """The ``{"bytes", "digest"}`` of ``checksums.json`` that ``folder``'s COMMIT
    record holds (format 2), else None (an older record, a folder without one, or a
    damaged one: the listing already refuses that)."""
    doc = _read_record(folder)
    entry = doc.get("manifest") if doc is not None else None
    return entry if isinstance(entry, dict) else None


def recorded_layout(folder: Path) -> str | None:
    """The format (``"dcp"``, ``"torch"``) ``folder``'s COMMIT record names, else None
    (a record written before it said so, or none)."""
    doc = _read_record(folder)
    layout = doc.get("layout") if doc is not None else None
    return layout if isinstance(layout, str) else None


_STEP = re.compile(r"^step-(\d{8,})$")


def step_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step-{step:08d}"


def step_dir(root: Path, step: int) -> Path:
    return root / step_name(step)


def tmp_dir(root: Path, step: int, token: str, seq: int) -> Path:
    """The temporary folder of save number ``seq`` of writer ``token``."""
    return root / f".tmp-{step_name(step)}.{token}.{seq}"


def fsync_dir(path: Path) -> None:
    """fsync a folder, so the names created, renamed or removed in it are durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    for dirpath, _dirs, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def _commit_seq(folder: Path) -> int | None:
    """A committed folder's place in commit order: its COMMIT record's number; -1 for a
    folder an earlier version committed (no record, no format-4 manifest); None when
    the record is damaged or missing from a folder this version wrote (it always writes
    one): such a step cannot be placed in commit order, so it is not listed (never
    restored as the newest, never retired in its place)."""
    if not (folder / COMMIT).exists():
        return None if _written_by_this_version(folder) else -1
    doc = _read_record(folder)
    seq = doc.get("seq") if doc is not None else None
    return seq if isinstance(seq, int) and not isinstance(seq, bool) and seq >= 0 else None


def _written_by_this_version(folder: Path) -> bool:
    try:
        doc = json.loads((folder / "checksums.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    return isinstance(doc, dict) and doc.get("format") == "async_stager-checksums/4"


def _committed(root: Path) -> list[tuple[int, int]]:
    """``(commit seq, step)`` of every committed folder, oldest commit first."""
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for name in names:
        m = _STEP.match(name)
        if m and (root / name).is_dir():
            seq = _commit_seq(root / name)
            if seq is None:
                _log.warning("%s: its %s record is damaged or missing: not listed", root / name, COMMIT)
                continue
            found.append((seq, int(m.group(1))))
    return sorted(found)


def unordered_steps(root: Path) -> list[int]:
    """Steps whose folder is under ``root`` but not listed by ``committed_steps``: their
    COMMIT record is damaged (changed, emptied) or missing from a folder this version
    wrote, so they cannot be placed in commit order (restore skips them). Ascending."""
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for name in names:
        m = _STEP.match(name)
        if m and (root / name).is_dir() and _commit_seq(root / name) is None:
            out.append(int(m.group(1)))
    return sorted(out)


def committed_steps(root: Path) -> list[int]:
    """Steps committed under ``root``, oldest commit first (empty if ``root`` does not
    exist); the last is the newest commit."""
    return [step for _, step in _committed(root)]


def read_latest(root: Path) -> int | None:
    """The step ``latest`` names, or None (no file, or it names no committed folder)."""
    try:
        name = (root / LATEST).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    m = _STEP.match(name)
    if m is None or not (root / name).is_dir():
        return None
    return int(m.group(1))


def write_latest(root: Path, step: int) -> None:
    tmp = root / f".{LATEST}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(step_name(step) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    fsync_dir(root)


def folder_lock(root: Path) -> contextlib.AbstractContextManager[None]:
    """Hold ``DIR/.lock`` exclusively (blocking): commits, retention and cleaning of
    every process on the folder run one at a time. Call from a worker thread."""
    return _holds.flock_exclusive(root / ".lock")


class StepGone(Exception):
    """The step a reader was about to read is no longer committed (retired, or being
    replaced): list the commits again."""


#: Seconds a reader pauses before it tries again to hold a step a writer is replacing.
_HOLD_RETRY = 0.01


@contextlib.contextmanager
def reading(root: Path, step: int) -> Iterator[tuple[int, bool]]:
    """Hold committed ``step`` for reading (``holds``): its folder neither vanishes nor
    changes until the block ends. Yields its commit number (its COMMIT record's
    ``seq``) and whether it is held (False when the folder has no lock files to hold:
    read-only; the caller then checks ``commit_number`` after a failed read). Raises StepGone if
    ``step`` is no longer committed. Blocking (a worker thread); waits only for a
    commit in progress, never for another reader."""
    name = step_name(step)
    pause = _HOLD_RETRY
    while True:
        lock = _holds.open_lock_file(root / ".lock")
        try:
            if lock is not None:
                fcntl.flock(lock, fcntl.LOCK_EX)
            seq = _commit_seq(root / name) if (root / name).is_dir() else None
            if seq is None:
                raise StepGone(step)
            try:
                hold = _holds.shared_now(root, name)
            except BlockingIOError:
                hold = -1  # a writer replaces it now: try again
            except CheckpointError as exc:  # its hold file is a folder or a broken link
                raise CheckpointError(
                    f"checkpoint step {step} cannot be held for reading: {exc}", step=step
                ) from exc.__cause__
        finally:
            if lock is not None:
                os.close(lock)
        if hold != -1:
            break
        time.sleep(pause)
        pause = min(pause * 2, 0.5)
    try:
        yield seq, hold is not None
    finally:
        if hold is not None:
            os.close(hold)


def steps_for_reading(root: Path) -> list[int]:
    """``committed_steps`` as one moment of the folder: listed holding ``DIR/.lock``
    (when the folder has one to take), so a step being replaced (two renames) is never
    missed. Blocking (a worker thread); waits only for a commit in progress."""
    lock = _holds.open_lock_file(root / ".lock") if root.is_dir() else None
    try:
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        return committed_steps(root)
    finally:
        if lock is not None:
            os.close(lock)


def commit_number(root: Path, step: int) -> int | None:
    """Committed ``step``'s commit number now (None: not committed)."""
    folder = step_dir(root, step)
    return _commit_seq(folder) if folder.is_dir() else None


def commit(root: Path, tmp: Path, step: int, layout: str | None = None) -> Path:
    """Make ``tmp`` the committed ``step-N`` (see the module docstring) and point
    ``latest`` at it; ``layout``: the format it was written in (the record keeps it,
    so a folder that holds steps of two formats reads each in its own).
    Coordinator only, after every rank's files are written, holding the step's
    exclusive hold (``holds.exclusive``: no reader reads the step it replaces) and then
    ``folder_lock``. Returns the committed folder."""
    dst = step_dir(root, step)
    seq = max((s for s, _ in _committed(root)), default=-1) + 1
    record: dict[str, Any] = {"format": _COMMIT_FORMAT, "seq": seq, "step": step, "manifest": None}
    if layout is not None:
        record["layout"] = layout
    if (tmp / _MANIFEST).exists():
        from async_stager._checkpoint.stored import file_digest

        record["manifest"] = file_digest(tmp / _MANIFEST)
    record["check"] = _record_check(record)
    with naming_file(tmp / COMMIT):  # a full disk's error names no file: this one
        (tmp / COMMIT).write_text(_canonical(record), encoding="utf-8")
    # What fails from here names no file of its own (an fsync, a rename of the folder):
    # the caller names the step's folder, not the record written fine before.
    _fsync_tree(tmp)
    old = root / f".old-{step_name(step)}.{tmp.name.split('.')[2]}"
    if dst.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(dst, old)
    try:
        os.rename(tmp, dst)  # the commit point
    except BaseException:
        # Not committed: the step it was to replace goes back at once (it was left
        # under its ``.old-`` name, not listed, until the next open's cleaning).
        if old.exists() and not dst.exists():
            with contextlib.suppress(OSError):
                os.rename(old, dst)
        raise
    # After the commit point the step is committed (steps() and restore() read the
    # COMMIT records): what fails from here on is a warning, never "not committed".
    try:
        fsync_dir(root)
    except OSError as exc:
        _log.warning("%s: step %d is committed, but the folder could not be synced: %s", root, step, exc)
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)
    try:
        write_latest(root, step)
    except OSError as exc:
        # ``latest`` is a pointer for people and tools; the next commit rewrites it.
        _log.warning("%s: step %d is committed, but %s was not updated: %s", root, step, LATEST, exc)
    return dst


def retain(root: Path, keep: int) -> list[int]:
    """Delete all but the ``keep`` newest commits (after a commit, holding
    ``folder_lock``); returns the steps deleted. The newest commit is never one. A step
    a reader holds (``reading``) is not deleted now: a later retention deletes it once
    no reader holds it (until then ``keep`` is exceeded by the steps being read).

    Never raises: it runs after the commit point, so a step that cannot be retired (its
    hold file a folder, a permission) is a warning naming it and the cause, and stays
    committed; the next commit's retention tries again."""
    try:
        steps = committed_steps(root)
    except OSError as exc:
        _log.warning("%s: old checkpoints not retired (retried at the next commit): %s", root, exc)
        return []
    doomed: list[int] = []
    locks: list[int] = []
    try:
        for step in steps[:-keep] if keep > 0 else []:
            try:
                got = _holds.try_exclusive(root, step_name(step))
            except OSError as exc:
                _log.warning(
                    "%s: step %d not retired (retried at the next commit): %s",
                    root,
                    step,
                    _holds.describe_damage(_holds.hold_path(root, step_name(step)), exc),
                )
                continue
            if got is None:
                _log.info("%s: step %d is being read: retired by a later commit", root, step)
                continue
            try:
                os.rename(step_dir(root, step), root / f".del-{step_name(step)}")
            except OSError as exc:
                if not isinstance(got, bool):
                    os.close(got)
                _log.warning("%s: step %d not retired (retried at the next commit): %s", root, step, exc)
                continue
            if not isinstance(got, bool):
                locks.append(got)
            doomed.append(step)
        if doomed:
            with contextlib.suppress(OSError):
                fsync_dir(root)
            for step in doomed:
                shutil.rmtree(root / f".del-{step_name(step)}", ignore_errors=True)
                # Removed while locked: a reader that opened it before waits for
                # ``.lock``, then finds the step gone (``reading``).
                with contextlib.suppress(OSError):
                    _holds.hold_path(root, step_name(step)).unlink(missing_ok=True)
    finally:
        for fd in locks:
            os.close(fd)
    return doomed


def remove_tmp(tmp: Path) -> None:
    """Remove a save's temporary folder after it failed or was abandoned."""
    shutil.rmtree(tmp, ignore_errors=True)
