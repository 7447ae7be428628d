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

import contextlib
import ctypes
import os
import zlib
from collections.abc import Collection, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from async_stager._checkpoint.manifest import (
    CRC_PIECE_BYTES,
    HASH,
    MANIFEST,
    Manifest,
    load_manifest,
    read_manifest,
    write_manifest,
)
from async_stager._core.checksum.digest import (
    PIECE_BYTES,
    Checksums,
    chunk_key as key,
    tensor_digest,
)
from async_stager._core.checksum.wordhash import ALGORITHM as WSUM64, OFFLOAD_BYTES, wsum64_digest
from async_stager._core.copy.device import cuda_context_devices
from async_stager._dcp.blocking import no_dist_quiet
from async_stager.errors import IntegrityError

__all__ = [
    "HASH",
    "MANIFEST",
    "Manifest",
    "PIECE_BYTES",
    "checksum_state",
    "interrupt_in",
    "load_manifest",
    "rank_cuda_device",
    "read_manifest",
    "tensor_crcs",
    "verify_dcp",
    "verify_flat",
    "verify_stored",
    "write_manifest",
]


def tensor_crcs(t: torch.Tensor, piece_bytes: int = CRC_PIECE_BYTES) -> list[int]:
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


def interrupt_in(exc: BaseException | None) -> BaseException | None:
    """The KeyboardInterrupt or SystemExit that ``exc`` is or carries, else None.

    DCP's loader catches BaseException and hands it on wrapped in a CheckpointException
    (its ``failures``: rank -> the exception, or a tuple whose first item is it), so a
    Ctrl-C during ``dcp.load`` arrives looking like a read failure. Whoever turns a
    CheckpointException into an IntegrityError asks this first and re-raises what it
    finds (``raise stop from None``): an interrupt stops the command or the restore, it
    is never a damaged step to fall back from."""
    seen = 0
    todo: list[Any] = [exc]
    while todo and seen < 64:  # a CheckpointException may carry another
        inner = todo.pop()
        seen += 1
        if isinstance(inner, tuple):
            inner = inner[0] if inner else None
        if isinstance(inner, (KeyboardInterrupt, SystemExit)):
            return inner
        failures = getattr(inner, "failures", None) if isinstance(inner, BaseException) else None
        if isinstance(failures, dict):
            todo.extend(failures.values())
    return None


def verify_stored(folder: Path, step: int | None, manifest: Manifest) -> int:
    """Check the stored bytes that are not tensor data (whole files, DCP's bytes items)
    against a format-4 manifest; returns how many were checked (0 for older formats).
    Runs before anything in them is unpickled."""
    from async_stager._checkpoint.stored import check_path, file_digest, framing_digest

    checked = 0
    for name, entry in (manifest.files or {}).items():
        skip = entry.get("skip")  # a DCP data file: all but its tensors' raw bytes

        def read(skip: Any = skip, name: str = name) -> dict[str, Any]:
            path = check_path(folder, name)
            return file_digest(path) if skip is None else framing_digest(path, skip)

        _compare_stored(folder, step, f"file {name!r}", entry, read)
        checked += 1
    for fqn, entry in (manifest.objects or {}).items():
        _compare_stored(
            folder,
            step,
            f"value {fqn!r}",
            entry,
            lambda e=entry: file_digest(check_path(folder, e["file"]), e["offset"], e["length"]),
        )
        checked += 1
    return checked


def _compare_stored(folder: Path, step: int | None, what: str, entry: dict[str, Any], read: Any) -> None:
    try:
        got = read()
    except FileNotFoundError as exc:
        raise IntegrityError(f"{folder}: {what} is missing", step=step) from exc
    except (OSError, ValueError) as exc:
        raise IntegrityError(f"{folder}: {what} is unreadable ({exc})", step=step) from exc
    if got["bytes"] != entry["bytes"]:
        raise IntegrityError(
            f"{folder}: {what} has {got['bytes']} bytes, saved with {entry['bytes']} (truncated or torn file)",
            step=step,
        )
    if got["digest"] != entry["digest"]:
        raise IntegrityError(
            f"{folder}: {what}: {HASH} mismatch: the stored bytes are not what was written (corrupted file)",
            step=step,
        )


def rank_cuda_device() -> int | None:
    """The CUDA device this rank hashes on (WSUM64 of a big host chunk goes to a GPU):
    ``LOCAL_RANK``'s device when it has a context, else the first device with one;
    None (hash on the CPU) when this process has no CUDA context. Never the calling
    thread's ``current_device()``: in a worker thread that is device 0, so every rank
    would create a context (about 0.5 GiB) on GPU 0. Creates no context."""
    devices = cuda_context_devices()
    if not devices:
        return None
    local = os.environ.get("LOCAL_RANK", "")
    if local.isdigit():
        index = int(local) % max(torch.cuda.device_count(), 1)
        if index in devices:
            return index
    return devices[0]


def _hashing_on(data: torch.Tensor, device: int | None) -> contextlib.AbstractContextManager[Any]:
    """The current device while ``data`` is hashed with WSUM64: the tensor's own when it
    is on CUDA; for a host tensor big enough to be hashed on a GPU (``OFFLOAD_BYTES``),
    ``device`` (the rank's, ``rank_cuda_device`` when None); else none (the CPU)."""
    if data.device.type == "cuda":
        return torch.cuda.device(data.device)
    if data.numel() * data.element_size() < OFFLOAD_BYTES:
        return contextlib.nullcontext()
    index = device if device is not None else rank_cuda_device()
    return torch.cuda.device(index) if index is not None else contextlib.nullcontext()


def _compare(
    step: int | None,
    k: str,
    entry: dict[str, Any],
    data: torch.Tensor,
    device: int | None = None,
    stored: str = "",
) -> None:
    if list(data.shape) != entry["shape"]:
        raise IntegrityError(
            f"tensor {entry['fqn']!r} (offsets {entry['offsets']}) has shape {list(data.shape)}, "
            f"saved with {entry['shape']}",
            step=step,
            tensor=entry["fqn"],
        )
    algorithm = entry["hash"]
    piece = CRC_PIECE_BYTES if algorithm == "crc32" else PIECE_BYTES
    if algorithm == "crc32":
        got = tensor_crcs(data)
    elif algorithm == WSUM64:
        with _hashing_on(data, device):
            got = wsum64_digest(data)
    else:
        got = tensor_digest(data)
    want = entry["digest"]
    if got != want:
        bad = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b) if len(got) == len(want) else 0
        raise IntegrityError(
            f"tensor {entry['fqn']!r} (offsets {entry['offsets']}): {entry['hash']} mismatch in bytes "
            f"{bad * piece}..{min((bad + 1) * piece, data.numel() * data.element_size())} "
            f"of its data{stored}: the stored data is not what "
            "was staged (corrupted or torn file)",
            step=step,
            tensor=entry["fqn"],
        )


def verify_flat(
    step: int | None, tensors: dict[str, dict[str, Any]], loaded: dict[str, Any], *, device: int | None = None
) -> int:
    """Check a loaded (``torch.save`` format) state dict against its manifest; returns
    the number of tensors checked. Every tensor must have an entry and match.
    ``device``: the CUDA device big host chunks are hashed on (None: the rank's,
    ``rank_cuda_device``)."""
    seen = set()
    for k, fqn, local, _ in tensor_chunks(loaded):
        entry = tensors.get(k)
        if entry is None:
            raise IntegrityError(f"tensor {fqn!r} has no checksum", step=step, tensor=fqn)
        _compare(step, k, entry, local, device)
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
    device: int | None = None,
    only: Collection[str] | None = None,
) -> int:
    """Read back every tensor of a DCP checkpoint folder (through DCP's own reader, in
    batches of about ``batch_bytes``) and check each stored chunk against the manifest.
    ``part=(i, n)`` checks only every n-th tensor starting at the i-th (one rank's
    share). ``only``: just those tensors (flattened names), nothing else of the folder. ``device``: the CUDA device big chunks are hashed on (None: the rank's,
    ``rank_cuda_device``; any thread may call this). Returns the number of chunks
    checked; raises IntegrityError."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    manifest = load_manifest(folder, step)
    tensors = manifest.tensors
    if part[0] == 0 and only is None:
        verify_stored(folder, step, manifest)  # .metadata before DCP unpickles it
    try:
        metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    except (Exception, dcp.api.CheckpointException) as exc:
        stop = interrupt_in(exc)
        if stop is not None:
            raise stop from None
        raise IntegrityError(f"{folder}: unreadable DCP metadata ({exc})", step=step) from exc
    by_fqn: dict[str, list[str]] = {}
    for k, entry in tensors.items():
        by_fqn.setdefault(entry["fqn"], []).append(k)
    items = sorted(
        (fqn, md)
        for fqn, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata) and (only is None or fqn in only)
    )
    mine = [item for i, item in enumerate(items) if i % part[1] == part[0]]
    checked = 0
    for batch in _batches(mine, batch_bytes):
        target = {fqn: torch.empty(md.size, dtype=md.properties.dtype) for fqn, md in batch}
        try:
            with no_dist_quiet():
                dcp.load(target, checkpoint_id=str(folder), no_dist=True)
        except (Exception, dcp.api.CheckpointException) as exc:  # a BaseException: a short or missing file
            stop = interrupt_in(exc)
            if stop is not None:  # Ctrl-C inside DCP's reader: not a damaged step
                raise stop from None
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
                info = (metadata.storage_data or {}).get(MetadataIndex(fqn, chunk.offsets))
                # The file (an incremental step's may be a link shared with other steps).
                stored = f" (stored in {folder / str(info.relative_path)})" if info is not None else ""
                _compare(step, k, found, region, device, stored)
                checked += 1
            for k in by_fqn.pop(fqn, []):
                if k not in keys:
                    raise IntegrityError(
                        f"tensor {fqn!r}: chunk {k} is not in the checkpoint", step=step, tensor=fqn
                    )
        del target
    if part == (0, 1) and by_fqn and only is None:
        fqn = min(by_fqn)
        raise IntegrityError(f"tensor {fqn!r} is missing from the checkpoint", step=step, tensor=fqn)
    return checked
