"""Digests of the stored bytes that are not tensor data: whole files and DCP's bytes
items, so that every stored value of a checkpoint is covered by its manifest.

Tensor chunks are hashed from the staged copy (``_integrity``). What else a checkpoint
stores (ints, strings, lists, dataclasses and other objects, with the tensors inside
them, which DCP pickles as *bytes items*; DCP's ``.metadata``; the ``torch`` format's
single file) is hashed here, with the same digest (XXH3-64 per 8 MiB piece):

- ``torch`` format: ``state.pt`` is hashed as it is written (``HashingFile``), so the
  digest is of the bytes handed to the file system, at no extra read.
- ``dcp`` format: after every rank's files are written, the coordinator reads
  ``.metadata`` (``dcp_layout``: which items each data file holds) and sends it to
  every rank; each rank reads back the byte range of every bytes item (small:
  non-tensor values) in its own files and hashes them, and hashes each of its data
  files whole except the raw bytes of its tensors (``skip``: those are the tensor
  chunks' own digests): the zip framing ``torch.save`` wraps each tensor item in, a
  few hundred bytes each, is covered too, so a flipped byte anywhere in a file is
  found, even one no reader checks. No rank reads another's files: on several nodes
  each writes into a local folder of its own (an object store's scratch).

On restore these are checked before anything is unpickled, so a torn or corrupted
file is an IntegrityError (the Checkpointer falls back to an older step), never a
load of wrong values or an unpickling crash.
"""

from __future__ import annotations

import io
import os
import re
import struct
import zipfile
from pathlib import Path
from typing import IO, Any

from async_stager._core.checksum.digest import PIECE_BYTES, hasher

__all__ = [
    "METADATA",
    "HashingFile",
    "Layout",
    "bytes_digest",
    "dcp_file_digests",
    "dcp_layout",
    "dcp_stored",
    "file_digest",
    "framing_digest",
]

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
    out = _Digester()
    buf = bytearray(_READ_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        while length is None or out.total < length:
            want = _READ_BYTES if length is None else min(_READ_BYTES, length - out.total)
            got = f.readinto(view[:want])
            if not got:
                break
            out.update(view[:got])
    return {"bytes": out.total, "digest": out.result()}


class _Digester:
    """Feeds a byte stream into XXH3-64 pieces of ``PIECE_BYTES`` (as ``file_digest``)."""

    def __init__(self) -> None:
        self._xxh = hasher()
        self._piece = self._xxh.xxh3_64()
        self._fill = 0
        self.total = 0
        self.digest: list[int] = []

    def update(self, view: memoryview) -> None:
        at = 0
        while at < len(view):
            take = min(PIECE_BYTES - self._fill, len(view) - at)
            self._piece.update(view[at : at + take])
            self._fill += take
            at += take
            if self._fill == PIECE_BYTES:
                self.digest.append(int(self._piece.intdigest()))
                self._piece = self._xxh.xxh3_64()
                self._fill = 0
        self.total += len(view)

    def result(self) -> list[int]:
        digest = list(self.digest)
        if self._fill or not digest:
            digest.append(int(self._piece.intdigest()))
        return digest


def framing_digest(path: Path, skip: list[list[int]]) -> dict[str, Any]:
    """``{"bytes": file size, "digest": [...]}``: the digest of every byte of ``path``
    outside the ``skip`` ranges (``[offset, length]``, sorted, disjoint: the raw tensor
    bytes, verified by their own digests), read in 1 MiB reads."""
    out = _Digester()
    buf = bytearray(_READ_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        at = 0
        for start, length in [*skip, [size, 0]]:
            # A file shorter than when it was written: hash what is there (its size
            # then differs from the recorded one, reported as truncated).
            start = min(max(start, at), size)
            f.seek(at)
            left = start - at
            while left:
                got = f.readinto(view[: min(_READ_BYTES, left)])
                if not got:
                    raise ValueError(f"{path.name}: short read at {start - left}")
                out.update(view[:got])
                left -= got
            at = min(start + length, size)
    return {"bytes": size, "digest": out.result()}


class _Region(io.RawIOBase):
    """A read-only window ``[offset, offset + length)`` of an open file, for ``zipfile``."""

    def __init__(self, f: IO[bytes], offset: int, length: int) -> None:
        self._f, self._offset, self._length, self._pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._length}[whence]
        self._pos = max(0, min(self._length, base + pos))
        return self._pos

    def read(self, n: int | None = -1) -> bytes:
        left = self._length - self._pos
        n = left if n is None or n < 0 else min(n, left)
        self._f.seek(self._offset + self._pos)
        data = self._f.read(n)
        self._pos += len(data)
        return data

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


_DATA_RECORD = re.compile(r"(^|/)data/\d+$")
_LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # a zip local file header, 30 bytes


def _tensor_data_range(f: IO[bytes], offset: int, length: int, nbytes: int) -> list[int] | None:
    """``[start, nbytes]`` (absolute) of the raw tensor bytes inside the ``torch.save``
    zip DCP stored at ``[offset, offset + length)``: its one stored (uncompressed)
    ``data/N`` record of exactly ``nbytes``; None if the item has another shape (then
    it is hashed whole)."""
    try:
        with zipfile.ZipFile(_Region(f, offset, length)) as z:  # type: ignore[arg-type]
            records = [i for i in z.infolist() if _DATA_RECORD.search(i.filename)]
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return None
    if len(records) != 1:
        return None
    info = records[0]
    if info.compress_type != zipfile.ZIP_STORED or info.file_size != nbytes:
        return None
    f.seek(offset + info.header_offset)
    header = f.read(_LOCAL_HEADER.size)
    if len(header) != _LOCAL_HEADER.size:
        return None
    fields = _LOCAL_HEADER.unpack(header)
    if fields[0] != b"PK\x03\x04":
        return None
    start = offset + info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
    if start + nbytes > offset + length:
        return None
    return [start, nbytes]


class HashingFile:
    """A binary file wrapper that hashes what is written through it, in order, per
    ``PIECE_BYTES`` piece (``torch.save`` writes sequentially). ``result()`` gives the
    ``file_digest`` of what was written."""

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self._digester = _Digester()

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = self._f.write(view)
        self._digester.update(view)
        return n if n is not None else len(view)

    def flush(self) -> None:
        self._f.flush()

    def fileno(self) -> int:
        return self._f.fileno()

    def result(self) -> dict[str, Any]:
        return {"bytes": self._digester.total, "digest": self._digester.result()}


#: A DCP checkpoint's data files and their items (``dcp_layout``): per file, per item,
#: its flattened name, offset, length, and for a tensor chunk its raw bytes (None: a
#: bytes item, -1: a tensor whose raw bytes cannot be told apart, hashed whole).
Layout = dict[str, list[tuple[str, int, int, int | None]]]


def dcp_layout(folder: Path) -> Layout:
    """The items of each data file of the DCP checkpoint written in ``folder``, from its
    ``.metadata`` (coordinator, after every rank's files are written): what each rank
    needs to digest its own files (``dcp_file_digests``) without reading the others'."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    layout: Layout = {}
    for index, info in (metadata.storage_data or {}).items():
        items = layout.setdefault(str(info.relative_path), [])
        md = metadata.state_dict_metadata.get(index.fqn)
        nbytes: int | None = -1
        if isinstance(md, BytesStorageMetadata):
            nbytes = None
        elif isinstance(md, TensorStorageMetadata) and not getattr(info, "transform_descriptors", None):
            nbytes = _chunk_bytes(md, index.offset)
            nbytes = -1 if nbytes is None else nbytes
        items.append((index.fqn, int(info.offset), int(info.length), nbytes))
    return layout


def dcp_file_digests(
    folder: Path, layout: Layout, names: list[str]
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """The digests of the data files ``names`` of ``layout`` (in ``folder``): ``files``
    (each whole but for its tensors' raw bytes, see the module docstring) and
    ``objects`` (each bytes item they hold: flattened name, file, offset, length,
    digest). Any rank, for the files it wrote."""
    files: dict[str, dict[str, Any]] = {}
    objects: dict[str, dict[str, Any]] = {}
    for rel in sorted(names):
        skip: list[list[int]] = []
        with open(folder / rel, "rb") as f:
            for fqn, offset, length, nbytes in sorted(layout[rel], key=lambda item: item[1]):
                if nbytes is None:
                    entry = file_digest(folder / rel, offset, length)
                    objects[fqn] = {"file": rel, "offset": offset, "length": length, **entry}
                elif nbytes >= 0:
                    found = _tensor_data_range(f, offset, length, nbytes)
                    if found is not None:
                        skip.append(found)
        files[rel] = {**framing_digest(folder / rel, skip), "skip": skip}
    return files, objects


def dcp_stored(
    folder: Path, parts: tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]] | None = None
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """The digests of a written DCP checkpoint's non-tensor bytes: ``files`` (its
    ``.metadata`` and data files) and ``objects`` (each bytes item). Coordinator, after
    every rank's files are written. ``parts``: the data files' digests the ranks took
    of their own files (``dcp_file_digests``; on several nodes the coordinator has only
    its own): only the files they lack are read here."""
    files = {METADATA: file_digest(folder / METADATA)}
    objects: dict[str, dict[str, Any]] = {}
    if parts is not None:
        files.update(parts[0])
        objects.update(parts[1])
    layout = dcp_layout(folder)
    more_files, more_objects = dcp_file_digests(folder, layout, [n for n in layout if n not in files])
    files.update(more_files)
    objects.update(more_objects)
    return files, objects


def _chunk_bytes(md: Any, offsets: Any) -> int | None:
    """Bytes of the chunk of a tensor's metadata at ``offsets`` (None if not found)."""
    import math

    if offsets is None:
        return None
    itemsize = md.properties.dtype.itemsize
    for chunk in md.chunks:
        if tuple(chunk.offsets) == tuple(offsets):
            return int(math.prod(chunk.sizes) * itemsize)
    return None


def check_path(folder: Path, rel: str) -> Path:
    """``folder / rel``, refusing a name that leaves the folder (a damaged manifest)."""
    path = (folder / rel).resolve()
    if os.path.commonpath([path, folder.resolve()]) != str(folder.resolve()):
        raise ValueError(f"{rel!r} is outside {folder}")
    return path
