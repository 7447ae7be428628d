"""A checkpoint folder's checksums manifest (``checksums.json``): its formats, writing
it, and reading it back checked entry by entry, so that a damaged manifest is named
precisely (the folder, the entry, the field) before anything in it is trusted.

The digests themselves are taken and compared in ``integrity``; this module only knows
the document's shape.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from async_stager._core.checksum.digest import ALGORITHM, PIECE_BYTES
from async_stager._core.checksum.wordhash import ALGORITHM as WSUM64
from async_stager.errors import IntegrityError

__all__ = [
    "CRC_PIECE_BYTES",
    "HASH",
    "MANIFEST",
    "Manifest",
    "load_manifest",
    "read_manifest",
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
CRC_PIECE_BYTES = 16 * 2**20


@dataclass(frozen=True)
class Manifest:
    """A checkpoint folder's ``checksums.json``: the tensor chunks' table, and (format
    4) the digests of its other stored bytes (None in older formats)."""

    tensors: dict[str, dict[str, Any]]
    files: dict[str, dict[str, Any]] | None
    objects: dict[str, dict[str, Any]] | None


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
    if fmt == (_FORMAT_CRC, "crc32", CRC_PIECE_BYTES):
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
