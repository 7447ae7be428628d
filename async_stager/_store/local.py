"""The folder backend: a store in a local folder (``file://``, and the tests' fake of
S3 with the same visible semantics).

An object is a file under the root (``a/b`` is ``ROOT/a/b``). A write goes to a hidden
file beside it (``.NAME.upload-ID``) that is fsynced, then renamed over ``NAME``: the
object appears whole or not at all, as on S3. A writer killed mid-write leaves that
hidden file: an unfinished upload (``list_uploads``), never an object (``list`` skips
it). ``put_record(if_absent=True)`` links the hidden file to its name, which fails if
the name exists: exactly one of two racing writers wins, on any POSIX filesystem.

File I/O runs in a small pool of threads (``concurrency`` of them, named
``async-stager-store-file``); the bytes go from the caller's buffers straight to the
file (no copy is made, so no budget is taken). Errors: ENOSPC/EDQUOT/EFBIG are
``reason="quota"``, EACCES/EPERM/EROFS ``"denied"``, ENOENT ``"missing"``.
"""

from __future__ import annotations

import asyncio
import datetime
import errno
import functools
import os
import re
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from async_stager._store.backend import Backend, BackendWriter, Progress
from async_stager._store.budget import ByteBudget
from async_stager._store.objects import ObjectInfo, Payload, TransferOptions, UploadInfo
from async_stager._store.retry import Failure, store_error
from async_stager.errors import StoreError

__all__ = ["FolderBackend"]

T = TypeVar("T")

_UPLOAD = re.compile(r"^\.(?P<name>.+)\.upload-[0-9a-f]{32}$")

_REASONS = {
    errno.ENOSPC: "quota",
    errno.EDQUOT: "quota",
    errno.EFBIG: "quota",
    errno.EACCES: "denied",
    errno.EPERM: "denied",
    errno.EROFS: "denied",
    errno.ENOENT: "missing",
}


def _failure(exc: OSError) -> Failure:
    code = errno.errorcode.get(exc.errno or 0, "OSError")
    return Failure(_REASONS.get(exc.errno or 0, "request"), code, exc.strerror or str(exc), transient=False)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FolderBackend(Backend):
    """Objects under a local folder (made at the first write)."""

    def __init__(self, root: str | os.PathLike[str], options: TransferOptions) -> None:
        self.path = Path(root).absolute()
        self.root = self.path.as_uri().rstrip("/") + "/"
        self.options = options
        self._pool: ThreadPoolExecutor | None = None

    async def _run(self, fn: Callable[[], T]) -> T:
        """``fn()`` in the pool. Cancellation: waits for ``fn`` to return first (a file
        being written is never closed or removed under its writing thread)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                self.options.concurrency, thread_name_prefix="async-stager-store-file"
            )
        fut = asyncio.get_running_loop().run_in_executor(self._pool, fn)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            if not fut.done():
                await asyncio.wait([fut])
            raise

    async def _do(self, op: str, key: str, fn: Callable[[], T]) -> T:
        try:
            return await self._run(fn)
        except OSError as exc:
            raise store_error(op, self.url(key), _failure(exc)) from exc

    def _file(self, key: str) -> Path:
        return self.path.joinpath(*key.split("/"))

    def _temp(self, key: str) -> Path:
        final = self._file(key)
        return final.with_name(f".{final.name}.upload-{uuid.uuid4().hex}")

    async def put(
        self, key: str, payload: Payload, budget: ByteBudget, progress: Progress | None
    ) -> ObjectInfo:
        final, temp = self._file(key), self._temp(key)
        step = self.options.part_size

        def open_temp() -> int:
            final.parent.mkdir(parents=True, exist_ok=True)
            return os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)

        fd = await self._do("writing", key, open_temp)
        try:
            for view in payload.views:
                for start in range(0, view.nbytes, step):
                    piece = view[start : start + step]

                    def write(piece: memoryview = piece) -> None:
                        while piece.nbytes:
                            piece = piece[os.write(fd, piece) :]

                    await self._do("writing", key, write)
                    if progress is not None:
                        progress(piece.nbytes)

            def finish() -> os.stat_result:
                os.fsync(fd)
                os.replace(temp, final)
                _fsync_dir(final.parent)
                return os.stat(final)

            st = await self._do("writing", key, finish)
        except BaseException:
            await self._run(lambda: temp.unlink(missing_ok=True))
            raise
        finally:
            os.close(fd)
        return self._info(key, st)

    def open_writer(
        self, key: str, budget: ByteBudget, progress: Progress | None, size_hint: int | None
    ) -> BackendWriter:
        return FolderWriter(self, key, progress)

    async def put_record(self, key: str, data: bytes, if_absent: bool) -> ObjectInfo:
        final, temp = self._file(key), self._temp(key)

        def write() -> os.stat_result:
            final.parent.mkdir(parents=True, exist_ok=True)
            try:
                with open(temp, "xb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                if if_absent:
                    os.link(temp, final)  # fails if final exists: one writer wins
                else:
                    os.replace(temp, final)
            finally:
                temp.unlink(missing_ok=True)
            _fsync_dir(final.parent)
            return os.stat(final)

        try:
            st = await self._run(write)
        except FileExistsError as exc:
            failure = Failure("exists", "EEXIST", "the record is there already", transient=False)
            raise store_error("writing the record", self.url(key), failure) from exc
        except OSError as exc:
            raise store_error("writing the record", self.url(key), _failure(exc)) from exc
        return self._info(key, st)

    async def get_into(self, key: str, dest: memoryview, offset: int) -> int:
        def read() -> int:
            with open(self._file(key), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if offset + dest.nbytes > size:
                    raise StoreError(
                        f"reading {self.url(key)} was refused (InvalidRange: the object is {size} bytes: "
                        f"reading bytes {offset} to {offset + dest.nbytes} passes its end)",
                        key=self.url(key),
                        reason="request",
                        code="InvalidRange",
                    )
                got = 0
                while got < dest.nbytes:
                    n = os.preadv(f.fileno(), [dest[got:]], offset + got)
                    if n == 0:
                        raise StoreError(
                            f"reading {self.url(key)} failed (the file shrank while read)",
                            key=self.url(key),
                            reason="request",
                        )
                    got += n
                return got

        return await self._do("reading", key, read)

    def _info(self, key: str, st: os.stat_result) -> ObjectInfo:
        modified = datetime.datetime.fromtimestamp(st.st_mtime, datetime.timezone.utc)
        return ObjectInfo(key, st.st_size, f"{st.st_mtime_ns:x}-{st.st_size:x}-{st.st_ino:x}", modified)

    async def head(self, key: str) -> ObjectInfo | None:
        def stat() -> os.stat_result | None:
            try:
                st = os.stat(self._file(key))
            except FileNotFoundError:
                return None
            except NotADirectoryError:
                return None
            return st if os.path.isfile(self._file(key)) else None

        st = await self._do("reading the size of", key, stat)
        return None if st is None else self._info(key, st)

    def _walk(self, prefix: str, uploads: bool) -> list[tuple[str, Path]]:
        """(key, path) of every object (or unfinished upload) whose key starts with
        ``prefix``, walking only below the folder the prefix names."""
        base = prefix.rpartition("/")[0]
        top = self.path.joinpath(*base.split("/")) if base else self.path
        out = []
        for dirpath, _dirs, files in os.walk(top):
            rel = Path(dirpath).relative_to(self.path).as_posix()
            for name in files:
                match = _UPLOAD.match(name)
                if bool(match) != uploads:
                    continue
                shown = match.group("name") if match else name
                key = shown if rel == "." else f"{rel}/{shown}"
                if key.startswith(prefix):
                    out.append((key, Path(dirpath, name)))
        return sorted(out)

    async def list_objects(self, prefix: str) -> list[ObjectInfo]:
        def scan() -> list[ObjectInfo]:
            out = []
            for key, path in self._walk(prefix, uploads=False):
                try:
                    out.append(self._info(key, os.stat(path)))
                except FileNotFoundError:
                    pass  # deleted meanwhile
            return out

        return await self._do("listing", prefix, scan)

    async def delete(self, keys: Sequence[str]) -> None:
        def remove(key: str) -> None:
            path = self._file(key)
            path.unlink(missing_ok=True)
            # Folders are no objects: the emptied ones go too (S3 has none to leave).
            parent = path.parent
            while parent != self.path and parent.is_relative_to(self.path):
                try:
                    parent.rmdir()
                except OSError:
                    break
                parent = parent.parent

        for key in keys:
            await self._do("deleting", key, functools.partial(remove, key))

    async def list_uploads(self, prefix: str) -> list[UploadInfo]:
        def scan() -> list[UploadInfo]:
            out = []
            for key, path in self._walk(prefix, uploads=True):
                try:
                    mtime = os.stat(path).st_mtime
                except FileNotFoundError:
                    continue
                modified = datetime.datetime.fromtimestamp(mtime, datetime.timezone.utc)
                out.append(UploadInfo(key, path.name, modified))
            return out

        return await self._do("listing the unfinished uploads of", prefix, scan)

    async def abort_uploads(self, uploads: Sequence[UploadInfo]) -> int:
        def remove(u: UploadInfo) -> int:
            path = self._file(u.key).with_name(u.upload_id)
            if not _UPLOAD.match(u.upload_id):
                return 0
            try:
                path.unlink()
            except FileNotFoundError:
                return 0
            return 1

        n = 0
        for u in uploads:
            n += await self._do("aborting the upload of", u.key, functools.partial(remove, u))
        return n

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)  # at close nothing else runs on this loop


class FolderWriter(BackendWriter):
    """A file written as a stream: to its hidden upload file, renamed over its name at
    ``close`` (fsynced first); ``abort`` removes the hidden file."""

    def __init__(self, backend: FolderBackend, key: str, progress: Progress | None) -> None:
        self.backend, self.key, self.progress = backend, key, progress
        self.final, self.temp = backend._file(key), backend._temp(key)
        self.fd: int | None = None
        self.done = False

    async def _open(self) -> int:
        if self.done:
            url = self.backend.url(self.key)
            raise StoreError(f"writing {url}: the writer is closed", key=url, reason="closed")
        if self.fd is None:

            def open_temp() -> int:
                self.final.parent.mkdir(parents=True, exist_ok=True)
                return os.open(self.temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)

            self.fd = await self.backend._do("writing", self.key, open_temp)
        return self.fd

    async def write(self, view: memoryview) -> None:
        fd = await self._open()
        step = self.backend.options.part_size
        for start in range(0, view.nbytes, step):
            piece = view[start : start + step]

            def write(piece: memoryview = piece) -> None:
                while piece.nbytes:
                    piece = piece[os.write(fd, piece) :]

            await self.backend._do("writing", self.key, write)
            if self.progress is not None:
                self.progress(piece.nbytes)

    async def close(self) -> ObjectInfo:
        fd = await self._open()
        final = self.final

        def finish() -> os.stat_result:
            os.fsync(fd)
            os.replace(self.temp, final)
            _fsync_dir(final.parent)
            return os.stat(final)

        try:
            st = await self.backend._do("writing", self.key, finish)
        except BaseException:
            await self.abort()
            raise
        self.done = True
        self.fd = None
        os.close(fd)
        return self.backend._info(self.key, st)

    async def abort(self) -> None:
        self.done = True
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)
            await self.backend._run(lambda: self.temp.unlink(missing_ok=True))
