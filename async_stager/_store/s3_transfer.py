"""Large transfers on S3: a multipart upload with its parts in parallel within a byte
budget, and a parallel ranged read into a caller's buffer. Parts are tasks on the I/O
loop (``run_workers``), each retried on its own.

Upload: CreateMultipartUpload; then each worker takes the next part, waits until its
bytes fit the budget, copies it out of the source, uploads it (retried), and gives the
bytes back; CompleteMultipartUpload last, so the object appears whole at once. Any
failure or cancellation aborts the upload (shielded from the I/O loop's cancellation,
bounded by ``abort_timeout``): nothing is left, not even parts. A writer killed outright
leaves an unfinished upload, never an object: ``list_uploads``/``abort_uploads`` find
and free it.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from async_stager._store.backend import Progress
from async_stager._store.budget import ByteBudget
from async_stager._store.objects import ObjectInfo, Payload, TransferOptions, part_size_for, ranges
from async_stager._store.parallel import run_workers
from async_stager._store.s3_errors import ShortObjectError, TruncatedBodyError, error_code

__all__ = [
    "S3Target",
    "abort_upload",
    "complete_upload",
    "composite_etag",
    "get_into",
    "put_multipart",
    "start_upload",
    "upload_part",
]

T = TypeVar("T")

#: Bytes read from a response body at a time (then copied into the caller's buffer).
READ_CHUNK = 1 << 20
#: The checksum each part carries (computed by botocore, checked by the store).
CHECKSUM = "CRC32"


class S3Target(Protocol):
    """What a transfer needs of the S3 backend (s3.py), without importing it."""

    bucket: str
    options: TransferOptions

    def full(self, key: str) -> str: ...

    def url(self, key: str) -> str: ...

    async def client(self) -> Any: ...

    async def call(self, op: str, key: str, attempt: Callable[[Any], Awaitable[T]]) -> T: ...


def composite_etag(etags: list[str]) -> str | None:
    """S3's ETag of a completed multipart upload, from its parts' (MD5 of their MD5s,
    ``-N``); None where a part's ETag is no MD5 (encrypted with KMS, another store)."""
    try:
        digests = b"".join(bytes.fromhex(e.strip('"')) for e in etags)
    except ValueError:
        return None
    return f"{hashlib.md5(digests).hexdigest()}-{len(etags)}"


async def _upload_part(c: Any, *, bucket: str, key: str, upload_id: str, number: int, data: bytes) -> Any:
    return await c.upload_part(
        Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=data, ChecksumAlgorithm=CHECKSUM
    )


async def start_upload(b: S3Target, key: str) -> str:
    """CreateMultipartUpload (retried); the upload's id."""
    full = b.full(key)
    created = await b.call(
        "starting the upload of",
        key,
        lambda c: c.create_multipart_upload(Bucket=b.bucket, Key=full, ChecksumAlgorithm=CHECKSUM),
    )
    return str(created["UploadId"])


async def upload_part(
    b: S3Target, key: str, upload_id: str, number: int, of: str, data: bytes
) -> dict[str, Any]:
    """UploadPart (retried); its entry for CompleteMultipartUpload."""
    r = await b.call(
        f"writing part {number}{of} of",
        key,
        functools.partial(
            _upload_part, bucket=b.bucket, key=b.full(key), upload_id=upload_id, number=number, data=data
        ),
    )
    entry = {"PartNumber": number, "ETag": r["ETag"]}
    if f"Checksum{CHECKSUM}" in r:
        entry[f"Checksum{CHECKSUM}"] = r[f"Checksum{CHECKSUM}"]
    return entry


async def complete_upload(b: S3Target, key: str, upload_id: str, parts: list[dict[str, Any]]) -> Any:
    """CompleteMultipartUpload (retried): the object appears, whole. A retry whose first
    try completed (its answer lost) finds the object with the ETag its parts give."""
    full = b.full(key)
    expected = composite_etag([p["ETag"] for p in parts])
    tried = [0]

    async def complete(c: Any) -> Any:
        tried[0] += 1
        try:
            return await c.complete_multipart_upload(
                Bucket=b.bucket, Key=full, UploadId=upload_id, MultipartUpload={"Parts": parts}
            )
        except Exception as exc:
            if tried[0] > 1 and error_code(exc) in ("NoSuchUpload", "404"):
                head = await c.head_object(Bucket=b.bucket, Key=full)
                if expected is not None and head.get("ETag", "").strip('"') == expected:
                    return head
            raise

    return await b.call("completing the upload of", key, complete)


async def put_multipart(
    b: S3Target, key: str, payload: Payload, budget: ByteBudget, progress: Progress | None
) -> ObjectInfo:
    part = part_size_for(payload.size, b.options.part_size)
    spans = ranges(payload.size, part)
    upload_id = await start_upload(b, key)
    done: list[dict[str, Any] | None] = [None] * len(spans)
    queue = iter(enumerate(spans))

    async def worker() -> None:
        for index, (offset, length) in queue:
            await budget.acquire(length)
            try:
                # Read (copied) only now that its bytes fit: the budget bounds what is held.
                data = payload.read(offset, length)
                done[index] = await upload_part(b, key, upload_id, index + 1, f" of {len(spans)}", data)
                del data
            finally:
                budget.release(length)
            if progress is not None:
                progress(length)

    try:
        await run_workers(min(b.options.concurrency, len(spans)), worker)
        parts = [p for p in done if p is not None]
        assert len(parts) == len(spans)
        r = await complete_upload(b, key, upload_id, parts)
    except BaseException:
        await abort_upload(b, key, upload_id)
        raise
    return ObjectInfo(key, payload.size, str(r.get("ETag", "")))


async def abort_upload(b: S3Target, key: str, upload_id: str) -> None:
    """Best effort, bounded: a failed abort leaves an unfinished upload, which
    ``list_uploads`` shows and ``abort_uploads`` frees later."""
    try:
        client = await b.client()
        task = asyncio.ensure_future(
            client.abort_multipart_upload(Bucket=b.bucket, Key=b.full(key), UploadId=upload_id)
        )
        # shield: a second cancellation of this task must not cut the abort short.
        await asyncio.wait_for(asyncio.shield(task), b.options.abort_timeout)
    except (Exception, asyncio.CancelledError):  # noqa: BLE001 - the upload's own error is raised
        pass


async def get_into(b: S3Target, key: str, dest: memoryview, offset: int) -> int:
    """``len(dest)`` bytes of ``key`` from ``offset``, in parallel ranged GETs of
    ``part_size``, each written into its place of ``dest`` as it arrives."""
    full = b.full(key)
    size = dest.nbytes
    if size == 0:
        return 0
    queue = iter(ranges(size, b.options.part_size, offset))

    async def fetch(start: int, length: int) -> None:
        async def attempt(c: Any) -> None:
            r = await c.get_object(Bucket=b.bucket, Key=full, Range=f"bytes={start}-{start + length - 1}")
            total = str(r.get("ContentRange", "")).rpartition("/")[2]
            if total.isdigit() and int(total) < start + length:
                r["Body"].close()
                raise ShortObjectError(
                    f"the object is {total} bytes: reading bytes {start} to {start + length} passes its end"
                )
            at = start - offset
            got = 0
            async with r["Body"] as body:
                while got < length:
                    chunk = await body.read(min(READ_CHUNK, length - got))
                    if not chunk:
                        break
                    dest[at + got : at + got + len(chunk)] = chunk
                    got += len(chunk)
            if got != length:
                raise TruncatedBodyError(f"the answer ended after {got} of {length} bytes")

        await b.call("reading", key, attempt)

    async def worker() -> None:
        for start, length in queue:
            await fetch(start, length)

    count = min(b.options.concurrency, -(-size // b.options.part_size))
    if count == 1:
        await fetch(offset, size)
    else:
        await run_workers(count, worker)
    return size
