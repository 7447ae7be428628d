"""The extension point: what a checkpoint manager needs from an object store.

A ``Backend`` is a small interface with two implementations: ``S3Backend`` (any
S3-compatible store, through aiobotocore) and ``FolderBackend`` (a local folder: for
``file://`` and for tests, with the same visible semantics). Its coroutines run on
the store's I/O loop (plain asyncio, see ioloop.py); ``Store`` is the face callers use
from asyncio, uvloop, trio or a thread.

Keys are relative to the backend's root (``s3://bucket/prefix/`` or the folder), with
``/`` between parts; ``url(key)`` names an object in errors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from async_stager._store.budget import ByteBudget
from async_stager._store.objects import ObjectInfo, Payload, TransferOptions, UploadInfo
from async_stager.errors import StoreError

__all__ = ["Backend", "BackendWriter", "Progress", "check_key"]

#: Called with the bytes of each part (or whole object) once the store acknowledged it.
Progress = Callable[[int], None]


def check_key(key: str, root: str) -> str:
    """``key`` if it names an object under the root: not empty, no leading ``/``, no
    ``.``/``..`` or empty parts (a folder could not hold those where S3 would)."""
    if not isinstance(key, str) or not key:
        raise StoreError(
            f"{root}: an object key must be a non-empty str, not {key!r}", key=root, reason="request"
        )
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise StoreError(
            f"{root}{key}: an object key may not start or end with '/', hold '//', '.' or '..' parts",
            key=f"{root}{key}",
            reason="request",
        )
    return key


class BackendWriter(ABC):
    """One object written as a stream (``Store.open_writer``), on the I/O loop: each
    ``write`` copies its bytes into the current part once the budget has room for it
    (so the caller may reuse its buffer as soon as ``write`` returns); ``close`` makes
    the object appear, whole; ``abort`` leaves nothing."""

    @abstractmethod
    async def write(self, view: memoryview) -> None: ...

    @abstractmethod
    async def close(self) -> ObjectInfo: ...

    @abstractmethod
    async def abort(self) -> None:
        """Idempotent; frees whatever the writer held (parts, budget, a hidden file)."""


class Backend(ABC):
    """One store's operations; each names the object in its ``StoreError``."""

    #: ``s3://bucket/prefix/`` or ``file:///path/``: the root every key is under.
    root: str
    options: TransferOptions

    def url(self, key: str) -> str:
        return f"{self.root}{key}"

    @abstractmethod
    async def put(
        self, key: str, payload: Payload, budget: ByteBudget, progress: Progress | None
    ) -> ObjectInfo:
        """Store ``payload`` as ``key``; the object appears whole or not at all (a
        multipart upload is completed last, or aborted on failure and cancellation)."""

    @abstractmethod
    def open_writer(
        self, key: str, budget: ByteBudget, progress: Progress | None, size_hint: int | None
    ) -> BackendWriter:
        """A writer for ``key``; nothing is sent before its first ``write``."""

    @abstractmethod
    async def put_record(self, key: str, data: bytes, if_absent: bool) -> ObjectInfo:
        """One atomic write of a small object (a commit record); with ``if_absent``,
        refused (``reason="exists"``) if ``key`` exists, where the store can tell."""

    @abstractmethod
    async def get_into(self, key: str, dest: memoryview, offset: int) -> int:
        """Read ``len(dest)`` bytes of ``key`` from ``offset`` into ``dest``."""

    @abstractmethod
    async def head(self, key: str) -> ObjectInfo | None:
        """What is stored as ``key``, or None."""

    @abstractmethod
    async def list_objects(self, prefix: str) -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix``, sorted by key."""

    @abstractmethod
    async def delete(self, keys: Sequence[str]) -> None:
        """Delete ``keys`` (a missing one is no error), in batches."""

    @abstractmethod
    async def list_uploads(self, prefix: str) -> list[UploadInfo]:
        """Unfinished uploads under ``prefix`` (a killed writer's)."""

    @abstractmethod
    async def abort_uploads(self, uploads: Sequence[UploadInfo]) -> int:
        """Abort ``uploads`` (their parts are freed); how many were still there."""

    @abstractmethod
    async def close(self) -> None:
        """Let go of connections and threads (on the I/O loop)."""
