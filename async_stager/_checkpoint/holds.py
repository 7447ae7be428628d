"""Readers' holds on committed steps: what keeps a step from vanishing or changing
under a restore (an evaluation job beside a trainer, a restore beside this process's
own saves).

``DIR/.hold-step-N`` is a lock file per committed step. A reader (``restore``, in any
process) holds a shared ``flock`` on it while it verifies and loads step N. A writer:

- retires step N (retention) only if it gets the exclusive lock at once; a held step
  stays committed and is retired by a later retention, once no reader holds it;
- commits step N (a new step, or one replacing the committed step N) holding the
  exclusive lock: a replacement waits until the readers of the old step N are done,
  and no new reader starts on it meanwhile.

Lock order (no wait in a circle, on one rank or several): a writer takes a step's
hold before ``DIR/.lock``, and waits for it holding nothing else; a reader takes
``DIR/.lock`` (to list the commits and take its hold as one step) and then the hold
without blocking, retrying after a pause if a writer has it.

A folder this process cannot write (a read-only mount, another user's folder) may lack
the lock files; a reader then reads without a hold, and a step that vanished or
changed while it read is told apart from a damaged one by its commit record
(``restore``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from async_stager.errors import CheckpointError

__all__ = [
    "HOLD_PREFIX",
    "NO_ROOM",
    "describe_damage",
    "exclusive",
    "flock_exclusive",
    "hold_path",
    "holders",
    "open_lock_file",
    "shared_now",
    "try_exclusive",
]

HOLD_PREFIX = ".hold-"
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)
#: A new file cannot be made: no free inode (ENOSPC), a quota (EDQUOT). An existing
#: file still opens, and a folder on such a disk still reads.
NO_ROOM = (errno.ENOSPC, errno.EDQUOT)


def hold_path(root: Path, name: str) -> Path:
    """The hold file of committed folder ``name`` (``step-N``)."""
    return root / f"{HOLD_PREFIX}{name}"


def describe_damage(path: str | os.PathLike[str], exc: OSError) -> str:
    """Why lock file ``path`` could not be opened, for a person: a folder or a broken
    link where the lock file belongs (and what to do), else the error."""
    if exc.errno == errno.EISDIR or (exc.errno == errno.ENOTDIR and os.path.isdir(path)):
        return f"{os.fspath(path)} is a folder, where a lock file belongs: move it away"
    if os.path.islink(path) and exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        return (
            f"{os.fspath(path)} is a symbolic link to {target}, which cannot be opened "
            f"({exc.strerror or exc}), where a lock file belongs: remove the link"
        )
    return f"{exc.strerror or exc}: {os.fspath(path)}"


def _damaged(path: str | os.PathLike[str], exc: OSError) -> CheckpointError | None:
    """A CheckpointError saying so when ``path`` is a folder or a broken link (not a
    lock file any process can open), else None."""
    if exc.errno == errno.EISDIR or (os.path.islink(path) and not os.path.exists(path)):
        return CheckpointError(describe_damage(path, exc))
    return None


def open_lock_file(path: Path) -> int | None:
    """A descriptor to ``flock`` ``path`` with: created if missing; opened read-only
    when the folder cannot be written (``flock`` works on such a descriptor) or the disk
    has no room for a new file (no free inode, a quota); None when it neither exists
    nor can be created (nothing to lock: a folder that can only be read). Raises
    CheckpointError when ``path`` is a folder or a broken link."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        damaged = _damaged(path, exc)
        if damaged is not None:
            raise damaged from exc
        if exc.errno not in (*_READ_ONLY, *NO_ROOM):
            raise
    try:
        return os.open(path, os.O_RDONLY)
    except OSError as exc:
        if exc.errno in (*_READ_ONLY, errno.ENOENT):
            return None
        raise


@contextlib.contextmanager
def flock_exclusive(
    path: str | os.PathLike[str], waiting: Callable[[list[int] | None], None] | None = None
) -> Iterator[None]:
    """Hold ``path`` (created if missing) under an exclusive ``flock`` for the block,
    waiting for it (blocking; a worker thread). ``waiting`` is called with the pids
    holding it (``holders``) before a wait, if it must wait, and with None after it. Raises CheckpointError
    when ``path`` is a folder or a broken link."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        damaged = _damaged(path, exc)
        if damaged is not None:
            raise damaged from exc
        raise
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting is not None:
                waiting(holders(fd))
            fcntl.flock(fd, fcntl.LOCK_EX)
            if waiting is not None:
                waiting(None)
        yield
    finally:
        os.close(fd)  # drops the lock


def holders(fd: int) -> list[int]:
    """The pids holding a ``flock`` on the file open as ``fd`` (``/proc/locks``; a best
    effort: empty where that cannot be read)."""
    try:
        st = os.fstat(fd)
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    me = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids: list[int] = []
    for line in lines:
        parts = line.split()
        # "1: FLOCK  ADVISORY  READ  12345 08:01:1234567 0 EOF" (a waiter: "-> FLOCK ...")
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == me and parts[4].isdigit():
            pid = int(parts[4])
            if pid not in pids:
                pids.append(pid)
    return pids


@contextlib.contextmanager
def exclusive(
    root: Path, name: str, waiting: Callable[[list[int] | None], None] | None = None
) -> Iterator[None]:
    """Writer, before ``DIR/.lock``: wait until no reader holds ``name`` and keep new
    readers off it for the block (blocking; a worker thread); ``waiting`` is called
    with the readers' pids before it waits, if it must. If ``name`` is not a committed
    folder after the block (its commit failed), its hold file is removed, still
    locked: a reader only holds a committed step's (a failed commit left it behind
    until the next open)."""
    path = hold_path(root, name)
    with flock_exclusive(path, waiting):
        try:
            yield
        finally:
            if not (root / name).is_dir():
                with contextlib.suppress(OSError):
                    path.unlink(missing_ok=True)


def try_exclusive(root: Path, name: str) -> int | bool | None:
    """Writer, holding ``DIR/.lock`` (retention): the exclusive lock on ``name``'s hold
    if no reader holds it, as a descriptor to close once the step and its hold file are
    removed; True when it has no hold file (no reader ever held it); None when a reader
    holds it now."""
    try:
        fd = os.open(hold_path(root, name), os.O_RDWR)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def shared_now(root: Path, name: str) -> int | None:
    """Reader, holding ``DIR/.lock``: a shared lock on ``name``'s hold, as a descriptor
    (close it to let go); None when the folder has no lock files to hold. Raises
    BlockingIOError when a writer holds it (replacing the step): retry after a pause,
    without ``DIR/.lock``."""
    fd = open_lock_file(hold_path(root, name))
    if fd is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd
