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
on the file system (local disks do; some network file systems do not).

A folder the process cannot write (read-only mount, archive) opens for restore only:
nothing is cleaned, locked or repaired there.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import secrets
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from async_stager._checkpoint import holds as _holds
from async_stager.errors import CheckpointError

__all__ = [
    "COMMIT",
    "LATEST",
    "Session",
    "StepGone",
    "clean_stale",
    "commit",
    "committed_steps",
    "folder_lock",
    "fsync_dir",
    "read_latest",
    "reading",
    "recorded_layout",
    "remove_own_leftovers",
    "remove_tmp",
    "retain",
    "step_dir",
    "step_name",
    "steps_for_reading",
    "tmp_dir",
    "unordered_steps",
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
# A leftover of a writer: .tmp-/.old-/.del- + step-N + .<token>[.<seq>]
_LEFTOVER = re.compile(r"^\.(tmp|old|del)-(step-\d{8,})(?:\.([0-9a-f]+)(?:\.\d+)?)?$")
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)


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


def _write_latest(root: Path, step: int) -> None:
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


class Session:
    """A writer's hold on a Checkpointer directory: the ``.writer-<token>`` lock that
    marks its temporary folders as live (see the module docstring).

    ``open`` returns None when the folder cannot be written (read-only): the caller
    then opens for restore only."""

    def __init__(self, root: Path, token: str, fd: int) -> None:
        self.root = root
        self.token = token
        self._fd: int | None = fd

    @classmethod
    def open(cls, root: Path) -> Session | None:
        """Create the folder if needed, take a writer lock and clean what dead writers
        left (all under ``folder_lock``, so a cleaner never sees a new writer's lock
        file before it is locked). None if the folder is read-only. Worker thread."""
        try:
            root.mkdir(parents=True, exist_ok=True)
            lock = folder_lock(root)
            lock.__enter__()
        except OSError as exc:
            if exc.errno in _READ_ONLY:
                return None
            raise _unusable(root, exc) from exc
        latest = root / LATEST
        if latest.exists() and not latest.is_file():
            lock.__exit__(None, None, None)
            raise CheckpointError(
                f"{root} cannot hold checkpoints: its {LATEST!r} is not a file (a folder of that "
                "name? move it away)"
            )
        try:
            token = secrets.token_hex(6)
            fd = os.open(root / f".writer-{token}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody holds it
            session = cls(root, token, fd)
            try:
                clean_stale(root)
            except BaseException:
                session.close()
                raise
            return session
        finally:
            lock.__exit__(None, None, None)

    def close(self) -> None:
        """Give the lock up and remove its file (idempotent). A crash skips this; the
        kernel drops the lock, and the next cleaning removes the file."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        with contextlib.suppress(OSError):
            (self.root / f".writer-{self.token}").unlink()
        os.close(fd)


def _unusable(root: Path, exc: OSError) -> CheckpointError:
    """Why ``root`` cannot be opened for checkpoints, as a CheckpointError."""
    name = Path(exc.filename).name if exc.filename else str(root)
    if exc.errno == errno.EEXIST or (exc.errno == errno.ENOTDIR and root.exists() and not root.is_dir()):
        why = f"{root} is a file, not a folder"
    elif exc.errno == errno.EISDIR:
        why = f"{name!r} in it is a folder, where a lock file belongs (move it away)"
    else:
        why = f"{exc.strerror or exc}: {name}"
    return CheckpointError(f"{root} cannot hold checkpoints: {why}")


def _writer_alive(root: Path, token: str | None) -> bool:
    """Whether the writer ``token`` holds its lock (a live process). A leftover without
    a token (an earlier version's) has no live writer."""
    if token is None:
        return False
    path = root / f".writer-{token}"
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


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
    (tmp / COMMIT).write_text(_canonical(record), encoding="utf-8")
    _fsync_tree(tmp)
    old = root / f".old-{step_name(step)}.{tmp.name.split('.')[2]}"
    if dst.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(dst, old)
    os.rename(tmp, dst)  # the commit point
    fsync_dir(root)
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)
    try:
        _write_latest(root, step)
    except OSError as exc:
        # After the commit point: the step is committed (steps() and restore() read
        # the COMMIT records); ``latest`` is a pointer for people and tools.
        _log.warning("%s: step %d is committed, but %s was not updated: %s", root, step, LATEST, exc)
    return dst


def retain(root: Path, keep: int) -> list[int]:
    """Delete all but the ``keep`` newest commits (after a commit, holding
    ``folder_lock``); returns the steps deleted. The newest commit is never one. A step
    a reader holds (``reading``) is not deleted now: a later retention deletes it once
    no reader holds it (until then ``keep`` is exceeded by the steps being read)."""
    steps = committed_steps(root)
    doomed: list[int] = []
    locks: list[int] = []
    try:
        for step in steps[:-keep] if keep > 0 else []:
            got = _holds.try_exclusive(root, step_name(step))
            if got is None:
                _log.info("%s: step %d is being read: retired by a later commit", root, step)
                continue
            if not isinstance(got, bool):
                locks.append(got)
            os.rename(step_dir(root, step), root / f".del-{step_name(step)}")
            doomed.append(step)
        if doomed:
            fsync_dir(root)
            for step in doomed:
                shutil.rmtree(root / f".del-{step_name(step)}", ignore_errors=True)
                # Removed while locked: a reader that opened it before waits for
                # ``.lock``, then finds the step gone (``reading``).
                _holds.hold_path(root, step_name(step)).unlink(missing_ok=True)
    finally:
        for fd in locks:
            os.close(fd)
    return doomed


def remove_tmp(tmp: Path) -> None:
    """Remove a save's temporary folder after it failed or was abandoned."""
    shutil.rmtree(tmp, ignore_errors=True)


def remove_own_leftovers(root: Path, token: str, live: frozenset[int] = frozenset()) -> None:
    """Remove this writer's ``.tmp-`` folders except those of the saves in ``live``
    (by sequence number): after ``wait()`` and at close, a cancelled save's thread may
    have written into its folder after the folder was removed."""
    prefix = f".{token}."
    try:
        names = os.listdir(root)
    except OSError:  # the folder is gone or replaced: nothing of ours is left there
        return
    for name in names:
        if not name.startswith(".tmp-") or prefix not in name:
            continue
        seq = name.rsplit(".", 1)[-1]
        if not (seq.isdigit() and int(seq) in live):
            shutil.rmtree(root / name, ignore_errors=True)


def clean_stale(root: Path) -> None:
    """Remove what dead writers left behind (holding ``folder_lock``; ``Session.open``
    calls it): their ``.tmp-``
    folders, half-deleted ``.del-`` ones and ``.writer-`` files; put back an ``.old-``
    folder whose replacement never got committed; point ``latest`` at the newest commit.
    A live writer's folders are left alone."""
    for name in os.listdir(root):
        path = root / name
        if name.startswith(".writer-"):
            if not _writer_alive(root, name.removeprefix(".writer-")):
                path.unlink(missing_ok=True)
            continue
        if name == f".{LATEST}.tmp":
            path.unlink(missing_ok=True)
            continue
        if name.startswith(_holds.HOLD_PREFIX):
            final = name.removeprefix(_holds.HOLD_PREFIX)
            got = None if (root / final).is_dir() else _holds.try_exclusive(root, final)
            if got is not None and not isinstance(got, bool):
                path.unlink(missing_ok=True)  # its step is gone and nobody reads it
                os.close(got)
            continue
        m = _LEFTOVER.match(name)
        if m is None:
            continue
        kind, final, token = m.group(1), m.group(2), m.group(3)
        if kind == "del":
            shutil.rmtree(path, ignore_errors=True)
        elif _writer_alive(root, token):
            continue
        elif kind == "tmp" or (root / final).exists():
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.rename(path, root / final)
    fsync_dir(root)
    steps = committed_steps(root)
    if steps and read_latest(root) != steps[-1]:
        _write_latest(root, steps[-1])
