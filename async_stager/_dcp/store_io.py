"""DCP's storage on an object store: ``StoreWriter`` and ``StoreReader``.

DCP's own ``FileSystemWriter``/``FileSystemReader`` (its file layout, planner and
metadata, unchanged) over a ``FileSystemBase`` whose files are objects of our store
(``async_stager._store``): a file written is one object streamed through a writer
(multipart, parts in parallel on the store's I/O loop, within its byte budget: no
thread per part), appearing whole at its close or not at all; a file read is ranged
GETs into the reader's buffers. ``.metadata`` is written last (as a local folder's
rename would: a GET, a PUT and a DELETE of the small temporary object), so a reader
sees a checkpoint only once every rank's data is stored.

``torch.distributed.checkpoint.save(sd, storage_writer=StoreWriter("s3://bucket/ckpt"))``,
``async_save(..., storage_writer=StoreWriter(...), async_stager=DefaultStager(...))``,
``load(sd, storage_reader=StoreReader("s3://bucket/ckpt"))``; ``async_stager.dcp.save``
picks ``StoreWriter`` for an ``s3://`` ``checkpoint_id`` itself. Credentials and
endpoints come from the standard AWS configuration (see docs/object_storage.md).
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
import weakref
from collections.abc import Generator
from typing import Any
from urllib.parse import urlsplit

from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemReader, FileSystemWriter

from async_stager._store.store import Store, open_store
from async_stager._store.writer import BlockingObjectWriter
from async_stager.errors import InvalidOptionError, StoreError

__all__ = ["StoreFileSystem", "StoreReader", "StoreWriter", "is_store_url"]

#: Bytes a read stream fetches at once (small reads of a file come from this buffer).
_READ_AHEAD = 8 << 20


def is_store_url(checkpoint_id: Any) -> bool:
    """``checkpoint_id`` names an object store (``s3://``)."""
    return isinstance(checkpoint_id, str) and checkpoint_id.lower().startswith("s3://")


def _split(path: str | os.PathLike[str]) -> tuple[str, str]:
    text = os.fspath(path)
    parts = urlsplit(text)
    if parts.scheme.lower() != "s3" or not parts.netloc:
        raise InvalidOptionError(f"{text!r}: an object store's checkpoint is s3://bucket/prefix")
    return parts.netloc, parts.path.strip("/")


class _WriteStream(io.RawIOBase):
    """A file being written: its bytes go to an object writer (copied into its parts
    before ``write`` returns); ``tell`` counts them (DCP records offsets by it)."""

    def __init__(self, writer: BlockingObjectWriter) -> None:
        super().__init__()
        self._writer = writer
        self._pos = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if view.nbytes:
            self._writer.write(view)
        self._pos += view.nbytes
        return view.nbytes

    def tell(self) -> int:
        return self._pos

    def seekable(self) -> bool:
        return False


class _ReadStream(io.RawIOBase):
    """A stored file read by ranged GETs (``readinto`` into the caller's buffer)."""

    def __init__(self, store: Store, key: str, size: int) -> None:
        super().__init__()
        self._store = store
        self._key = key
        self._size = size
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = min(view.nbytes, self._size - self._pos)
        if n <= 0:
            return 0
        self._store.blocking.get_into(self._key, view[:n], offset=self._pos)
        self._pos += n
        return n


class StoreFileSystem(FileSystemBase):
    """DCP's file operations on object-store URLs (``s3://bucket/key``); one store per
    bucket, opened at first use, closed when this object is collected (or ``close``)."""

    def __init__(self) -> None:
        self._stores: dict[str, Store] = {}
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _close_all, self._stores)

    def close(self) -> None:
        self._finalizer()

    def _store(self, path: str | os.PathLike[str]) -> tuple[Store, str]:
        bucket, key = _split(path)
        with self._lock:
            store = self._stores.get(bucket)
            if store is None:
                store = self._stores[bucket] = open_store(f"s3://{bucket}")
        return store, key

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        store, key = self._store(path)
        if "w" in mode:
            writer = store.blocking.open_writer(key)
            stream = _WriteStream(writer)
            try:
                yield stream
            except BaseException:
                writer.abort()
                raise
            writer.close()  # the object appears, whole
            return
        info = store.blocking.head(key)
        if info is None:
            raise FileNotFoundError(f"{os.fspath(path)}: no such object")
        with io.BufferedReader(_ReadStream(store, key, info.size), buffer_size=_READ_AHEAD) as reader:
            yield reader

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        return f"{os.fspath(path).rstrip('/')}/{suffix}"

    def init_path(self, path: str | os.PathLike[str]) -> str:
        _split(path)
        return os.fspath(path).rstrip("/")

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        # No rename in an object store: the (small) object is copied whole, in one
        # atomic PUT, then the old one deleted.
        store, key = self._store(path)
        dest_store, dest = self._store(new_path)
        dest_store.blocking.put_record(dest, store.blocking.get(key))
        store.blocking.delete(key)

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        """Nothing: an object store has no folders."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return is_store_url(checkpoint_id)

    def exists(self, path: str | os.PathLike[str]) -> bool:
        store, key = self._store(path)
        return store.blocking.exists(key)

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        store, key = self._store(path)
        store.blocking.delete(key)

    def ls(self, path: str | os.PathLike[str]) -> list[str]:
        store, key = self._store(path)
        prefix = f"{key}/" if key else ""
        bucket = _split(path)[0]
        return [f"s3://{bucket}/{o.key}" for o in store.blocking.list_objects(prefix)]


def _close_all(stores: dict[str, Store]) -> None:
    items = list(stores.values())
    stores.clear()

    def close() -> None:
        for store in items:
            with contextlib.suppress(StoreError, RuntimeError):
                store.blocking.close()

    if items:
        # Hazard: a finalizer runs in whatever thread dropped the last reference, which
        # could be a store's own I/O thread, where a blocking close would wait for itself.
        threading.Thread(target=close, name="async-stager-store-close", daemon=True).start()


class StoreWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` writing to ``s3://bucket/prefix`` through our store.
    ``sync_files`` is off: an object is durable when its upload completes (an fsync of
    a stream that is not a file would make DCP sync the whole machine instead)."""

    def __init__(self, path: str | os.PathLike[str], **kwargs: Any) -> None:
        kwargs["sync_files"] = False
        super().__init__(path, **kwargs)
        self.fs = StoreFileSystem()  # type: ignore[assignment]  # torch types it as its local FileSystem
        self.path = self.fs.init_path(path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return is_store_url(checkpoint_id)


class StoreReader(FileSystemReader):
    """DCP's ``FileSystemReader`` reading ``s3://bucket/prefix`` through our store."""

    def __init__(self, path: str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.fs = StoreFileSystem()  # type: ignore[assignment]  # torch types it as its local FileSystem
        self.path = self.fs.init_path(path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return is_store_url(checkpoint_id)
