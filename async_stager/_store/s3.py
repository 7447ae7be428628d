"""The S3 backend: any S3-compatible store through aiobotocore (the client under s3fs).

Credentials, region and endpoint come from the client library's standard places, never
from a format of ours: ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/
``AWS_SESSION_TOKEN``, ``AWS_PROFILE`` and ``~/.aws/config``/``credentials``,
``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3``) for a store other than AWS,
``AWS_DEFAULT_REGION``, an instance or container role. ``client_options`` (keywords
of botocore's ``create_client``: ``endpoint_url``, ``region_name``...) may override
them in code. botocore's own retries are turned off (one attempt per call): ours
(``RetryPolicy``) retry each request and part with full jitter and name the object when
they give up.

The large transfers (multipart upload, parallel ranged reads) are in s3_transfer.py.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import random
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from async_stager._store import s3_transfer
from async_stager._store.backend import Backend, BackendWriter, Progress
from async_stager._store.budget import ByteBudget
from async_stager._store.objects import ObjectInfo, Payload, TransferOptions, UploadInfo
from async_stager._store.retry import retrying, store_error
from async_stager._store.s3_errors import classify, error_code
from async_stager._store.s3_writer import S3Writer
from async_stager.errors import StoreError, UnsupportedError

__all__ = ["S3Backend", "s3_available"]

T = TypeVar("T")

#: Objects per DeleteObjects request (S3's limit).
DELETE_BATCH = 1000


#: botocore's data loader (the service models, read from JSON files), shared by every
#: store of the process: a new session reads the S3 model again (0.3 s of CPU here); a
#: session itself is not shared, so each store resolves its credentials anew.
_LOADER: list[Any] = []
_LOADER_LOCK = threading.Lock()


def _session() -> Any:
    from aiobotocore.session import get_session

    session = get_session()
    with _LOADER_LOCK:
        if _LOADER:
            session.register_component("data_loader", _LOADER[0])
        else:
            _LOADER.append(session.get_component("data_loader"))
    return session


def s3_available() -> bool:
    return importlib.util.find_spec("aiobotocore") is not None


class S3Backend(Backend):
    """Objects under ``s3://bucket/prefix/``."""

    def __init__(
        self,
        bucket: str,
        prefix: str,
        options: TransferOptions,
        client_options: Mapping[str, Any] | None = None,
        *,
        seed: int | None = None,
    ) -> None:
        if not s3_available():
            raise UnsupportedError(
                f"s3://{bucket}/{prefix}: object storage needs the S3 client library: "
                "pip install 'async_stager[s3]' (aiobotocore)"
            )
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.root = f"s3://{bucket}/{self.prefix}"
        self.options = options
        self._client_options = dict(client_options or {})
        self._client: Any = None
        self._context: Any = None
        self.rng = random.Random(seed)

    def full(self, key: str) -> str:
        return self.prefix + key

    async def client(self) -> Any:
        """The aiobotocore client, made on first use on the I/O loop."""
        if self._client is None:
            from aiobotocore.config import AioConfig

            config = AioConfig(
                retries={"total_max_attempts": 1, "mode": "standard"},
                max_pool_connections=max(10, 2 * self.options.concurrency),
                connect_timeout=10,
                read_timeout=60,
            )
            options = dict(self._client_options)
            user_config = options.pop("config", None)
            if user_config is not None:
                config = user_config.merge(config)
            try:
                self._context = _session().create_client("s3", config=config, **options)
                self._client = await self._context.__aenter__()
            except Exception as exc:
                failure = classify(exc)
                if failure is None:
                    raise
                raise store_error("opening", self.root, failure) from exc
        return self._client

    async def call(self, op: str, key: str, attempt: Callable[[Any], Awaitable[T]]) -> T:
        """``attempt(client)`` with the retry policy; errors name ``key``'s URL."""
        client = await self.client()
        return await retrying(
            op, self.url(key), lambda: attempt(client), classify, self.options.retry, self.rng
        )

    async def put(
        self, key: str, payload: Payload, budget: ByteBudget, progress: Progress | None
    ) -> ObjectInfo:
        if payload.size > self.options.threshold:
            return await s3_transfer.put_multipart(self, key, payload, budget, progress)
        await budget.acquire(max(payload.size, 1))
        try:
            data = payload.whole()
            response = await self.call(
                "writing", key, lambda c: c.put_object(Bucket=self.bucket, Key=self.full(key), Body=data)
            )
        finally:
            budget.release(max(payload.size, 1))
        if progress is not None:
            progress(payload.size)
        return ObjectInfo(key, payload.size, str(response.get("ETag", "")))

    def open_writer(
        self, key: str, budget: ByteBudget, progress: Progress | None, size_hint: int | None
    ) -> BackendWriter:
        return S3Writer(self, key, budget, progress, size_hint)

    async def put_record(self, key: str, data: bytes, if_absent: bool) -> ObjectInfo:
        """One PUT (atomic on S3: readers see the old object, none, or the whole new
        one). ``if_absent`` sends ``If-None-Match: *``: S3 (since 2024), MinIO and moto
        refuse it with 412 if ``key`` exists, so exactly one of two racing writers wins;
        a store that ignores the header overwrites. A retried PUT whose first try was
        stored (its answer lost) finds its own bytes there (same MD5): that is success."""
        extra = {"IfNoneMatch": "*"} if if_absent else {}
        tried = [0]

        async def attempt(c: Any) -> Any:
            tried[0] += 1
            try:
                return await c.put_object(Bucket=self.bucket, Key=self.full(key), Body=data, **extra)
            except Exception as exc:
                if tried[0] > 1 and error_code(exc) in ("PreconditionFailed", "412"):
                    head = await c.head_object(Bucket=self.bucket, Key=self.full(key))
                    if head.get("ETag", "").strip('"') == hashlib.md5(data).hexdigest():
                        return head
                raise

        response = await self.call("writing the record", key, attempt)
        return ObjectInfo(key, len(data), str(response.get("ETag", "")))

    async def get_into(self, key: str, dest: memoryview, offset: int) -> int:
        return await s3_transfer.get_into(self, key, dest, offset)

    async def head(self, key: str) -> ObjectInfo | None:
        try:
            r = await self.call(
                "reading the size of", key, lambda c: c.head_object(Bucket=self.bucket, Key=self.full(key))
            )
        except StoreError as exc:
            if exc.reason == "missing":
                return None
            raise
        return ObjectInfo(key, int(r["ContentLength"]), str(r.get("ETag", "")), r.get("LastModified"))

    async def list_objects(self, prefix: str) -> list[ObjectInfo]:
        out: list[ObjectInfo] = []
        token: dict[str, str] = {}
        while True:

            async def page(c: Any, token: dict[str, str] = token) -> Any:
                return await c.list_objects_v2(Bucket=self.bucket, Prefix=self.full(prefix), **token)

            r = await self.call("listing", prefix, page)
            for item in r.get("Contents", []):
                key = item["Key"][len(self.prefix) :]
                out.append(
                    ObjectInfo(key, int(item["Size"]), str(item.get("ETag", "")), item.get("LastModified"))
                )
            if not r.get("IsTruncated"):
                return sorted(out, key=lambda o: o.key)
            token = {"ContinuationToken": r["NextContinuationToken"]}

    async def delete(self, keys: Sequence[str]) -> None:
        for start in range(0, len(keys), DELETE_BATCH):
            batch = list(keys[start : start + DELETE_BATCH])
            objects = [{"Key": self.full(k)} for k in batch]

            async def attempt(c: Any, objects: list[dict[str, str]] = objects) -> Any:
                return await c.delete_objects(Bucket=self.bucket, Delete={"Objects": objects, "Quiet": True})

            r = await self.call(
                "deleting", batch[0] if len(batch) == 1 else f"{batch[0]} (+{len(batch) - 1})", attempt
            )
            errors = r.get("Errors", [])
            if errors:
                first = errors[0]
                key = str(first.get("Key", ""))[len(self.prefix) :]
                more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
                raise StoreError(
                    f"deleting {self.url(key)} failed ({first.get('Code')}: {first.get('Message')}){more}",
                    key=self.url(key),
                    reason="denied" if first.get("Code") == "AccessDenied" else "request",
                    code=str(first.get("Code", "")),
                )

    async def list_uploads(self, prefix: str) -> list[UploadInfo]:
        out: list[UploadInfo] = []
        marker: dict[str, str] = {}
        while True:

            async def page(c: Any, marker: dict[str, str] = marker) -> Any:
                return await c.list_multipart_uploads(Bucket=self.bucket, Prefix=self.full(prefix), **marker)

            r = await self.call("listing the unfinished uploads of", prefix, page)
            for u in r.get("Uploads", []):
                out.append(UploadInfo(u["Key"][len(self.prefix) :], u["UploadId"], u.get("Initiated")))
            if not r.get("IsTruncated"):
                return out
            marker = {"KeyMarker": r["NextKeyMarker"], "UploadIdMarker": r["NextUploadIdMarker"]}

    async def abort_uploads(self, uploads: Sequence[UploadInfo]) -> int:
        aborted = 0
        for u in uploads:
            try:
                await self.call("aborting the upload of", u.key, functools.partial(self._abort, u))
            except StoreError as exc:
                if exc.reason != "missing":
                    raise
            else:
                aborted += 1
        return aborted

    async def _abort(self, u: UploadInfo, c: Any) -> Any:
        return await c.abort_multipart_upload(Bucket=self.bucket, Key=self.full(u.key), UploadId=u.upload_id)

    async def close(self) -> None:
        context, self._context, self._client = self._context, None, None
        if context is not None:
            await context.__aexit__(None, None, None)
