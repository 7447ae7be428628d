"""Checksums per tensor chunk: taken while staging, stored beside the data in
``checksums.json``, checked against what is read back on restore and by
``python -m async_stager verify``.

The digest of a chunk is XXH3-64 per 8 MiB piece of its bytes in row-major order (see
``_digest``): the copy threads compute it as the bytes land in the host buffers
(``stager.lease(sd, checksums=True)``). A tensor of 1 MiB or more copied from a GPU is
hashed on the GPU before its copy, with WSUM64 (``_wordhash``: torch operations, so the
CPU recomputes it on restore), and its entry names that hash (manifest format 3). What
neither took (a small tensor from a device, a view of part of a storage) is hashed
from the staged host copy before it is written. Manifests of the first format (CRC-32
per 16 MiB piece, ``zlib.crc32``) are still verified.

A chunk is what DCP stores for one tensor on one rank: the whole tensor for a plain
tensor (offsets all zero), the local shard for a DTensor (its offsets in the global
tensor). Keys are DCP's flattened names (``model.layers.0.weight``) plus the offsets,
so a checkpoint written on N ranks verifies on any number of ranks.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
import time
import warnings
import zlib
from collections.abc import Iterable, Iterator
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from ._digest import ALGORITHM, PIECE_BYTES, Checksums, tensor_digest
from ._digest import chunk_key as key
from ._errors import IntegrityError
from ._wordhash import ALGORITHM as WSUM64
from ._wordhash import wsum64_digest

__all__ = [
    "HASH",
    "MANIFEST",
    "PIECE_BYTES",
    "checksum_in_thread",
    "checksum_state",
    "read_manifest",
    "tensor_crcs",
    "verify_dcp",
    "verify_flat",
    "write_manifest",
]

HASH = ALGORITHM
#: The file each checkpoint folder holds its checksums in.
MANIFEST = "checksums.json"
_FORMAT = "async_stager-checksums/2"
#: Format 2 plus a per-entry ``hash`` where it is not the document's (``wsum64``: a
#: digest its device took before the copy, see ``_wordhash``).
_FORMAT_MIXED = "async_stager-checksums/3"
#: The first format: CRC-32 per 16 MiB piece, read (verified) but no longer written.
_FORMAT_CRC = "async_stager-checksums/1"
_CRC_PIECE_BYTES = 16 * 2**20


def tensor_crcs(t: torch.Tensor, piece_bytes: int = _CRC_PIECE_BYTES) -> list[int]:
    """CRC-32 of each ``piece_bytes`` piece of a CPU tensor's bytes in row-major order
    (one CRC of nothing for an empty tensor): the first manifest format's digest."""
    t = t.detach().resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    n = t.numel() * t.element_size()
    if n == 0:
        return [zlib.crc32(b"")]
    buf = (ctypes.c_char * n).from_address(t.data_ptr())
    view = memoryview(buf).cast("B")
    return [zlib.crc32(view[i : i + piece_bytes]) for i in range(0, n, piece_bytes)]


def _chunk(value: Any) -> tuple[torch.Tensor, list[int]] | None:
    """The local data and global offsets of a tensor value as DCP stores it."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        chunks = value.__create_chunk_list__()
        offsets = [int(o) for o in chunks[0].offsets] if chunks else [0] * value.dim()
        return value.to_local(), offsets
    if isinstance(value, torch.Tensor):
        return value, [0] * value.dim()
    return None


def flatten(state: dict[str, Any]) -> dict[str, Any]:
    """DCP's flattened names for a nested state dict (``{'a': {'b': t}}`` -> ``a.b``)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(state)
    return dict(flat)


def tensor_chunks(state: dict[str, Any]) -> Iterator[tuple[str, str, torch.Tensor, list[int]]]:
    """Per tensor of ``state`` as DCP stores it: its manifest key, flattened name,
    local data and global offsets (non-tensor values skipped)."""
    for fqn, value in flatten(state).items():
        found = _chunk(value)
        if found is not None:
            local, offsets = found
            yield key(fqn, offsets), fqn, local, offsets


def checksum_state(
    state: dict[str, Any], *, threads: int = 1, known: Checksums | None = None
) -> tuple[dict[str, dict[str, Any]], int]:
    """The manifest's ``tensors`` table for a staged (host) state dict: each chunk's
    digest from ``known`` (computed while staging), else hashed now, by ``threads``
    threads. Returns the table and the bytes hashed now."""
    entries: dict[str, dict[str, Any]] = {}
    todo: list[tuple[str, torch.Tensor]] = []
    for k, fqn, local, offsets in tensor_chunks(state):
        digest = known.get(local) if known is not None else None
        entries[k] = {
            "fqn": fqn,
            "offsets": offsets,
            "shape": list(local.shape),
            "dtype": str(local.dtype).removeprefix("torch."),
            "digest": digest,
        }
        if digest is None:
            todo.append((k, local))
        elif known is not None and (algorithm := known.algorithm_of(local)) != HASH:
            # Hashed on its device (WSUM64): named per entry (format 3).
            entries[k]["hash"] = algorithm
    if threads > 1 and len(todo) > 1:
        with ThreadPoolExecutor(threads, thread_name_prefix="async-stager-digest") as pool:
            digests = list(pool.map(lambda item: tensor_digest(item[1]), todo))
    else:
        digests = [tensor_digest(t) for _, t in todo]
    for (k, _), digest in zip(todo, digests):
        entries[k]["digest"] = digest
    return entries, sum(t.numel() * t.element_size() for _, t in todo)


def write_manifest(folder: Path, step: int, tensors: dict[str, dict[str, Any]]) -> None:
    """Write ``checksums.json`` into ``folder`` and fsync it (the folder is fsynced by
    the commit)."""
    # Format 2 while every entry is XXH3 (what earlier versions read); 3 when some
    # entry names its own hash (a digest taken on a device).
    fmt = _FORMAT_MIXED if any("hash" in e for e in tensors.values()) else _FORMAT
    doc = {"format": fmt, "hash": HASH, "piece_bytes": PIECE_BYTES, "step": step, "tensors": tensors}
    path = folder / MANIFEST
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(folder: Path, step: int | None) -> dict[str, dict[str, Any]]:
    """The ``tensors`` table of a checkpoint folder; IntegrityError if it is missing or
    unreadable (a checkpoint that cannot be verified is not trusted)."""
    try:
        doc = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise IntegrityError(f"{folder}: no readable {MANIFEST} ({exc})", step=step) from exc
    fmt = (doc.get("format"), doc.get("hash"), doc.get("piece_bytes"))
    if fmt == (_FORMAT_CRC, "crc32", _CRC_PIECE_BYTES):
        tensors: dict[str, dict[str, Any]] = doc["tensors"]
        for entry in tensors.values():
            entry["digest"], entry["hash"] = entry.pop("crc32"), "crc32"
        return tensors
    if fmt not in ((_FORMAT, HASH, PIECE_BYTES), (_FORMAT_MIXED, HASH, PIECE_BYTES)):
        raise IntegrityError(
            f"{folder}: {MANIFEST} is not an {_FORMAT} or {_FORMAT_MIXED} {HASH} manifest of "
            f"{PIECE_BYTES}-byte pieces",
            step=step,
        )
    tensors = doc["tensors"]
    mixed = fmt[0] == _FORMAT_MIXED
    for k, entry in tensors.items():
        algorithm = entry.get("hash", HASH) if mixed else HASH
        if algorithm not in (HASH, WSUM64):
            raise IntegrityError(
                f"{folder}: {MANIFEST} names an unknown hash {algorithm!r} for {k}", step=step
            )
        entry["hash"] = algorithm
    return tensors


def _compare(step: int | None, k: str, entry: dict[str, Any], data: torch.Tensor) -> None:
    if list(data.shape) != entry["shape"]:
        raise IntegrityError(
            f"tensor {entry['fqn']!r} (offsets {entry['offsets']}) has shape {list(data.shape)}, "
            f"saved with {entry['shape']}",
            step=step,
            tensor=entry["fqn"],
        )
    algorithm = entry["hash"]
    piece = _CRC_PIECE_BYTES if algorithm == "crc32" else PIECE_BYTES
    if algorithm == "crc32":
        got = tensor_crcs(data)
    elif algorithm == WSUM64:
        got = wsum64_digest(data)
    else:
        got = tensor_digest(data)
    want = entry["digest"]
    if got != want:
        bad = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b) if len(got) == len(want) else 0
        raise IntegrityError(
            f"tensor {entry['fqn']!r} (offsets {entry['offsets']}): {entry['hash']} mismatch in bytes "
            f"{bad * piece}..{min((bad + 1) * piece, data.numel() * data.element_size())} "
            "of its data: the stored data is not what "
            "was staged (corrupted or torn file)",
            step=step,
            tensor=entry["fqn"],
        )


def verify_flat(step: int | None, tensors: dict[str, dict[str, Any]], loaded: dict[str, Any]) -> int:
    """Check a loaded (``torch.save`` format) state dict against its manifest; returns
    the number of tensors checked. Every tensor must have an entry and match."""
    seen = set()
    for k, fqn, local, _ in tensor_chunks(loaded):
        entry = tensors.get(k)
        if entry is None:
            raise IntegrityError(f"tensor {fqn!r} has no checksum", step=step, tensor=fqn)
        _compare(step, k, entry, local)
        seen.add(k)
    missing = set(tensors) - seen
    if missing:
        fqn = tensors[min(missing)]["fqn"]
        raise IntegrityError(f"tensor {fqn!r} is missing from the file", step=step, tensor=fqn)
    return len(seen)


def _batches(items: Iterable[tuple[str, Any]], limit: int) -> Iterable[list[tuple[str, Any]]]:
    batch: list[tuple[str, Any]] = []
    size = 0
    for fqn, md in items:
        nbytes = md.size.numel() * torch.empty((), dtype=md.properties.dtype).element_size()
        if batch and size + nbytes > limit:
            yield batch
            batch, size = [], 0
        batch.append((fqn, md))
        size += nbytes
    if batch:
        yield batch


def verify_dcp(
    folder: Path,
    step: int | None,
    *,
    part: tuple[int, int] = (0, 1),
    batch_bytes: int = 256 * 2**20,
) -> int:
    """Read back every tensor of a DCP checkpoint folder (through DCP's own reader, in
    batches of about ``batch_bytes``) and check each stored chunk against the manifest.
    ``part=(i, n)`` checks only every n-th tensor starting at the i-th (one rank's
    share). Returns the number of chunks checked; raises IntegrityError."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    tensors = read_manifest(folder, step)
    try:
        metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    except (Exception, dcp.api.CheckpointException) as exc:
        raise IntegrityError(f"{folder}: unreadable DCP metadata ({exc})", step=step) from exc
    by_fqn: dict[str, list[str]] = {}
    for k, entry in tensors.items():
        by_fqn.setdefault(entry["fqn"], []).append(k)
    items = sorted(
        (fqn, md) for fqn, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)
    )
    mine = [item for i, item in enumerate(items) if i % part[1] == part[0]]
    checked = 0
    for batch in _batches(mine, batch_bytes):
        target = {fqn: torch.empty(md.size, dtype=md.properties.dtype) for fqn, md in batch}
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(target, checkpoint_id=str(folder), no_dist=True)
        except Exception as exc:
            raise IntegrityError(
                f"{folder}: cannot read tensors {[f for f, _ in batch][:3]}... ({exc})",
                step=step,
                tensor=batch[0][0],
            ) from exc
        for fqn, md in batch:
            keys = {key(fqn, c.offsets): c for c in md.chunks}
            for k, chunk in keys.items():
                found = tensors.get(k)
                if found is None:
                    raise IntegrityError(
                        f"tensor {fqn!r} (offsets {list(chunk.offsets)}) has no checksum",
                        step=step,
                        tensor=fqn,
                    )
                region = target[fqn][tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))]
                _compare(step, k, found, region)
                checked += 1
            for k in by_fqn.pop(fqn, []):
                if k not in keys:
                    raise IntegrityError(
                        f"tensor {fqn!r}: chunk {k} is not in the checkpoint", step=step, tensor=fqn
                    )
        del target
    if part == (0, 1) and by_fqn:
        fqn = min(by_fqn)
        raise IntegrityError(f"tensor {fqn!r} is missing from the checkpoint", step=step, tensor=fqn)
    return checked


def checksum_in_thread(
    staged: dict[str, Any], threads: int, known: Checksums | None = None
) -> futures.Future[tuple[dict[str, dict[str, Any]], float, int]]:
    """Start ``checksum_state`` in a new thread (not a daemon: exiting waits for it);
    the future gives the table, the seconds it took and the bytes it hashed (what the
    stage did not). The caller keeps ``staged`` (its lease) until the future is done."""
    fut: futures.Future[tuple[dict[str, dict[str, Any]], float, int]] = futures.Future()

    def target() -> None:
        if not fut.set_running_or_notify_cancel():
            return
        t0 = time.monotonic()
        try:
            table, hashed = checksum_state(staged, threads=threads, known=known)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            fut.set_exception(exc)
        else:
            fut.set_result((table, time.monotonic() - t0, hashed))

    threading.Thread(target=target, name="async-stager-checksum", daemon=False).start()
    return fut
