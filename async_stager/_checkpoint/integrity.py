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
import json
import os
import zlib
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from async_stager._core.checksum.digest import (
    ALGORITHM,
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

HASH = ALGORITHM
#: The file each checkpoint folder holds its checksums in.
MANIFEST = "checksums.json"
_FORMAT = "async_stager-checksums/2"
#: Format 2 plus a per-entry ``hash`` where it is not the document's (``wsum64``: a
#: digest its device took before the copy, see ``_wordhash``).
_FORMAT_MIXED = "async_stager-checksums/3"
#: Format 3 plus ``files`` and ``objects``: digests of every stored byte that is not
#: tensor data (``_stored``): DCP's ``.metadata`` and bytes items, the torch format's file.
_FORMAT_STORED = "async_stager-checksums/4"
#: The first format: CRC-32 per 16 MiB piece, read (verified) but no longer written.
_FORMAT_CRC = "async_stager-checksums/1"
_CRC_PIECE_BYTES = 16 * 2**20


@dataclass(frozen=True)
class Manifest:
    """A checkpoint folder's ``checksums.json``: the tensor chunks' table, and (format
    4) the digests of its other stored bytes (None in older formats)."""

    tensors: dict[str, dict[str, Any]]
    files: dict[str, dict[str, Any]] | None
    objects: dict[str, dict[str, Any]] | None


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


def write_manifest(
    folder: Path,
    step: int,
    tensors: dict[str, dict[str, Any]],
    *,
    files: dict[str, dict[str, Any]] | None = None,
    objects: dict[str, dict[str, Any]] | None = None,
) -> None:
    """Write ``checksums.json`` into ``folder`` and fsync it (the folder is fsynced by
    the commit). ``files`` and ``objects``: the digests of the stored bytes that are
    not tensor data (``_stored``), which make it format 4."""
    # Format 2 while every entry is XXH3 (what earlier versions read); 3 when some
    # entry names its own hash (a digest taken on a device); 4 with stored bytes.
    if files is not None or objects is not None:
        fmt = _FORMAT_STORED
    else:
        fmt = _FORMAT_MIXED if any("hash" in e for e in tensors.values()) else _FORMAT
    doc: dict[str, Any] = {"format": fmt, "hash": HASH, "piece_bytes": PIECE_BYTES, "step": step}
    doc["tensors"] = tensors
    if fmt == _FORMAT_STORED:
        doc["files"] = files or {}
        doc["objects"] = objects or {}
    path = folder / MANIFEST
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


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


def _json_type(value: Any) -> str:
    """``value``'s JSON type, with an article: ``a list``, ``null``."""
    if value is None:
        return "null"
    for kind, name in ((bool, "a boolean"), (dict, "an object"), (list, "a list"), (str, "a string")):
        if isinstance(value, kind):
            return name
    return "a number"


def _shown(value: Any) -> str:
    """A JSON value as the manifest holds it, cut to 40 characters."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_counts(value: Any) -> bool:
    return isinstance(value, list) and all(_is_count(v) for v in value)


def _digests(below: int) -> Callable[[Any], bool]:
    """A check of a digest field: a non-empty list of unsigned values below ``below``
    (2**64 for XXH3-64 and WSUM64, 2**32 for the first format's CRC-32)."""
    return lambda value: (
        isinstance(value, list) and len(value) > 0 and all(_is_count(v) and v < below for v in value)
    )


#: A manifest entry's required field: its name, its check, what it must be (for the message).
_Field = tuple[str, Callable[[Any], bool], str]
_STRING = "a string"
_COUNTS = "a list of integers >= 0"
_COUNT = "an integer >= 0"
_DIGESTS = "a list of unsigned digests"


def _tensor_fields(digest: str, below: int) -> tuple[_Field, ...]:
    return (
        ("fqn", lambda v: isinstance(v, str), _STRING),
        ("offsets", _is_counts, _COUNTS),
        ("shape", _is_counts, _COUNTS),
        ("dtype", lambda v: isinstance(v, str), _STRING),
        (digest, _digests(below), _DIGESTS),
    )


_TENSOR_FIELDS = _tensor_fields("digest", 2**64)
#: The first format keeps its CRC-32 values (32-bit) under ``crc32``.
_CRC_TENSOR_FIELDS = _tensor_fields("crc32", 2**32)
_STORED_FIELDS: tuple[_Field, ...] = (("bytes", _is_count, _COUNT), ("digest", _digests(2**64), _DIGESTS))
_OBJECT_FIELDS: tuple[_Field, ...] = (
    ("file", lambda v: isinstance(v, str), _STRING),
    ("offset", _is_count, _COUNT),
    ("length", _is_count, _COUNT),
    *_STORED_FIELDS,
)


def _entry_problem(where: str, entry: Any, fields: tuple[_Field, ...]) -> str | None:
    """Why a manifest entry is not what ``fields`` say (``where`` names it), or None.
    Every field's presence first, then each one's value, in ``fields`` order."""
    if not isinstance(entry, dict):
        return f"{where} is {_json_type(entry)}, not an object"
    for name, _, _ in fields:
        if name not in entry:
            return f"{where} has no {name!r}"
    for name, check, wanted in fields:
        if not check(entry[name]):
            return f"{where}: {name!r} is {_shown(entry[name])}, not {wanted}"
    if "hash" in entry and not isinstance(entry["hash"], str):
        return f"{where}: 'hash' is {_shown(entry['hash'])}, not a string"
    return None


def _os_reason(exc: OSError) -> str:
    """An OSError as its reason and the file's name (``Permission denied: x``)."""
    if not exc.strerror:
        return str(exc)
    name = os.path.basename(str(exc.filename)) if exc.filename else ""
    return f"{exc.strerror}: {name}" if name else exc.strerror


def _check_recorded(folder: Path, step: int | None, text: str) -> None:
    """The manifest's bytes against the digest its COMMIT record took at the commit
    (format 2 records): a changed byte that still parses (a digit of an offset, a
    letter of a name) is found here, before any entry is trusted."""
    from async_stager._checkpoint.commit import recorded_manifest
    from async_stager._checkpoint.stored import bytes_digest

    entry = recorded_manifest(folder)
    if entry is None:
        return
    data = text.encode("utf-8")
    if entry.get("bytes") != len(data) or entry.get("digest") != bytes_digest(data):
        raise IntegrityError(
            f"{folder}: {MANIFEST} is not the manifest committed with this step "
            f"({len(data)} bytes; its COMMIT record took {entry.get('bytes')} and another digest)",
            step=step,
        )


def _is_ranges(value: Any) -> bool:
    """A sorted list of disjoint ``[offset, length]`` pairs of counts."""
    if not isinstance(value, list):
        return False
    at = 0
    for pair in value:
        if not (isinstance(pair, list) and len(pair) == 2 and all(map(_is_count, pair))):
            return False
        if pair[0] < at:
            return False
        at = pair[0] + pair[1]
    return True


def _table(folder: Path, step: int | None, doc: dict[str, Any], name: str) -> dict[str, Any]:
    if name not in doc:
        raise IntegrityError(f"{folder}: {MANIFEST} has no {name!r} table", step=step)
    table = doc[name]
    if not isinstance(table, dict):
        raise IntegrityError(
            f"{folder}: {MANIFEST}: {name!r} is {_json_type(table)}, not an object", step=step
        )
    return table


def _check_entries(
    folder: Path, step: int | None, what: str, table: dict[str, Any], fields: tuple[_Field, ...]
) -> None:
    for k, entry in table.items():
        problem = _entry_problem(f"{MANIFEST}: {what} {k!r}", entry, fields)
        if problem is not None:
            raise IntegrityError(f"{folder}: {problem}", step=step)


def load_manifest(folder: Path, step: int | None) -> Manifest:
    """The whole manifest of a checkpoint folder, checked entry by entry.

    Raises IntegrityError, whose message starts with the folder and says what is wrong
    in one line (``checksums.json is missing``, ``is not valid JSON``, ``holds a list,
    not an object``, ``entry 'w@0': 'digest' is null, not a list of unsigned
    digests``, ``entry 'w@0' has no 'fqn'``, an unknown format or hash name): a
    checkpoint that cannot be verified is not trusted. Its shape: an object with a
    ``tensors`` object of entries, each with a string ``fqn`` and ``dtype``, integer
    lists ``offsets`` and ``shape`` and a non-empty list of unsigned digests (64-bit
    ``digest``; the first format: 32-bit ``crc32``), and (format 4) ``files`` and
    ``objects`` tables of the stored bytes' sizes and digests. Each tensor entry comes
    back with its ``hash`` set (and the first format's ``crc32`` moved to ``digest``)."""
    path = folder / MANIFEST
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise IntegrityError(
            f"{folder}: {MANIFEST} is missing (a checkpoint without checksums is not trusted)", step=step
        ) from exc
    except UnicodeDecodeError as exc:
        raise IntegrityError(f"{folder}: {MANIFEST} is not UTF-8 text", step=step) from exc
    except OSError as exc:
        raise IntegrityError(f"{folder}: {MANIFEST} cannot be read ({_os_reason(exc)})", step=step) from exc
    try:
        doc = json.loads(text)
    except ValueError as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise IntegrityError(f"{folder}: {MANIFEST} is not valid JSON ({reason})", step=step) from exc
    except RecursionError as exc:  # a document nested thousands deep
        raise IntegrityError(
            f"{folder}: {MANIFEST} is not valid JSON (nested too deeply)", step=step
        ) from exc
    if not isinstance(doc, dict):
        raise IntegrityError(f"{folder}: {MANIFEST} holds {_json_type(doc)}, not an object", step=step)
    manifest = _parse_manifest(folder, step, doc)
    # After the shape checks, so a damaged entry is named precisely; then the bytes
    # against the commit's record, which finds a change that still parses.
    _check_recorded(folder, step, text)
    return manifest


def _parse_manifest(folder: Path, step: int | None, doc: dict[str, Any]) -> Manifest:
    tensors: dict[str, Any] = _table(folder, step, doc, "tensors")
    fmt = (doc.get("format"), doc.get("hash"), doc.get("piece_bytes"))
    if fmt == (_FORMAT_CRC, "crc32", _CRC_PIECE_BYTES):
        _check_entries(folder, step, "entry", tensors, _CRC_TENSOR_FIELDS)
        for entry in tensors.values():
            entry["digest"], entry["hash"] = entry.pop("crc32"), "crc32"
        return Manifest(tensors, None, None)
    known = (
        (_FORMAT, HASH, PIECE_BYTES),
        (_FORMAT_MIXED, HASH, PIECE_BYTES),
        (_FORMAT_STORED, HASH, PIECE_BYTES),
    )
    if fmt not in known:
        raise IntegrityError(
            f"{folder}: {MANIFEST} is not an async_stager checksums manifest this version reads "
            f"(format {fmt[0]!r}, hash {fmt[1]!r}, {fmt[2]!r}-byte pieces)",
            step=step,
        )
    _check_entries(folder, step, "entry", tensors, _TENSOR_FIELDS)
    mixed = fmt[0] != _FORMAT
    for k, entry in tensors.items():
        algorithm = entry.get("hash", HASH) if mixed else HASH
        if algorithm not in (HASH, WSUM64):
            raise IntegrityError(
                f"{folder}: {MANIFEST} names an unknown hash {algorithm!r} for {k}", step=step
            )
        entry["hash"] = algorithm
    if fmt[0] != _FORMAT_STORED:
        return Manifest(tensors, None, None)
    files = _table(folder, step, doc, "files")
    objects = _table(folder, step, doc, "objects")
    _check_entries(folder, step, "file", files, _STORED_FIELDS)
    for name, entry in files.items():
        if "skip" in entry and not _is_ranges(entry["skip"]):
            raise IntegrityError(
                f"{folder}: {MANIFEST}: file {name!r}: 'skip' is {_shown(entry['skip'])}, "
                "not a sorted list of disjoint [offset, length] pairs",
                step=step,
            )
    _check_entries(folder, step, "value", objects, _OBJECT_FIELDS)
    return Manifest(tensors, files, objects)


def read_manifest(folder: Path, step: int | None) -> dict[str, dict[str, Any]]:
    """The ``tensors`` table of a checkpoint folder (see ``load_manifest``)."""
    return load_manifest(folder, step).tensors


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
    step: int | None, k: str, entry: dict[str, Any], data: torch.Tensor, device: int | None = None
) -> None:
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
            "of its data: the stored data is not what "
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
) -> int:
    """Read back every tensor of a DCP checkpoint folder (through DCP's own reader, in
    batches of about ``batch_bytes``) and check each stored chunk against the manifest.
    ``part=(i, n)`` checks only every n-th tensor starting at the i-th (one rank's
    share). ``device``: the CUDA device big chunks are hashed on (None: the rank's,
    ``rank_cuda_device``; any thread may call this). Returns the number of chunks
    checked; raises IntegrityError."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    manifest = load_manifest(folder, step)
    tensors = manifest.tensors
    if part[0] == 0:
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
        (fqn, md) for fqn, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)
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
                _compare(step, k, found, region, device)
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
