"""``Store``: the face of a backend for callers on asyncio, uvloop, trio or a thread.

``open_store("s3://bucket/prefix")`` or ``open_store("file:///path")`` (a plain path
too) gives a Store; its coroutines run on the store's own I/O loop (ioloop.py), so a
caller's loop only waits. ``store.blocking`` has the same operations for a thread with
no event loop (the Checkpointer's writer). Arguments are checked at the call, in the
caller's thread; the store's errors are ``StoreError``, naming the object.

Cancellation (every coroutine): the operation is cancelled on the I/O loop and its
cleanup awaited before the cancellation is raised: an object being written is then
absent (its upload aborted) or whole, never torn; a read leaves ``dest`` partly written.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

from async_stager._store.backend import Backend, Progress, check_key
from async_stager._store.budget import ByteBudget
from async_stager._store.ioloop import IOLoop
from async_stager._store.local import FolderBackend
from async_stager._store.objects import ObjectInfo, Payload, TransferOptions, UploadInfo, as_view
from async_stager._store.s3 import S3Backend
from async_stager._store.writer import BlockingObjectWriter, ObjectWriter
from async_stager.errors import InvalidOptionError, InvalidOptionTypeError, StoreError

__all__ = ["BlockingStore", "Store", "open_store"]

T = TypeVar("T")
Op = Callable[[], Coroutine[Any, Any, T]]


class Store:
    """Objects under one root (``store.root``: ``s3://bucket/prefix/``, ``file:///path/``).

    ``budget`` bounds the bytes of parts this store's uploads hold at once (shared by
    its concurrent ``put`` calls; a ``put`` may be given another, e.g. one budget for
    several stores). Use ``async with`` or ``aclose()`` (``blocking.close()``)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.options = backend.options
        self.budget = ByteBudget(backend.options.budget)
        self._io = IOLoop(backend.root)
        self.blocking = BlockingStore(self)

    @property
    def root(self) -> str:
        return self.backend.root

    def url(self, key: str) -> str:
        return self.backend.url(key)

    def __repr__(self) -> str:
        return f"Store({self.root!r})"

    # -- the operations, each made once as a coroutine factory for both faces ----------

    def _put(
        self, key: str, data: Any, budget: ByteBudget | None, progress: Progress | None
    ) -> Op[ObjectInfo]:
        check_key(key, self.root)
        payload = Payload(data)
        if budget is not None and not isinstance(budget, ByteBudget):
            raise InvalidOptionTypeError(f"budget: a ByteBudget, not {type(budget).__name__}")
        chosen = self.budget if budget is None else budget
        return lambda: self.backend.put(key, payload, chosen, progress)

    def _open_writer(
        self, key: str, budget: ByteBudget | None, progress: Progress | None, size_hint: int | None
    ) -> ObjectWriter:
        check_key(key, self.root)
        if budget is not None and not isinstance(budget, ByteBudget):
            raise InvalidOptionTypeError(f"budget: a ByteBudget, not {type(budget).__name__}")
        if size_hint is not None and (
            isinstance(size_hint, bool) or not isinstance(size_hint, int) or size_hint < 0
        ):
            raise InvalidOptionError(f"size_hint={size_hint!r}: give None or an int >= 0")
        inner = self.backend.open_writer(key, self.budget if budget is None else budget, progress, size_hint)
        return ObjectWriter(self._io, inner, self.url(key))

    def _put_record(self, key: str, data: Any, if_absent: bool) -> Op[ObjectInfo]:
        check_key(key, self.root)
        blob = Payload(data).whole()
        return lambda: self.backend.put_record(key, blob, bool(if_absent))

    def _get_into(self, key: str, dest: Any, offset: int) -> Op[int]:
        check_key(key, self.root)
        view = as_view(dest, writable=True, what="dest")
        _check_offset(offset)
        return lambda: self.backend.get_into(key, view, offset)

    def _get(self, key: str, offset: int, length: int | None) -> Op[bytearray]:
        check_key(key, self.root)
        _check_offset(offset)
        if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 0):
            raise InvalidOptionError(f"length={length!r}: give None or an int >= 0")

        async def get() -> bytearray:
            n = length
            if n is None:
                info = await self.backend.head(key)
                if info is None:
                    raise StoreError(
                        f"reading {self.url(key)} failed: no such object", key=self.url(key), reason="missing"
                    )
                n = max(0, info.size - offset)
            out = bytearray(n)
            await self.backend.get_into(key, memoryview(out), offset)
            return out

        return get

    def _head(self, key: str) -> Op[ObjectInfo | None]:
        check_key(key, self.root)
        return lambda: self.backend.head(key)

    def _list(self, prefix: str) -> Op[list[ObjectInfo]]:
        _check_prefix(prefix)
        return lambda: self.backend.list_objects(prefix)

    def _delete(self, keys: str | Sequence[str]) -> Op[None]:
        names = [keys] if isinstance(keys, str) else list(keys)
        for key in names:
            check_key(key, self.root)
        return lambda: self.backend.delete(names)

    def _list_uploads(self, prefix: str) -> Op[list[UploadInfo]]:
        _check_prefix(prefix)
        return lambda: self.backend.list_uploads(prefix)

    def _abort_uploads(self, uploads: Sequence[UploadInfo]) -> Op[int]:
        items = list(uploads)
        if not all(isinstance(u, UploadInfo) for u in items):
            raise InvalidOptionTypeError("abort_uploads: give the UploadInfo records list_uploads returned")
        return lambda: self.backend.abort_uploads(items)

    def _put_many(self, items: Sequence[tuple[str, Any]], budget: ByteBudget | None) -> Op[list[ObjectInfo]]:
        ops = [self._put(key, data, budget, None) for key, data in items]

        return lambda: _all(ops)

    def _get_many_into(self, items: Sequence[tuple[str, Any]]) -> Op[int]:
        ops = [self._get_into(key, dest, 0) for key, dest in items]

        async def get_all() -> int:
            return sum(await _all(ops))

        return get_all

    # -- the async face ---------------------------------------------------------------

    async def put(
        self, key: str, data: Any, *, budget: ByteBudget | None = None, progress: Progress | None = None
    ) -> ObjectInfo:
        """Store ``data`` (a buffer, or a list of buffers written one after the other)
        as ``key``. Up to ``multipart_threshold`` bytes: one PUT; more: a multipart
        upload, ``concurrency`` parts in flight within ``budget`` bytes, each part read
        from ``data`` only once its bytes fit. The object appears whole, at the end, or
        not at all. ``progress(n)`` is called on the I/O thread as parts are stored."""
        return await self._io.run(self._put(key, data, budget, progress))

    def open_writer(
        self,
        key: str,
        *,
        budget: ByteBudget | None = None,
        progress: Progress | None = None,
        size_hint: int | None = None,
    ) -> ObjectWriter:
        """A writer that streams ``key`` from ``write`` calls, parts uploaded in
        parallel as they fill, within ``budget``; the object appears at ``close``
        (writer.py). ``size_hint``: the expected size, for objects that could need more
        than 10,000 parts. Nothing is sent before the first write. Its ``blocking``
        face serves a thread."""
        return self._open_writer(key, budget, progress, size_hint)

    async def put_many(
        self, items: Sequence[tuple[str, Any]], *, budget: ByteBudget | None = None
    ) -> list[ObjectInfo]:
        """``put`` of several objects at once (``(key, data)`` pairs), their parts in
        flight together within the one ``budget``; the first failure cancels the others
        (each aborted: absent or whole), then is raised."""
        return await self._io.run(self._put_many(items, budget))

    async def get_many_into(self, items: Sequence[tuple[str, Any]]) -> int:
        """``get_into`` of several objects at once (``(key, dest)`` pairs, each ``dest``
        the object's size), in parallel; the bytes read."""
        return await self._io.run(self._get_many_into(items))

    async def put_record(self, key: str, data: Any, *, if_absent: bool = False) -> ObjectInfo:
        """Write a small object in one atomic request (the commit record, written last).
        ``if_absent``: refused (``StoreError``, ``reason="exists"``) if ``key`` exists,
        where the store honours it (S3, MinIO, moto, a folder; see
        docs/object_storage.md)."""
        return await self._io.run(self._put_record(key, data, if_absent))

    async def get_into(self, key: str, dest: Any, *, offset: int = 0) -> int:
        """Read ``len(dest)`` bytes of ``key`` from ``offset`` into ``dest`` (a writable
        buffer: a bytearray, a NumPy array, a contiguous CPU tensor), in parallel ranged reads."""
        return await self._io.run(self._get_into(key, dest, offset))

    async def get(self, key: str, *, offset: int = 0, length: int | None = None) -> bytearray:
        """The object's bytes from ``offset`` (``length`` of them, default: to its end)."""
        return await self._io.run(self._get(key, offset, length))

    async def head(self, key: str) -> ObjectInfo | None:
        """What is stored as ``key`` (size, etag, time), or None."""
        return await self._io.run(self._head(key))

    async def exists(self, key: str) -> bool:
        return await self.head(key) is not None

    async def list_objects(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix``, sorted by key (whole objects
        only: an unfinished upload is not one)."""
        return await self._io.run(self._list(prefix))

    async def delete(self, keys: str | Sequence[str]) -> None:
        """Delete objects (batched: 1,000 per request on S3); a missing one is no error."""
        await self._io.run(self._delete(keys))

    async def list_uploads(self, prefix: str = "") -> list[UploadInfo]:
        """Uploads begun under ``prefix`` and never completed nor aborted (a writer
        killed mid-upload): their parts take space until ``abort_uploads``."""
        return await self._io.run(self._list_uploads(prefix))

    async def abort_uploads(self, uploads: Sequence[UploadInfo]) -> int:
        """Abort unfinished uploads (free their parts); how many were still there. Only
        for uploads no live writer owns: its completion would then fail."""
        return await self._io.run(self._abort_uploads(uploads))

    async def aclose(self) -> None:
        """Close the connections and stop the I/O thread. Cancellation: deferred until
        both are done."""
        await self._io.aclose(self.backend.close)

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class BlockingStore:
    """``Store``'s operations for a thread with no event loop; each call blocks the
    calling thread until done (not from the store's own I/O thread)."""

    def __init__(self, store: Store) -> None:
        self._s = store

    def put(
        self, key: str, data: Any, *, budget: ByteBudget | None = None, progress: Progress | None = None
    ) -> ObjectInfo:
        return self._s._io.run_blocking(self._s._put(key, data, budget, progress))

    def open_writer(
        self,
        key: str,
        *,
        budget: ByteBudget | None = None,
        progress: Progress | None = None,
        size_hint: int | None = None,
    ) -> BlockingObjectWriter:
        return self._s._open_writer(key, budget, progress, size_hint).blocking

    def put_many(
        self, items: Sequence[tuple[str, Any]], *, budget: ByteBudget | None = None
    ) -> list[ObjectInfo]:
        return self._s._io.run_blocking(self._s._put_many(items, budget))

    def get_many_into(self, items: Sequence[tuple[str, Any]]) -> int:
        return self._s._io.run_blocking(self._s._get_many_into(items))

    def put_record(self, key: str, data: Any, *, if_absent: bool = False) -> ObjectInfo:
        return self._s._io.run_blocking(self._s._put_record(key, data, if_absent))

    def get_into(self, key: str, dest: Any, *, offset: int = 0) -> int:
        return self._s._io.run_blocking(self._s._get_into(key, dest, offset))

    def get(self, key: str, *, offset: int = 0, length: int | None = None) -> bytearray:
        return self._s._io.run_blocking(self._s._get(key, offset, length))

    def head(self, key: str) -> ObjectInfo | None:
        return self._s._io.run_blocking(self._s._head(key))

    def exists(self, key: str) -> bool:
        return self.head(key) is not None

    def list_objects(self, prefix: str = "") -> list[ObjectInfo]:
        return self._s._io.run_blocking(self._s._list(prefix))

    def delete(self, keys: str | Sequence[str]) -> None:
        self._s._io.run_blocking(self._s._delete(keys))

    def list_uploads(self, prefix: str = "") -> list[UploadInfo]:
        return self._s._io.run_blocking(self._s._list_uploads(prefix))

    def abort_uploads(self, uploads: Sequence[UploadInfo]) -> int:
        return self._s._io.run_blocking(self._s._abort_uploads(uploads))

    def close(self) -> None:
        self._s._io.close_blocking(self._s.backend.close)


async def _all(ops: Sequence[Op[T]]) -> list[T]:
    """Run ``ops`` together; the first failure cancels the others and waits for their
    cleanup (an upload aborted), then is raised (itself, not a group)."""
    tasks = [asyncio.ensure_future(op()) for op in ops]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _check_offset(offset: int) -> None:
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise InvalidOptionError(f"offset={offset!r}: give an int >= 0")


def _check_prefix(prefix: str) -> None:
    if not isinstance(prefix, str) or prefix.startswith("/"):
        raise InvalidOptionError(
            f"prefix={prefix!r}: give a str of the keys' first characters, not starting with '/'"
        )


def open_store(
    url: str | os.PathLike[str],
    options: TransferOptions | None = None,
    *,
    client_options: dict[str, Any] | None = None,
    seed: int | None = None,
) -> Store:
    """A Store for ``s3://bucket/prefix`` (needs ``async_stager[s3]``), ``file:///path``
    or a plain folder path. Nothing is contacted until the first operation.
    ``client_options``: keywords for botocore's ``create_client`` (``endpoint_url``,
    ``region_name``...), over the standard configuration; ``seed``: the retries'
    jitter (tests)."""
    options = TransferOptions() if options is None else options
    if not isinstance(options, TransferOptions):
        raise InvalidOptionTypeError(f"options: a TransferOptions, not {type(options).__name__}")
    if isinstance(url, os.PathLike):
        return Store(FolderBackend(url, options))
    if not isinstance(url, str) or not url:
        raise InvalidOptionTypeError(
            f"open_store: a URL (s3://bucket/prefix, file:///path) or a path, not {url!r}"
        )
    parts = urlsplit(url)
    if parts.scheme == "s3":
        if not parts.netloc:
            raise InvalidOptionError(f"{url!r}: an s3:// URL names a bucket: s3://bucket/prefix")
        return Store(S3Backend(parts.netloc, parts.path, options, client_options, seed=seed))
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise InvalidOptionError(
                f"{url!r}: a file:// URL names a local folder (file:///path), not a host"
            )
        return Store(FolderBackend(unquote(parts.path), options))
    if "://" in url:
        raise InvalidOptionError(f"{url!r}: a store is s3://bucket/prefix, file:///path or a folder path")
    return Store(FolderBackend(url, options))
