"""Digests of the stored bytes that are not tensor data: whole files and DCP's bytes
items, so that every stored value of a checkpoint is covered by its manifest.

Tensor chunks are hashed from the staged copy (``_integrity``). What else a checkpoint
stores (ints, strings, lists, dataclasses and other objects, with the tensors inside
them, which DCP pickles as *bytes items*; DCP's ``.metadata``; the ``torch`` format's
single file) is hashed here, with the same digest (XXH3-64 per 8 MiB piece):

- ``torch`` format: ``state.pt`` is hashed as it is written (``HashingFile``), so the
  digest is of the bytes handed to the file system, at no extra read.
- ``dcp`` format: after every rank's files are written, the coordinator reads back
  ``.metadata`` and the byte range of every bytes item (small: non-tensor values) and
  hashes them.

On restore these are checked before anything is unpickled, so a torn or corrupted
file is an IntegrityError (the Checkpointer falls back to an older step), never a
load of wrong values or an unpickling crash.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO, Any

from ._digest import PIECE_BYTES, hasher

__all__ = ["METADATA", "HashingFile", "bytes_digest", "dcp_stored", "file_digest"]

#: DCP's metadata file in a checkpoint folder.
METADATA = ".metadata"
_READ_BYTES = 1 << 20


def bytes_digest(data: bytes | memoryview) -> list[int]:
    """XXH3-64 of each ``PIECE_BYTES`` piece of ``data`` (one hash of nothing if empty)."""
    xxh = hasher()
    view = memoryview(data).cast("B")
    if len(view) == 0:
        return [int(xxh.xxh3_64_intdigest(b""))]
    return [int(xxh.xxh3_64_intdigest(view[a : a + PIECE_BYTES])) for a in range(0, len(view), PIECE_BYTES)]


def file_digest(path: Path, offset: int = 0, length: int | None = None) -> dict[str, Any]:
    """``{"bytes": n, "digest": [...]}`` of ``length`` bytes of ``path`` from ``offset``
    (to the end if None); a short file gives fewer bytes (which then mismatch). Reads
    through one 1 MiB buffer (a budgeted save's commit must not hold 8 MiB pieces)."""
    xxh = hasher()
    digest: list[int] = []
    total = 0
    buf = bytearray(_READ_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        piece, fill = xxh.xxh3_64(), 0
        while length is None or total < length:
            want = min(_READ_BYTES, PIECE_BYTES - fill)
            if length is not None:
                want = min(want, length - total)
            got = f.readinto(view[:want])
            if not got:
                break
            piece.update(view[:got])
            fill += got
            total += got
            if fill == PIECE_BYTES:
                digest.append(int(piece.intdigest()))
                piece, fill = xxh.xxh3_64(), 0
        if fill or not digest:
            digest.append(int(piece.intdigest()))
    return {"bytes": total, "digest": digest}


class HashingFile:
    """A binary file wrapper that hashes what is written through it, in order, per
    ``PIECE_BYTES`` piece (``torch.save`` writes sequentially). ``result()`` gives the
    ``file_digest`` of what was written."""

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self._xxh = hasher()
        self._piece = self._xxh.xxh3_64()
        self._fill = 0
        self._total = 0
        self._digest: list[int] = []

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = self._f.write(view)
        at = 0
        while at < len(view):
            take = min(PIECE_BYTES - self._fill, len(view) - at)
            self._piece.update(view[at : at + take])
            self._fill += take
            at += take
            if self._fill == PIECE_BYTES:
                self._digest.append(int(self._piece.intdigest()))
                self._piece = self._xxh.xxh3_64()
                self._fill = 0
        self._total += len(view)
        return n if n is not None else len(view)

    def flush(self) -> None:
        self._f.flush()

    def fileno(self) -> int:
        return self._f.fileno()

    def result(self) -> dict[str, Any]:
        digest = list(self._digest)
        if self._fill or not digest:
            digest.append(int(self._piece.intdigest()))
        return {"bytes": self._total, "digest": digest}


def dcp_stored(folder: Path) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """The digests of a written DCP checkpoint's non-tensor bytes: ``files`` (its
    ``.metadata``) and ``objects`` (each bytes item: flattened name, file, offset,
    length, digest). Coordinator, after every rank's files are written."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    files = {METADATA: file_digest(folder / METADATA)}
    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    objects: dict[str, dict[str, Any]] = {}
    storage = metadata.storage_data or {}
    for index, info in storage.items():
        md = metadata.state_dict_metadata.get(index.fqn)
        if not isinstance(md, BytesStorageMetadata):
            continue
        rel = str(info.relative_path)
        entry = file_digest(folder / rel, int(info.offset), int(info.length))
        objects[index.fqn] = {"file": rel, "offset": int(info.offset), "length": int(info.length), **entry}
    return files, objects


def check_path(folder: Path, rel: str) -> Path:
    """``folder / rel``, refusing a name that leaves the folder (a damaged manifest)."""
    path = (folder / rel).resolve()
    if os.path.commonpath([path, folder.resolve()]) != str(folder.resolve()):
        raise ValueError(f"{rel!r} is outside {folder}")
    return path
