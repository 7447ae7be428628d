"""``Checkpointer.saved()``: an async iterator of the commits from then on.

Hazard: the Checkpointer must not keep an iterator's queue alive once its user dropped
the iterator (``async for stats in ckpt.saved(): break``): holding the send side of a
memory stream keeps every later SaveStats (and what it references) in its buffer for
as long as the Checkpointer lives. So the Checkpointer holds each ``SavedStream`` by a
weak reference only; the stream owns both ends of its queue, and when it is collected
a finalizer closes them (no unclosed-stream warning) and the queue goes with it.
"""

from __future__ import annotations

import math
import weakref
from types import TracebackType
from typing import TYPE_CHECKING

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

if TYPE_CHECKING:
    from async_stager._checkpoint.options import SaveStats

__all__ = ["SavedStream", "Subscribers"]


def _close(send: MemoryObjectSendStream[SaveStats], receive: MemoryObjectReceiveStream[SaveStats]) -> None:
    send.close()
    receive.close()


class SavedStream:
    """The SaveStats of every commit from the call of ``Checkpointer.saved()`` on, in
    commit order; it ends (``StopAsyncIteration``, ``anyio.EndOfStream`` from
    ``receive``) when the Checkpointer closes. ``async for stats in stream``,
    ``await stream.receive()``, ``stream.receive_nowait()``; ``close()``/``aclose()``
    (or ``with``/``async with``) stops it early. Unbounded while it is kept and not
    read: drop it (or close it) when no longer read, and the Checkpointer stops
    queueing into it. Cancellation of ``receive``: only the wait; nothing is lost."""

    def __init__(self) -> None:
        self._send, self._receive = anyio.create_memory_object_stream["SaveStats"](math.inf)
        self._finalizer = weakref.finalize(self, _close, self._send, self._receive)

    def offer(self, stats: SaveStats) -> None:
        """Queue ``stats`` (the Checkpointer's call, at each commit); a closed stream
        takes nothing."""
        try:
            self._send.send_nowait(stats)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass

    def finish(self) -> None:
        """No more commits (the Checkpointer closed): the reader ends after the queued."""
        self._send.close()

    async def receive(self) -> SaveStats:
        """The next commit's SaveStats; ``anyio.EndOfStream`` once finished and read."""
        return await self._receive.receive()

    def receive_nowait(self) -> SaveStats:
        """The next queued SaveStats; ``anyio.WouldBlock`` if none is queued."""
        return self._receive.receive_nowait()

    def close(self) -> None:
        """Stop receiving: what is queued is dropped, nothing more is queued."""
        self._finalizer()

    async def aclose(self) -> None:
        self.close()

    def __aiter__(self) -> SavedStream:
        return self

    async def __anext__(self) -> SaveStats:
        try:
            return await self._receive.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise StopAsyncIteration from None

    def __enter__(self) -> SavedStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> SavedStream:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class Subscribers:
    """A Checkpointer's live ``SavedStream``s, each held weakly (see the module doc)."""

    def __init__(self) -> None:
        self._streams: weakref.WeakSet[SavedStream] = weakref.WeakSet()

    def new(self) -> SavedStream:
        stream = SavedStream()
        self._streams.add(stream)
        return stream

    def offer(self, stats: SaveStats) -> None:
        for stream in list(self._streams):
            stream.offer(stats)

    def finish(self) -> None:
        for stream in list(self._streams):
            stream.finish()
        self._streams = weakref.WeakSet()

    def __len__(self) -> int:
        return len(self._streams)
