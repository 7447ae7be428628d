"""A writer's session on a Checkpointer directory, and the cleaning of what dead writers
left (see ``commit``'s docstring for the layout).

``Session.open`` creates the folder if needed and takes the writer lock that marks its
temporary folders as live: ``DIR/.writer-<token>``, flock'ed for the session, so a
second Checkpointer on the folder never deletes a live writer's files; then it removes
what dead writers left (``clean_stale``). A folder that can be read but not written
(a read-only mount, a folder its owner made read-only, a disk without a free inode or
over a quota) gives a ``ReadOnly`` instead: the Checkpointer opens for restore only.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import secrets
import shutil
from pathlib import Path

from async_stager._checkpoint import holds as _holds
from async_stager._checkpoint.commit import (
    LATEST,
    committed_steps,
    folder_lock,
    fsync_dir,
    read_latest,
    write_latest,
)
from async_stager._checkpoint.ranks import Ranks
from async_stager._core.aio.threads import run_in_thread
from async_stager.errors import CheckpointError

__all__ = ["ReadOnly", "Session", "clean_stale", "meet", "remove_own_leftovers"]

_log = logging.getLogger("async_stager.checkpoint")

# A leftover of a writer: .tmp-/.old-/.del- + step-N + .<token>[.<seq>]
_LEFTOVER = re.compile(r"^\.(tmp|old|del)-(step-\d{8,})(?:\.([0-9a-f]+)(?:\.\d+)?)?$")
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)


class Session:
    """A writer's hold on a Checkpointer directory: the ``.writer-<token>`` lock that
    marks its temporary folders as live (see the module docstring).

    ``open`` returns a ``ReadOnly`` when the folder cannot be written (read-only, or no
    room for a new file): the caller then opens for restore only."""

    def __init__(self, root: Path, token: str, fd: int, *, created: bool = False) -> None:
        self.root = root
        self.token = token
        self._fd: int | None = fd
        #: The folder did not exist: this open made it.
        self.created = created

    @classmethod
    def open(cls, root: Path) -> Session | ReadOnly:
        """Create the folder if needed, take a writer lock and clean what dead writers
        left (all under ``folder_lock``, so a cleaner never sees a new writer's lock
        file before it is locked). A ``ReadOnly`` (why) if the folder cannot be written
        or the disk has no room for a new file (no free inode, a quota): restore needs
        neither. Worker thread."""
        created = not root.exists()
        try:
            root.mkdir(parents=True, exist_ok=True)
            lock = folder_lock(root)
            lock.__enter__()
        except CheckpointError as exc:  # ``.lock`` is a folder or a broken link
            raise CheckpointError(f"{root} cannot hold checkpoints: {exc}") from exc.__cause__
        except OSError as exc:
            why = _why_read_only(root, exc)
            if why is not None:
                return ReadOnly(why, created=False)
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
            try:
                fd = os.open(root / f".writer-{token}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except OSError as exc:
                # ``DIR/.lock`` was there to open, but no new file can be made: a folder
                # its owner made read-only, a disk without a free inode.
                why = _why_read_only(root, exc)
                if why is None:
                    raise
                return ReadOnly(why, created=created)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody holds it
            session = cls(root, token, fd, created=created)
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


class ReadOnly:
    """What ``Session.open`` returns for a folder it can read but not write: ``why``
    (for ``save``'s error and the log), and whether this open created it."""

    def __init__(self, why: str, *, created: bool) -> None:
        self.why = why
        self.created = created


def _why_read_only(root: Path, exc: OSError) -> str | None:
    """Why ``root`` opens for restore only, for a person; None when ``exc`` is no
    reason to (another failure)."""
    name = Path(exc.filename).name if exc.filename else ""
    if exc.errno in _READ_ONLY:
        return f"{root} is not writable ({exc.strerror or exc}{': ' + name if name else ''})"
    if exc.errno in _holds.NO_ROOM:
        return (
            f"no new file can be made in {root} ({exc.strerror or exc}, errno {exc.errno}: no free "
            "inode, or a quota reached); free some and open the Checkpointer again to save"
        )
    return None


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
    A live writer's folders are left alone; an entry that cannot be cleaned (a folder
    where a lock file belongs) is a warning naming it, and stays."""
    for name in os.listdir(root):
        try:
            _clean_one(root, name)
        except (OSError, CheckpointError) as exc:
            why = _holds.describe_damage(root / name, exc) if isinstance(exc, OSError) else str(exc)
            _log.warning("%s: %s left as it is: %s", root, name, why)
    fsync_dir(root)
    steps = committed_steps(root)
    if steps and read_latest(root) != steps[-1]:
        write_latest(root, steps[-1])


def _clean_one(root: Path, name: str) -> None:
    """``clean_stale`` for one entry of ``root``."""
    path = root / name
    if name.startswith(".writer-"):
        if not _writer_alive(root, name.removeprefix(".writer-")):
            path.unlink(missing_ok=True)
        return
    if name == f".{LATEST}.tmp":
        path.unlink(missing_ok=True)
        return
    if name.startswith(_holds.HOLD_PREFIX):
        final = name.removeprefix(_holds.HOLD_PREFIX)
        got = None if (root / final).is_dir() else _holds.try_exclusive(root, final)
        if got is not None and not isinstance(got, bool):
            path.unlink(missing_ok=True)  # its step is gone and nobody reads it
            os.close(got)
        return
    m = _LEFTOVER.match(name)
    if m is None:
        return
    kind, final, token = m.group(1), m.group(2), m.group(3)
    if kind == "del":
        shutil.rmtree(path, ignore_errors=True)
    elif _writer_alive(root, token):
        return
    elif kind == "tmp" or (root / final).exists():
        shutil.rmtree(path, ignore_errors=True)
    else:
        os.rename(path, root / final)


async def meet(root: Path, ranks: Ranks) -> tuple[Session | None, bool | None, str]:
    """A Checkpointer's open, across its ranks: the coordinator opens the folder's
    session; every rank learns the session's token (``?why``: the folder is open for
    restore only). Returns the coordinator's session (None on the other ranks, or read
    only), whether its open created the folder (None where it did not open it) and the
    token. Raises the coordinator's CheckpointError on every rank (none waits for the
    others). Cancellation: deferred until the thread of the open (or of the broadcast)
    returns, then raised; a session opened before the broadcast is closed first (one
    whose open was cancelled is lost: its writer lock stays until the process exits,
    and only marks its own temporary folders as live)."""
    token = ""
    session: Session | None = None
    created: bool | None = None
    if ranks.coordinator:
        try:
            opened = await run_in_thread(lambda: Session.open(root), name="async-stager-open")
        except CheckpointError as exc:
            if not ranks.distributed:
                raise
            token = "!" + str(exc)  # every rank raises it, none waits for the others
        else:
            created = opened.created
            if isinstance(opened, ReadOnly):
                _log.warning("%s: open for restore only: %s", root, opened.why)
                token = "?" + opened.why
            else:
                session, token = opened, opened.token
    try:
        token = await run_in_thread(lambda: ranks.broadcast(token), name="async-stager-open")
    except BaseException:
        if session is not None:
            session.close()
        raise
    if token.startswith("!"):
        raise CheckpointError(token[1:])
    return session, created, token
