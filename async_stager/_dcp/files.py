"""Files DCP writes, and a full disk: the errno of a filesystem without room found in
any exception chain, and the file being written named in it.

A full filesystem reaches a save as an OSError without a file name (``ENOSPC`` from
``write``, ``flush``, ``fsync`` or ``close``), often buried: torch's zip writer turns a
failed write into ``RuntimeError: ... unexpected pos 704 vs 598`` (the OSError only in
its ``__context__``), and DCP wraps each rank's error in a ``CheckpointException``
whose text is a traceback per rank. ``disk_full_in`` digs the OSError out of any of
these; ``naming_file`` gives it the file being written; ``naming_file_system`` and
``naming_writer`` are DCP's local file system and writer whose streams do that for
every file they write (the data files and ``.metadata``).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
from collections.abc import Iterator
from typing import Any

__all__ = ["FULL_ERRNOS", "disk_full_in", "naming_file", "naming_file_system", "naming_writer"]

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


@functools.cache
def naming_file_system() -> type[Any]:
    """DCP's local ``FileSystem`` whose streams name their file in a full disk's error
    (a class, made at the first call: DCP is slow to import)."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    class NamingFileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
            with naming_file(path), super().create_stream(path, mode) as stream:
                yield stream

    return NamingFileSystem


@functools.cache
def _writer_class() -> type[Any]:
    from torch.distributed.checkpoint import FileSystemWriter

    class NamingWriter(FileSystemWriter):
        def __init__(self, path: str, **kwargs: Any) -> None:
            super().__init__(path, **kwargs)
            self.fs = naming_file_system()()

    return NamingWriter


def naming_writer(path: str | os.PathLike[str], **kwargs: Any) -> Any:
    """DCP's ``FileSystemWriter(path, **kwargs)`` whose full-disk errors name their file."""
    return _writer_class()(os.fspath(path), **kwargs)
