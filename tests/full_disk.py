"""A full disk, simulated at the lowest layer the code under test writes through.

``full_disk(monkeypatch, folder)`` makes every write to a file under ``folder`` fail as
a full filesystem does (``OSError(ENOSPC, "No space left on device")``, no filename:
the kernel gives none), whichever way it is written: ``os.write``/``os.pwrite`` on a
descriptor, a Python file object opened by ``open``/``Path.open``/``io.open``, or
``torch.save`` to a path or a file. Writes elsewhere go on. Unprivileged and
deterministic; ``after`` bytes may be written first (a disk that fills mid-file).
"""

from __future__ import annotations

import builtins
import errno
import io
import os
from pathlib import Path
from typing import Any

import pytest
import torch

__all__ = ["FullDisk", "full_disk"]


class FullDisk:
    """The state of one simulated full disk: ``folder`` and the bytes still allowed."""

    def __init__(self, folder: Path, after: int) -> None:
        self.folder = os.path.realpath(folder)
        self.left = after
        self.refused = 0  # writes refused so far

    def covers(self, name: str | os.PathLike[str] | int | None) -> bool:
        if isinstance(name, int):
            try:
                name = os.readlink(f"/proc/self/fd/{name}")
            except OSError:
                return False
        if name is None:
            return False
        real = os.path.realpath(os.fspath(name))
        return real == self.folder or real.startswith(self.folder + os.sep)

    def take(self, n: int) -> int:
        """How many of ``n`` bytes fit; raises ENOSPC when none do."""
        if n == 0:
            return 0
        if self.left <= 0:
            self.refused += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        k = min(n, self.left)
        self.left -= k
        return k


class _FullFile(io.RawIOBase):
    """A raw file on the full disk: reads and seeks go to the real file, writes take
    room from the disk first."""

    def __init__(self, fd: int, disk: FullDisk) -> None:
        self._fd = fd
        self._disk = disk

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        data = os.read(self._fd, len(b))
        b[: len(data)] = data
        return len(data)

    def write(self, b: Any) -> int:
        data = bytes(b)
        k = self._disk.take(len(data))
        return os.write(self._fd, data[:k])

    def seek(self, pos: int, whence: int = 0) -> int:
        return os.lseek(self._fd, pos, whence)

    def tell(self) -> int:
        return os.lseek(self._fd, 0, os.SEEK_CUR)

    def truncate(self, size: int | None = None) -> int:
        size = self.tell() if size is None else size
        os.ftruncate(self._fd, size)
        return size

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()


def full_disk(monkeypatch: pytest.MonkeyPatch, folder: Path, *, after: int = 0) -> FullDisk:
    """Make ``folder`` (and everything under it) a full disk for the rest of the test."""
    disk = FullDisk(folder, after)
    real_write, real_pwrite, real_open = os.write, os.pwrite, builtins.open
    real_save = torch.save

    def write(fd: int, data: Any) -> int:
        if disk.covers(fd):
            k = disk.take(len(data))
            return real_write(fd, bytes(data)[:k])
        return real_write(fd, data)

    def pwrite(fd: int, data: Any, offset: int) -> int:
        if disk.covers(fd):
            k = disk.take(len(data))
            return real_pwrite(fd, bytes(data)[:k], offset)
        return real_pwrite(fd, data, offset)

    def open_(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if isinstance(file, int) or not any(c in mode for c in "wax+") or not disk.covers(file):
            return real_open(file, mode, *args, **kwargs)
        flags = os.O_CLOEXEC | (os.O_RDWR if "+" in mode or "r" in mode else os.O_WRONLY)
        if "w" in mode:
            flags |= os.O_CREAT | os.O_TRUNC
        elif "a" in mode:
            flags |= os.O_CREAT | os.O_APPEND
        elif "x" in mode:
            flags |= os.O_CREAT | os.O_EXCL
        raw = _FullFile(os.open(file, flags, 0o666), disk)
        buffered = io.BufferedRandom(raw)
        if "b" in mode:
            return buffered
        return io.TextIOWrapper(buffered, encoding=kwargs.get("encoding") or "utf-8")

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        # torch.save to a path writes from C++; through a Python file it is seen above.
        if isinstance(f, (str, os.PathLike)) and disk.covers(f):
            with open_(f, "wb") as fh:
                real_save(obj, fh, *args, **kwargs)
            return
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(io, "open", open_)
    monkeypatch.setattr(torch, "save", save)
    return disk
