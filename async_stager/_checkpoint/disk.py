"""A checkpoint write that fails for want of disk space says so, and names its file.

A full filesystem reaches a save as an OSError without a file name (``ENOSPC``, from
``write``, ``flush``, ``fsync`` or ``close``), often buried: torch's zip writer turns a
failed write into ``RuntimeError: ... unexpected pos 704 vs 598`` (the OSError only in
its ``__context__``), and DCP wraps each rank's error in a ``CheckpointException``
whose text is a traceback per rank. ``disk_full_in`` digs the OSError out of any of
these; ``naming_file`` gives it the file being written; ``write_failure`` is the
message a failed save's CheckpointError carries (one line for a person: the disk is
full, which file, what to do; a DCP failure described by its ranks' errors, not their
tracebacks).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
from collections.abc import Iterator
from typing import Any

__all__ = ["FULL_ERRNOS", "dcp_writer", "disk_full_in", "failure_reason", "naming_file", "write_failure"]

#: errnos of a filesystem without room: no space, quota, a file size limit.
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def _inner(exc: BaseException) -> list[BaseException]:
    """The exceptions ``exc`` carries: its cause and context, a group's members, and
    each rank's error of DCP's ``CheckpointException`` (``failures``)."""
    out: list[BaseException] = []
    for e in (exc.__cause__, exc.__context__):
        if e is not None:
            out.append(e)
    out.extend(e for e in getattr(exc, "exceptions", ()) or () if isinstance(e, BaseException))
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        for wrapped in failures.values():
            inner = wrapped[0] if isinstance(wrapped, tuple) and wrapped else wrapped
            if isinstance(inner, BaseException):
                out.append(inner)
    return out


def disk_full_in(exc: BaseException) -> OSError | None:
    """The OSError of a full filesystem (``FULL_ERRNOS``) in ``exc``'s chain, one with a
    file name first; None if there is none."""
    found: OSError | None = None
    todo: list[BaseException] = [exc]
    seen: set[int] = set()
    while todo and len(seen) < 256:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in FULL_ERRNOS:
            if e.filename:
                return e
            found = found or e
        todo.extend(_inner(e))
    return found


@contextlib.contextmanager
def naming_file(path: str | os.PathLike[str]) -> Iterator[None]:
    """Writes to ``path`` inside the block: a full disk's error, however wrapped, comes
    out as ``OSError(ENOSPC, ..., path)`` with the original as its cause."""
    try:
        yield
    except Exception as exc:
        full = disk_full_in(exc)
        if full is None or (full is exc and full.filename):
            raise
        raise OSError(full.errno, full.strerror or os.strerror(full.errno or 0), os.fspath(path)) from exc


def _first_line(text: str, limit: int = 200) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    line = lines[0] if lines else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _describe(exc: BaseException) -> str:
    """One line: DCP's CheckpointException by its ranks' errors, anything else by its
    first line."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for rank, wrapped in sorted(failures.items(), key=lambda kv: str(kv[0])):
            inner = wrapped[0] if isinstance(wrapped, tuple) and wrapped else wrapped
            text = _describe(inner) if isinstance(inner, BaseException) else str(inner)
            parts.append(f"rank {rank}: {text}")
        return "; ".join(parts[:4]) + ("; ..." if len(parts) > 4 else "")
    text = _first_line(str(exc))
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def failure_reason(exc: BaseException, folder: str | os.PathLike[str] | None = None) -> str:
    """Why a write or commit failed, in one line: for a full disk, that it is full, the
    file (or ``folder`` when the error names none) and what to do."""
    full = disk_full_in(exc)
    if full is not None:
        where = full.filename or folder
        target = f" writing {os.fspath(where)}" if where else ""
        reason = full.strerror or os.strerror(full.errno or errno.ENOSPC)
        return (
            f"the disk is full ({reason}, errno {full.errno}){target}. Nothing was committed for "
            "this step and its temporary files were removed; the newest earlier commit stays the "
            "one restore() loads. Free space there (or keep fewer checkpoints: keep=) and save again"
        )
    return _describe(exc)


def write_failure(step: int, exc: BaseException, folder: str | os.PathLike[str] | None = None) -> str:
    """The message of the CheckpointError for step ``step``'s failed write or commit
    (``exc`` is chained as its cause by the caller). ``folder``: the step's folder, named
    when the full disk's error names no file."""
    return f"checkpoint step {step} failed: {failure_reason(exc, folder)}"


@functools.cache
def _writer_class() -> type[Any]:
    """DCP's ``FileSystemWriter`` whose streams name their file in a full disk's error."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    class NamingFileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
            with naming_file(path), super().create_stream(path, mode) as stream:
                yield stream

    class NamingWriter(FileSystemWriter):
        def __init__(self, path: str) -> None:
            # per_thread_copy_ahead=0: the host loader, as ``_dcp.blocking.host_writer``.
            super().__init__(path, per_thread_copy_ahead=0)
            self.fs = NamingFileSystem()

    return NamingWriter


def dcp_writer(path: str | os.PathLike[str]) -> Any:
    """A DCP storage writer for a step folder on a local path: DCP's own
    ``FileSystemWriter`` (the host loader), whose full-disk errors name their file."""
    return _writer_class()(os.fspath(path))
