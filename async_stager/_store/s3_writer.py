"""An S3 object written as a stream: parts are filled from ``write`` calls and uploaded
in parallel as they fill (at most ``concurrency`` in flight), within the byte budget.

A part's buffer is taken from the budget before any byte is copied into it, so a
``write`` waits while the budget is full: the budget bounds what the writer holds, and
the caller's buffer may be reused once ``write`` returns. An object that never fills a
part is one PUT at ``close``; otherwise the multipart upload is begun at the first full
part and completed at ``close``. A failed part fails the next ``write`` or ``close``;
then, or on ``abort``, the upload is aborted: no object, no parts.
"""

from __future__ import annotations

import asyncio
from typing import Any

from async_stager._store.backend import BackendWriter, Progress
from async_stager._store.budget import ByteBudget
from async_stager._store.objects import MAX_PARTS, ObjectInfo, part_size_for
from async_stager._store.s3_transfer import (
    S3Target,
    abort_upload,
    complete_upload,
    start_upload,
    upload_part,
)
from async_stager.errors import StoreError

__all__ = ["S3Writer"]


class S3Writer(BackendWriter):
    def __init__(
        self, b: S3Target, key: str, budget: ByteBudget, progress: Progress | None, size_hint: int | None
    ) -> None:
        self.b, self.key, self.budget, self.progress = b, key, budget, progress
        self.part = part_size_for(size_hint or 0, b.options.part_size)
        self.buffer: bytearray | None = None
        self.filled = 0
        self.size = 0
        self.upload_id: str | None = None
        self.tasks: list[asyncio.Task[dict[str, Any]]] = []
        self.done = False

    def _check(self) -> None:
        if self.done:
            url = self.b.url(self.key)
            raise StoreError(f"writing {url}: the writer is closed", key=url, reason="closed")
        for task in self.tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]

    async def write(self, view: memoryview) -> None:
        self._check()
        while view.nbytes:
            if self.buffer is None:
                await self._room()
                await self.budget.acquire(self.part)
                self.buffer, self.filled = bytearray(self.part), 0
            n = min(view.nbytes, self.part - self.filled)
            self.buffer[self.filled : self.filled + n] = view[:n]
            self.filled += n
            self.size += n
            view = view[n:]
            if self.filled == self.part:
                await self._ship()

    async def _room(self) -> None:
        """Wait until fewer than ``concurrency`` parts are in flight."""
        while sum(not t.done() for t in self.tasks) >= self.b.options.concurrency:
            await asyncio.wait([t for t in self.tasks if not t.done()], return_when=asyncio.FIRST_COMPLETED)
        self._check()

    async def _ship(self) -> None:
        """Upload the current part in a task of its own; its budget is given back when
        the store has it."""
        if self.upload_id is None:
            self.upload_id = await start_upload(self.b, self.key)
        number = len(self.tasks) + 1
        if number > MAX_PARTS:
            url = self.b.url(self.key)
            raise StoreError(
                f"writing {url} was refused: more than {MAX_PARTS} parts of {self.part} bytes "
                "(give open_writer a size_hint)",
                key=url,
                reason="request",
            )
        assert self.buffer is not None
        length = self.filled
        # As bytes: botocore sends bytes from a BytesIO sharing them, 64 KiB at a time
        # (aiohttp warns on a large bytearray body). The bytearray goes at once: one
        # more part is held only during this copy, one part at a time.
        data = bytes(memoryview(self.buffer)[:length])
        self.buffer, self.filled = None, 0
        upload_id = self.upload_id

        async def send() -> dict[str, Any]:
            entry = await upload_part(self.b, self.key, upload_id, number, "", data)
            if self.progress is not None:
                self.progress(length)
            return entry

        task = asyncio.ensure_future(send())
        # Given back when the task ends, however: a task cancelled before its first step
        # (an abort right after this part was shipped) runs no finally of its own.
        part = self.part
        task.add_done_callback(lambda _t: self.budget.release(part))
        self.tasks.append(task)

    async def close(self) -> ObjectInfo:
        self._check()
        try:
            if self.upload_id is None:  # never a full part: one PUT
                data = bytes(self.buffer[: self.filled]) if self.buffer is not None else b""
                try:
                    client_call = self.b.call(
                        "writing",
                        self.key,
                        lambda c: c.put_object(Bucket=self.b.bucket, Key=self.b.full(self.key), Body=data),
                    )
                    r = await client_call
                finally:
                    self._let_go()
                if self.progress is not None:
                    self.progress(len(data))
            else:
                if self.filled:
                    await self._ship()
                self._let_go()
                parts = list(await asyncio.gather(*self.tasks))
                r = await complete_upload(self.b, self.key, self.upload_id, parts)
        except BaseException:
            await self.abort()
            raise
        self.done = True
        return ObjectInfo(self.key, self.size, str(r.get("ETag", "")))

    def _let_go(self) -> None:
        if self.buffer is not None:
            self.buffer = None
            self.budget.release(self.part)

    async def abort(self) -> None:
        if self.done:
            return
        self.done = True
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self._let_go()
        if self.upload_id is not None:
            await abort_upload(self.b, self.key, self.upload_id)
