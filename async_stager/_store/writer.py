"""``ObjectWriter``: one object written as a stream of ``write`` calls (the budgeted
pipeline's pieces, a file's tensors one at a time), for callers on any event loop;
``BlockingObjectWriter`` the same for a thread.

Each ``write`` copies its bytes into the store's part buffers once the byte budget has
room (it waits while the budget is full), so the caller may reuse its buffer as soon as
``write`` returns. The object appears whole at ``close``, or not at all.

Cancellation, and any failure of ``write`` or ``close``: the writer aborts (the
multipart upload or the hidden file is removed, shielded) before the cancellation or
error is raised; the writer is closed after it. ``async with`` closes it at the end of
the block, or aborts it if the block raised.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import anyio

from async_stager._store.backend import BackendWriter
from async_stager._store.ioloop import IOLoop
from async_stager._store.objects import ObjectInfo, as_view

__all__ = ["BlockingObjectWriter", "ObjectWriter"]

T = TypeVar("T")


class ObjectWriter:
    """A stream into one object; see the module's docstring."""

    def __init__(self, io: IOLoop, inner: BackendWriter, url: str) -> None:
        self._io = io
        self._inner = inner
        self.url = url
        self.blocking = BlockingObjectWriter(self)

    async def _guarded(self, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        try:
            return await self._io.run(make)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._io.run(self._inner.abort)
            raise

    async def write(self, data: Any) -> None:
        """Append ``data`` (a buffer: bytes, an array, a CPU tensor) to the object."""
        view = as_view(data)
        await self._guarded(lambda: self._inner.write(view))

    async def close(self) -> ObjectInfo:
        """Make the object appear, whole; its ObjectInfo."""
        return await self._guarded(self._inner.close)

    async def abort(self) -> None:
        """Drop what was written; nothing appears. Idempotent."""
        with anyio.CancelScope(shield=True):
            await self._io.run(self._inner.abort)

    async def __aenter__(self) -> ObjectWriter:
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            await self.close()
        else:
            await self.abort()


class BlockingObjectWriter:
    """``ObjectWriter``'s operations for a thread with no event loop."""

    def __init__(self, writer: ObjectWriter) -> None:
        self._w = writer

    def _guarded(self, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        try:
            return self._w._io.run_blocking(make)
        except BaseException:
            self._w._io.run_blocking(self._w._inner.abort)
            raise

    def write(self, data: Any) -> None:
        view = as_view(data)
        self._guarded(lambda: self._w._inner.write(view))

    def close(self) -> ObjectInfo:
        return self._guarded(self._w._inner.close)

    def abort(self) -> None:
        self._w._io.run_blocking(self._w._inner.abort)
