"""What a store hands around: an object's bytes to put (``Payload``), what is known of a
stored object (``ObjectInfo``) or of an unfinished multipart upload (``UploadInfo``),
the transfer options and how a part size is chosen."""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from async_stager._store.retry import RetryPolicy
from async_stager.errors import InvalidOptionError, InvalidOptionTypeError

__all__ = [
    "MAX_PART",
    "MAX_PARTS",
    "MIN_PART",
    "ObjectInfo",
    "Payload",
    "TransferOptions",
    "UploadInfo",
    "as_view",
    "part_size_for",
    "ranges",
]

MiB = 1 << 20
#: S3's limits on a multipart upload: at most 10,000 parts, each at least 5 MiB (but
#: the last) and at most 5 GiB.
MAX_PARTS = 10_000
MIN_PART = 5 * MiB
MAX_PART = 5 << 30


def _tensor_bytes(t: Any, what: str) -> Any:
    """A CPU tensor's bytes as a NumPy uint8 array sharing its memory (any dtype, bf16
    included, which NumPy has no type for)."""
    import torch

    if t.device.type != "cpu":
        raise InvalidOptionError(f"{what}: a tensor on {t.device} (stage it to host memory first)")
    if not t.is_contiguous():
        raise InvalidOptionError(f"{what}: the tensor is not contiguous (give a contiguous copy)")
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def as_view(data: Any, *, writable: bool = False, what: str = "data") -> memoryview:
    """A flat byte view of a buffer (bytes, bytearray, memoryview, a NumPy array, a CPU
    tensor of any dtype), without copying it."""
    if type(data).__module__.startswith("torch") and hasattr(data, "untyped_storage"):
        data = _tensor_bytes(data, what)
    try:
        view = memoryview(data)
    except TypeError:
        raise InvalidOptionTypeError(
            f"{what}: a buffer (bytes, bytearray, memoryview, a contiguous array) is needed, "
            f"not {type(data).__name__}"
        ) from None
    if not view.c_contiguous:
        raise InvalidOptionError(f"{what}: the buffer is not contiguous (give a contiguous copy)")
    if writable and view.readonly:
        raise InvalidOptionError(
            f"{what}: the buffer is read-only (give a writable one: bytearray, an array)"
        )
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class Payload:
    """One object's bytes: a buffer, or a sequence of buffers read as one stream (the
    tensors of one file, without joining them first). ``read`` copies one part out of
    them: the only copy an upload makes, done once its bytes are in the budget."""

    def __init__(self, data: Any) -> None:
        items = list(data) if isinstance(data, (list, tuple)) else [data]
        self.views = [
            as_view(d, what=f"data[{i}]" if len(items) > 1 else "data") for i, d in enumerate(items)
        ]
        self.size = sum(v.nbytes for v in self.views)

    def read(self, start: int, length: int) -> bytes:
        """Bytes ``[start, start + length)`` of the stream, copied."""
        out = []
        pos = 0
        end = start + length
        for view in self.views:
            lo, hi = max(start, pos), min(end, pos + view.nbytes)
            if lo < hi:
                out.append(view[lo - pos : hi - pos])
            pos += view.nbytes
            if pos >= end:
                break
        return out[0].tobytes() if len(out) == 1 else b"".join(out)

    def whole(self) -> bytes:
        return self.read(0, self.size)


@dataclass(frozen=True)
class ObjectInfo:
    """A stored object: its ``key`` under the store's root, ``size`` in bytes, ``etag``
    (the store's version tag), ``modified`` (when it was written, UTC)."""

    key: str
    size: int
    etag: str = ""
    modified: datetime.datetime | None = None


@dataclass(frozen=True)
class UploadInfo:
    """A multipart upload begun and neither completed nor aborted (a writer killed
    mid-upload leaves one): not an object, invisible to ``list``, but its parts are
    stored (and billed) until it is aborted. ``upload_id`` is the store's handle."""

    key: str
    upload_id: str
    initiated: datetime.datetime | None = None


@dataclass(frozen=True)
class TransferOptions:
    """How an object is moved.

    ``part_size``: bytes per part of a multipart upload and per ranged read (default 16
    MiB, measured: docs/object_storage.md); raised for an object that would need more
    than 10,000 parts. ``concurrency``: parts in flight at once. ``multipart_threshold``:
    an object of at most this many bytes is one PUT (default: one part). ``budget_bytes``:
    the bytes of parts an upload may hold at once (default ``part_size * concurrency``);
    a part is read from its source only once its bytes fit. ``retry``: the RetryPolicy.
    ``abort_timeout``: seconds to wait for the abort of a failed upload."""

    part_size: int = 16 * MiB
    concurrency: int = 8
    multipart_threshold: int | None = None
    budget_bytes: int | None = None
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    abort_timeout: float = 30.0

    def __post_init__(self) -> None:
        for name in ("part_size", "concurrency"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidOptionError(f"{name}={value!r}: give an int >= 1")
        if not MIN_PART <= self.part_size <= MAX_PART:
            raise InvalidOptionError(
                f"part_size={self.part_size}: S3 takes parts of 5 MiB ({MIN_PART}) to 5 GiB ({MAX_PART})"
            )
        for name in ("multipart_threshold", "budget_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise InvalidOptionError(f"{name}={value!r}: give None or an int >= 1")
        if self.budget_bytes is not None and self.budget_bytes < self.part_size:
            raise InvalidOptionError(
                f"budget_bytes={self.budget_bytes} is less than one part (part_size={self.part_size})"
            )
        if self.threshold > self.budget:
            raise InvalidOptionError(
                f"multipart_threshold={self.threshold} is more than budget_bytes={self.budget}: an object "
                "sent in one PUT is held whole"
            )

    @property
    def threshold(self) -> int:
        return self.part_size if self.multipart_threshold is None else self.multipart_threshold

    @property
    def budget(self) -> int:
        return self.part_size * self.concurrency if self.budget_bytes is None else self.budget_bytes


def part_size_for(size: int, preferred: int) -> int:
    """``preferred``, or the smallest multiple of 1 MiB that keeps ``size`` within
    10,000 parts."""
    need = -(-size // MAX_PARTS)
    if need <= preferred:
        return preferred
    return -(-need // MiB) * MiB


def ranges(size: int, part: int, start: int = 0) -> Sequence[tuple[int, int]]:
    """(offset, length) of each part of ``size`` bytes from ``start``."""
    return [(start + off, min(part, size - off)) for off in range(0, size, part)]
