"""Checkpoint formats: how a save's folder is written, checked and loaded.

The Checkpointer speaks only to ``CheckpointFormat``; ``"dcp"`` and ``"torch"`` are two
classes of it, and a third format is one more class registered in ``FORMATS``. Every
method but ``check_savable`` blocks and runs in a worker thread; the collective ones
(``write`` and ``verify`` on several ranks) are called by every rank in the same order.

What the commit protocol (``commit``) and the manifest (``integrity``) need from a
format is ``stored``: the digests of every file it wrote, so ``checksums.json`` covers
every stored byte and not only the tensors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection
from pathlib import Path
from typing import Any, ClassVar

import torch

from async_stager._checkpoint import integrity as _integrity
from async_stager._checkpoint.commit import recorded_layout
from async_stager._checkpoint.disk import dcp_writer
from async_stager._checkpoint.incremental import skipping_planner
from async_stager._checkpoint.ranks import Ranks
from async_stager._checkpoint.statefuls import (
    KEYS,
    TORCH_FILE,
    apply_loaded,
    check_dcp_savable,
    check_matches,
    check_torch_restorable,
    load_dcp,
    resolve,
    torch_write,
    typed_paths,
    write_typed_paths,
)
from async_stager._checkpoint.stored import Layout, dcp_file_digests, dcp_layout, dcp_stored, file_digest
from async_stager._core.copy.device import caller_cuda_device
from async_stager.errors import IntegrityError, InvalidOptionError

__all__ = [
    "FORMATS",
    "CheckpointFormat",
    "Stored",
    "DcpFormat",
    "TorchFormat",
    "drop_planner_state",
    "format_for",
    "format_of",
]

#: What ``stored`` returns: per file, its digest entry; per non-tensor value, its entry.
Stored = tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]


class CheckpointFormat(ABC):
    """One way of storing a checkpoint step's folder.

    ``name``: the Checkpointer's ``format=`` value. ``several_ranks``: it can hold a
    job of several ranks (each writing its part). ``budgeted``: a save can stream
    through ``host_budget_bytes`` instead of a full staged copy."""

    name: ClassVar[str]
    several_ranks: ClassVar[bool] = False
    budgeted: ClassVar[bool] = False

    def check_savable(self, sd: dict[str, Any]) -> None:
        """Refuse, at ``save()``, a value this format could not restore (raise
        CheckpointError naming its path). Runs on the event loop: cheap checks only."""

    @abstractmethod
    def write(
        self, staged: dict[str, Any], tmp: Path, ranks: Ranks, skip: Collection[str] = ()
    ) -> dict[str, Any] | None:
        """Write the staged copy into the save's folder ``tmp`` (fsynced); every rank
        calls it. Returns what ``stored`` needs about files digested while written
        (or None). ``staged`` is the lease's: read it, never keep it. ``skip``: the
        manifest keys of tensor chunks not to write (an incremental save references
        them; only formats that can, DCP)."""

    @abstractmethod
    def stored(self, tmp: Path, written: dict[str, Any] | None, parts: Stored | None = None) -> Stored:
        """The digests of every file the ranks wrote into ``tmp`` and of the stored
        non-tensor values (coordinator, at the commit, when checksums are on).
        ``parts``: what the ranks digested of their own files (``own_stored``), taken
        as is: on several nodes the coordinator's ``tmp`` holds only its own files."""

    def layout(self, tmp: Path) -> Any:
        """What every rank needs to digest its own files (``own_stored``), read by the
        coordinator after every rank's files are written and sent to every rank; None:
        the coordinator digests every file itself (a format of one process)."""
        return None

    def own_stored(self, tmp: Path, layout: Any, rank: int) -> Stored:
        """The digests of the files rank ``rank`` wrote into its ``tmp`` (every rank, at
        the commit, before the ranks' gather; ``layout``: the coordinator's)."""
        return {}, {}

    def verify(self, folder: Path, step: int, ranks: Ranks) -> None:
        """Check a committed step against its manifest before anything is loaded
        (every rank; raise IntegrityError on every rank if any rank's part is bad).
        Formats that verify while loading leave it empty."""

    @abstractmethod
    def load(self, state: dict[str, Any], folder: Path, step: int, ranks: Ranks, checksums: bool) -> None:
        """Load ``folder`` into ``state`` in place (every rank): tensors copied into,
        Statefuls given ``load_state_dict``, plain values replaced. A state that does
        not match raises CheckpointError before anything is loaded; a damaged file
        IntegrityError."""


def drop_planner_state(planner: Any) -> None:
    """Empty a DCP save planner's references to the state it planned (its flattened
    state dict, mappings and plans), whatever DCP still holds the planner by."""
    for name in ("state_dict", "original_state_dict", "mappings"):
        if isinstance(getattr(planner, name, None), dict):
            setattr(planner, name, {})
    for name in ("plan", "metadata"):
        if hasattr(planner, name):
            setattr(planner, name, None)


class DcpFormat(CheckpointFormat):
    """A folder per step that plain ``torch.distributed.checkpoint.load`` reads, plus
    ``keys.json`` (the key types DCP turns into strings) and, with checksums, the
    digests of each ``.distcp`` file's framing."""

    name = "dcp"
    several_ranks = True
    budgeted = True

    def check_savable(self, sd: dict[str, Any]) -> None:
        check_dcp_savable(sd)

    def write(
        self, staged: dict[str, Any], tmp: Path, ranks: Ranks, skip: Collection[str] = ()
    ) -> dict[str, Any] | None:
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        from async_stager._dcp.blocking import save_blocking

        if ranks.coordinator:
            write_typed_paths(tmp, typed_paths(staged))
        kwargs: dict[str, Any] = {
            "checkpoint_id": str(tmp),
            "cuda_device": caller_cuda_device(),
            "storage_writer": dcp_writer(tmp),  # a full disk's error names its file
        }
        if ranks.distributed:
            kwargs.update(process_group=ranks.group, no_dist=False)
        else:
            kwargs.update(no_dist=True)
        planner = skipping_planner(skip) if skip else DefaultSavePlanner()
        try:
            # save_blocking picks the host writer (no CUDA stream sync) for the path.
            save_blocking(staged, planner=planner, **kwargs)
        finally:
            # Hazard: after a failed save DCP keeps the planner reachable (a closure of
            # its write step outlives the call, out of reach of the collector), and the
            # planner holds its flattened copy of the staged dict: the staged buffers
            # would count as held for ever. Drop what it holds.
            drop_planner_state(planner)
        return None

    def stored(self, tmp: Path, written: dict[str, Any] | None, parts: Stored | None = None) -> Stored:
        files, objects = dcp_stored(tmp, parts)
        if (tmp / KEYS).exists():
            files[KEYS] = file_digest(tmp / KEYS)
        return files, objects

    def layout(self, tmp: Path) -> Layout:
        return dcp_layout(tmp)

    def own_stored(self, tmp: Path, layout: Any, rank: int) -> Stored:
        # DCP names each rank's data files ``__<rank>_<n>.distcp`` (the rank in the group).
        own = [name for name in layout if name.startswith(f"__{rank}_")]
        return dcp_file_digests(tmp, layout, own)

    def verify(self, folder: Path, step: int, ranks: Ranks) -> None:
        try:
            _integrity.verify_dcp(folder, step, part=(ranks.rank, ranks.world))
            mine: str | None = None
        except IntegrityError as exc:
            mine = f"{exc.tensor or ''}\0{exc}"
        bad = next((r for r in ranks.all_gather(mine) if r is not None), None)
        if bad is not None:
            tensor, message = bad.split("\0", 1)
            raise IntegrityError(message, step=step, tensor=tensor or None)

    def load(self, state: dict[str, Any], folder: Path, step: int, ranks: Ranks, checksums: bool) -> None:
        load_dcp(state, folder, step, group=ranks.group, distributed=ranks.distributed)


class TorchFormat(CheckpointFormat):
    """One ``torch.save`` file per step (one process), loaded with
    ``weights_only=True``: values it could not rebuild are refused at ``save``. With
    checksums the file is verified before it is unpickled."""

    name = "torch"

    def check_savable(self, sd: dict[str, Any]) -> None:
        check_torch_restorable(sd)

    def write(
        self, staged: dict[str, Any], tmp: Path, ranks: Ranks, skip: Collection[str] = ()
    ) -> dict[str, Any] | None:
        return torch_write(staged, tmp / TORCH_FILE)

    def stored(self, tmp: Path, written: dict[str, Any] | None, parts: Stored | None = None) -> Stored:
        return {TORCH_FILE: written or file_digest(tmp / TORCH_FILE)}, {}

    def load(self, state: dict[str, Any], folder: Path, step: int, ranks: Ranks, checksums: bool) -> None:
        manifest = _integrity.load_manifest(folder, step) if checksums else None
        damaged: IntegrityError | None = None
        if manifest is not None:
            try:
                _integrity.verify_stored(folder, step, manifest)  # the file, before unpickling it
            except IntegrityError as exc:
                damaged = exc
        try:
            loaded = torch.load(folder / TORCH_FILE, map_location="cpu", weights_only=True)
        except Exception as exc:  # a torn or missing file: not trusted
            raise damaged or IntegrityError(f"{folder / TORCH_FILE}: unreadable ({exc})", step=step) from exc
        if not isinstance(loaded, dict):
            raise damaged or IntegrityError(f"{folder / TORCH_FILE}: not a saved state", step=step)
        if manifest is not None:
            # A damaged file that still loads (weights_only: nothing runs) is named
            # down to its tensor where the tensors' digests can; never loaded.
            _integrity.verify_flat(step, manifest.tensors, loaded)
        if damaged is not None:
            raise damaged
        check_matches(resolve(state), loaded, step)
        apply_loaded(state, loaded, step)


#: The formats by name (``Checkpointer(format=...)``).
FORMATS: dict[str, CheckpointFormat] = {f.name: f for f in (DcpFormat(), TorchFormat())}


def format_of(folder: Path, default: CheckpointFormat) -> CheckpointFormat:
    """The format committed step ``folder`` was written in: its COMMIT record's
    ``layout``; for a record without one (an earlier version's), its files (``state.pt``:
    torch, ``.metadata``: DCP); else ``default`` (the Checkpointer's own). A folder
    written in one format and opened in the other is read in its own, never taken for
    damaged."""
    layout = recorded_layout(folder)
    if layout in FORMATS:
        return FORMATS[layout]
    if (folder / TORCH_FILE).is_file() and not (folder / ".metadata").exists():
        return FORMATS["torch"]
    if (folder / ".metadata").is_file() and not (folder / TORCH_FILE).exists():
        return FORMATS["dcp"]
    return default


def format_for(name: str) -> CheckpointFormat:
    """The format called ``name``; InvalidOptionError naming the known ones if none."""
    try:
        return FORMATS[name]
    except (KeyError, TypeError):
        known = ", ".join(repr(n) for n in FORMATS)
        raise InvalidOptionError(f"format must be one of {known}, got {name!r}") from None
