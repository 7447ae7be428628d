"""``python -m async_stager verify DIR``: check committed checkpoints against their
checksums, without loading them into a model.

``DIR`` is a Checkpointer directory (every committed step is checked, newest commit
first) or one step folder. Prints one line per step, ``step-NNNNNNNN: ok (...)`` or
``step-NNNNNNNN: FAILED: <reason>``, and goes on to the older steps after a failure.
A step folder whose COMMIT record is damaged (its step changed, emptied) or missing is
a failed step too, listed first: it cannot be placed in commit order, so a restore
skips it and takes an older step; with ``--newest``, such folders above the newest
committed step are listed (one of them may have been the newest).
Exit status: 0 when every step checked verifies, 1 when any does not, 2 for a usage
error (``DIR`` does not exist, is not a folder, or holds no step folder).

The digests (``checksums.json``, see ``_integrity``): XXH3-64 per 8 MiB piece of each
tensor chunk's bytes; WSUM64 per piece for a tensor hashed on its GPU before the copy;
manifests of the first format (CRC-32 per 16 MiB piece) still verify.

A damaged checkpoint is a failed step, never a traceback: a missing, empty or truncated
data file (``__0_0.distcp``, ``state.pt``), unreadable DCP metadata, and a
``checksums.json`` that is missing, not JSON, or not shaped as a manifest (a null
digest, a missing field, a list where an object belongs) each give a one-line reason.
DCP's reader raises CheckpointException, a BaseException (``except Exception`` misses
it), whose text is a traceback per rank: it is caught per step and described by the
errors it carries; a KeyboardInterrupt it wraps still stops the command. The stored
bytes that a format-4 manifest covers (``.metadata``, ``state.pt``) are checked against
their digests before they are unpickled, as ``Checkpointer.restore`` does.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from async_stager._checkpoint.integrity import interrupt_in
from async_stager._checkpoint.statefuls import TORCH_FILE as _TORCH_FILE
from async_stager._checkpoint.stored import METADATA as _DCP_METADATA
from async_stager._core.checksum.digest import PIECE_BYTES

if TYPE_CHECKING:
    from async_stager._checkpoint.integrity import Manifest

__all__ = ["add_verify_parser", "describe", "run_verify", "verify_folder"]

#: The longest reason taken from a third-party message (torch's run to paragraphs).
_REASON_CHARS = 160
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def add_verify_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``verify`` and its flags on the command line's subparsers."""
    piece = f"{PIECE_BYTES // 2**20} MiB"
    p = sub.add_parser(
        "verify",
        help="check saved checkpoints against their checksums",
        description="Read back every tensor of each committed checkpoint under DIR (or of one step "
        "folder), newest commit first, and compare its digest with the one taken from the staged copy when "
        f"it was saved (checksums.json): XXH3-64 per {piece} piece, or WSUM64 per {piece} piece for a "
        "tensor hashed on its GPU before the copy; checkpoints of the first manifest format "
        "(CRC-32 per 16 MiB piece) still verify. One line per step; a damaged step is reported "
        "and the older steps are still checked; a step folder whose COMMIT record is damaged or "
        "missing is a failed step (restore skips it). Exit status 0: every step checked verifies; 1: "
        "some step does not; 2: DIR does not exist or holds no committed step.",
    )
    p.add_argument("directory", type=_directory, help="a Checkpointer directory or one step-NNNNNNNN folder")
    p.add_argument("--newest", action="store_true", help="check only the newest committed step")


def _directory(text: str) -> Path | str:
    """The DIR argument: a folder, or an object store's URL (``s3://bucket/prefix``,
    as a str); an empty one (an unset shell variable) is a usage error, not the current
    folder."""
    if not text:
        raise argparse.ArgumentTypeError("DIR is empty; give a Checkpointer directory or a step folder")
    from async_stager._checkpoint.options import resolve_directory
    from async_stager.errors import InvalidOptionError

    try:
        folder, url = resolve_directory(text)  # file:// names a folder; unsupported schemes are refused
    except InvalidOptionError as exc:
        raise argparse.ArgumentTypeError(
            str(exc).replace(
                "the Checkpointer does not support: it writes to", "verify does not read: it reads"
            )
        ) from None
    return folder if url is None else url


class UsageProblem(Exception):
    """``DIR`` cannot be checked at all (exit status 2): the message says why."""


def _folders(directory: Path, newest: bool) -> tuple[list[tuple[int | None, Path]], list[Path]]:
    """The step folders to check, newest commit first, and those whose COMMIT record is
    damaged or missing (``unordered_steps``: failed steps); UsageProblem if there are
    none of either."""
    from async_stager._checkpoint.commit import committed_steps, step_dir, unordered_steps

    if not directory.exists():
        raise UsageProblem(f"{directory} does not exist")
    if not directory.is_dir():
        raise UsageProblem(f"{directory} is not a folder (give a Checkpointer directory or a step folder)")
    m = re.match(r"^step-(\d+)$", directory.name)
    if m:
        return [(int(m.group(1)), directory)], []
    try:
        steps = list(reversed(committed_steps(directory)))
        unordered = unordered_steps(directory)
    except OSError as exc:
        raise UsageProblem(f"cannot list {directory}: {exc.strerror or exc}") from exc
    if not steps and not unordered:
        raise UsageProblem(f"no committed checkpoint (step-NNNNNNNN folder) in {directory}")
    if newest:
        steps = steps[:1]
        unordered = [s for s in unordered if not steps or s > steps[0]]
    return [(s, step_dir(directory, s)) for s in steps], [step_dir(directory, s) for s in reversed(unordered)]


def _first_line(text: str) -> str:
    """The first non-empty line of ``text``, ANSI escapes removed, cut to a sentence
    when it is long."""
    lines = [ln.strip() for ln in _ANSI.sub("", text).splitlines() if ln.strip()]
    line = lines[0] if lines else ""
    if len(line) > _REASON_CHARS:
        end = line.find(". ", 20)
        line = line[: end + 1] if 0 < end < _REASON_CHARS else line[: _REASON_CHARS - 3] + "..."
    return line


def _checkpoint_exceptions() -> tuple[type[BaseException], ...]:
    """DCP's CheckpointException (a BaseException, not an Exception: ``except
    Exception`` lets it through), imported when first needed (DCP is slow to import)."""
    try:
        from torch.distributed.checkpoint.api import CheckpointException
    except ImportError:  # pragma: no cover - torch without DCP
        return ()
    return (CheckpointException,)


def _damage() -> tuple[type[BaseException], ...]:
    """What reading a damaged checkpoint may raise: any Exception, and DCP's
    CheckpointException."""
    return (Exception, *_checkpoint_exceptions())


def describe(exc: BaseException) -> str:
    """One line for a person: why reading a checkpoint failed. DCP's
    CheckpointException (whose text is a traceback per rank) is described by the
    exceptions it carries; an OSError by its reason and the file's name."""
    failures = getattr(exc, "failures", None)
    if isinstance(exc, _checkpoint_exceptions()) and isinstance(failures, dict):
        parts = []
        for wrapped in failures.values():
            inner = wrapped[0] if isinstance(wrapped, tuple) and wrapped else wrapped
            text = describe(inner) if isinstance(inner, BaseException) else str(inner)
            if text not in parts:
                parts.append(text)
        return "; ".join(parts) or "DCP could not read it"
    if isinstance(exc, OSError) and exc.strerror:
        name = os.path.basename(str(exc.filename)) if exc.filename else ""
        return f"{exc.strerror}: {name}" if name else exc.strerror
    if isinstance(exc, EOFError):
        return "a file ends early (truncated)"
    text = _first_line(str(exc))
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _data_file_problem(folder: Path) -> str | None:
    """Why the DCP data files of ``folder`` cannot hold what its metadata says they do
    (a file missing, or shorter than the last byte a tensor is stored at), or None.
    A check of sizes only: the digests check the bytes."""
    import torch.distributed.checkpoint as dcp

    try:
        metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    except _damage() as exc:  # a damaged file
        return f"{_DCP_METADATA} cannot be read (truncated or damaged): {describe(exc)}"
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        return None  # another storage layout: DCP's reader says what is wrong
    ends: dict[str, int] = {}
    for info in storage.values():
        rel, offset, length = (getattr(info, a, None) for a in ("relative_path", "offset", "length"))
        if isinstance(rel, str) and isinstance(offset, int) and isinstance(length, int):
            ends[rel] = max(ends.get(rel, 0), offset + length)
    for rel, end in sorted(ends.items()):
        try:
            size = (folder / rel).stat().st_size
        except FileNotFoundError:
            return f"data file {rel} is missing"
        except OSError as exc:
            return f"data file {rel} cannot be read ({describe(exc)})"
        if size < end:
            return f"data file {rel} is truncated: {size} bytes, the metadata needs {end}"
    return None


def _verify_torch(step: int | None, folder: Path, manifest: Manifest) -> str:
    """The torch format, as ``Checkpointer.restore`` checks it: the file's digest
    (format 4) before it is unpickled; a file that fails it is still loaded with
    ``weights_only`` (nothing runs) so that a damaged tensor is named."""
    import torch

    from async_stager._checkpoint.integrity import verify_flat, verify_stored
    from async_stager.errors import IntegrityError

    torch_file = folder / _TORCH_FILE
    if not torch_file.is_file():
        raise IntegrityError(f"{_TORCH_FILE} is not a file", step=step)
    if torch_file.stat().st_size == 0:
        raise IntegrityError(f"{_TORCH_FILE} is empty (0 bytes)", step=step)
    damaged: IntegrityError | None = None
    try:
        verify_stored(folder, step, manifest)
    except IntegrityError as exc:
        damaged = exc
    try:
        with warnings.catch_warnings():  # torch's notes on a damaged file's pickle
            warnings.simplefilter("ignore")
            loaded = torch.load(torch_file, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise damaged or IntegrityError(
            f"{_TORCH_FILE} cannot be read (truncated or damaged): {describe(exc)}", step=step
        ) from exc
    if not isinstance(loaded, dict):
        raise damaged or IntegrityError(
            f"{_TORCH_FILE} holds a {type(loaded).__name__}, not a state dict", step=step
        )
    n = verify_flat(step, manifest.tensors, loaded)
    if damaged is not None:
        raise damaged
    return f"{n} tensors"


def _verify_dcp(step: int | None, folder: Path, manifest: Manifest) -> str:
    """The DCP format: ``.metadata``'s digest (format 4) before it is unpickled, then
    the data files' sizes against it (a missing or truncated file named as such), then
    ``_integrity.verify_dcp`` (every stored byte against the manifest)."""
    from async_stager._checkpoint.integrity import verify_dcp, verify_stored
    from async_stager.errors import IntegrityError

    if not (folder / _DCP_METADATA).exists():
        if any(folder.glob("*.distcp")):
            raise IntegrityError(f"{_DCP_METADATA} (DCP format) is missing", step=step)
        raise IntegrityError(
            f"neither {_TORCH_FILE} (torch format) nor {_DCP_METADATA} (DCP format) is in the folder",
            step=step,
        )
    if manifest.files:  # whole files (.metadata): checked before the size check reads it
        verify_stored(folder, step, dataclasses.replace(manifest, objects={}))
    problem = _data_file_problem(folder)
    if problem is not None:
        raise IntegrityError(problem, step=step)
    try:
        chunks = verify_dcp(folder, step)
    except _checkpoint_exceptions() as exc:
        stop = interrupt_in(exc)
        if stop is not None:
            raise stop from None
        raise IntegrityError(f"its DCP data cannot be read (damaged): {describe(exc)}", step=step) from exc
    return f"{chunks} tensor chunks"


def _verify(step: int | None, folder: Path) -> str:
    """``checksums.json`` first (``load_manifest``: missing, not JSON, not shaped as a
    manifest, an unknown format or hash), then the format's data."""
    from async_stager._checkpoint.integrity import load_manifest

    manifest = load_manifest(folder, step)
    torch_file = folder / _TORCH_FILE
    if torch_file.exists() or torch_file.is_symlink():
        return _verify_torch(step, folder, manifest)
    return _verify_dcp(step, folder, manifest)


def _one_line(exc: BaseException, folder: Path) -> str:
    """An IntegrityError's message as one line, without the folder it starts with (the
    line names the step) and with a DCP exception it embeds described, not dumped."""
    text = str(exc)
    cause: BaseException | None = exc
    seen = 0
    while cause is not None and seen < 8:  # a CheckpointException in the chain
        if isinstance(cause, _checkpoint_exceptions()):
            text = text.replace(str(cause), describe(cause))
        cause = cause.__cause__ or cause.__context__
        seen += 1
    for prefix in (f"{folder}: ", f"{folder.name}: "):
        text = text.removeprefix(prefix)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return " ".join(lines[:1] + (["..."] if len(lines) > 1 else []))


def verify_folder(step: int | None, folder: Path) -> str:
    """Verify one step folder (either format); returns a summary (``2 tensor chunks``).
    Raises IntegrityError, with a one-line message, for whatever keeps it from
    verifying: a mismatch, and any damage to its files (see the module doc)."""
    from async_stager.errors import IntegrityError

    try:
        return _verify(step, folder)
    except IntegrityError as exc:
        stop = interrupt_in(exc.__cause__)
        if stop is not None:
            raise stop from None
        raise IntegrityError(_one_line(exc, folder), step=step, tensor=exc.tensor) from exc
    except _damage() as exc:  # any damage: a failed step
        stop = interrupt_in(exc)
        if stop is not None:
            raise stop from None
        raise IntegrityError(f"cannot be verified: {describe(exc)}", step=step) from exc


def run_verify(ns: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Check the parsed ``verify`` command's folders (newest commit first), one line each on
    ``out``; the exit status (see the module doc)."""
    from async_stager.errors import IntegrityError

    if isinstance(ns.directory, str):
        return _verify_store(ns.directory, ns.newest, out)
    try:
        folders, unordered = _folders(ns.directory, ns.newest)
    except UsageProblem as exc:
        print(f"async-stager: error: {exc}", file=sys.stderr)
        return 2
    status = 0
    for folder in unordered:
        out.write(
            f"{folder.name}: FAILED: its COMMIT record is damaged or missing: it cannot be placed in "
            "commit order, so restore skips it (an older step is restored in its place)\n"
        )
        status = 1
    for step, folder in folders:
        try:
            summary = verify_folder(step, folder)
        except IntegrityError as exc:
            out.write(f"{folder.name}: FAILED: {exc}\n")
            status = 1
        else:
            out.write(f"{folder.name}: ok ({summary})\n")
        out.flush()
    return status


def _verify_store(url: str, newest: bool, out: TextIO) -> int:
    """``verify`` of an object store's committed steps, newest commit first: each
    downloaded into the scratch folder (``options.scratch_folder``) and verified there."""
    from async_stager._checkpoint.commit import StepGone, step_name
    from async_stager._checkpoint.options import scratch_folder
    from async_stager._checkpoint.store_place import StorePlace
    from async_stager.errors import IntegrityError, StoreError

    place = StorePlace(url, scratch_folder(url))
    try:
        place.open()
        steps = list(reversed(place.committed_steps()))
        if not steps:
            print(f"async-stager: error: {url} holds no committed checkpoint", file=sys.stderr)
            return 2
        status = 0
        for step in steps[:1] if newest else steps:
            try:
                with place.reading(step) as (folder, _seq, _held):
                    summary = verify_folder(step, folder)
            except StepGone:
                out.write(f"{step_name(step)}: retired while it was read (not checked)\n")
                continue
            except IntegrityError as exc:
                out.write(f"{step_name(step)}: FAILED: {exc}\n")
                status = 1
            else:
                out.write(f"{step_name(step)}: ok ({summary})\n")
            out.flush()
        return status
    except StoreError as exc:
        print(f"async-stager: error: {exc}", file=sys.stderr)
        return 2
    finally:
        place.close()
