"""Incremental saves (``Checkpointer(incremental=True)``): a step writes only the tensors
whose content differs from the previous commit of this Checkpointer, and references the
others, already stored in that commit's data files.

How a reference is stored: the step's DCP ``.metadata`` names, for each unchanged
tensor, the same file, offset and length as the previous commit's metadata, and that
file is a hard link in the step's own folder (``ref-<seq>-__0_0.distcp``: ``seq`` is the
commit number of the step that wrote it, so two origins never share a name; a link of a
link keeps its name). So every committed step is a whole, self-contained folder: plain
``torch.distributed.checkpoint.load`` reads it, ``verify`` reads every byte it
references, a copy of the folder is a complete checkpoint, and retention stays a
folder's deletion: a data file's bytes are freed by the file system when the last step
that links it goes (the data of a kept step is never deleted). A reference is a name
relative to the step folder, never an absolute path; on a file system without hard
links the file is copied instead (a warning), which costs the bytes but stays whole.

The decision (``Increments.plan``, every rank, in the save's thread, after the staged
copy is hashed, before anything is written): the coordinator holds the base (the
previous commit of this Checkpointer, if it is still that commit: ``commit.reading``,
so no retention or replacement takes it meanwhile) and names it to every rank; each
rank compares its chunks' digests, shapes, dtypes and the global size with the base's
manifest and metadata; a tensor is referenced only when every rank found every one of
its chunks unchanged and its chunks are the base's (same sharding), else it is written
in full. The coordinator then links the base's data files that the references name
into the save's temporary folder and lets go of the base: from then on the data is the
save's own, whatever becomes of the base's folder (retired, replaced), and a hold never
waits on a commit (saves in flight commit in call order). At the commit
(``Increments.link``) it adds the references to the step's ``.metadata``, before the
manifest digests the folder. A crash anywhere leaves a temporary folder (links
included) that the next open removes; the committed steps are untouched.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import logging
import os
import pickle
import shutil
import threading
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from async_stager._checkpoint import commit as _commit
from async_stager._checkpoint.integrity import flatten, tensor_chunks, verify_dcp
from async_stager._checkpoint.manifest import HASH, load_manifest
from async_stager._checkpoint.ranks import Ranks
from async_stager._checkpoint.stored import file_digest
from async_stager._core.checksum.digest import chunk_key
from async_stager.errors import IntegrityError

__all__ = ["REF_PREFIX", "Increments", "Plan", "skipping_planner"]

_log = logging.getLogger("async_stager.checkpoint")

#: The name prefix of a data file linked from an earlier commit.
REF_PREFIX = "ref-"
_METADATA = ".metadata"


@dataclass
class Plan:
    """One incremental save's decision: its base step and folder, the tensors it
    references (flattened names), the chunk keys this rank does not write, their bytes."""

    step: int
    folder: Path
    seq: int
    reused: frozenset[str]
    skip: frozenset[str]
    reused_bytes: int
    metadata: Any
    #: The base's data files the references name -> their links' names in the step.
    names: dict[str, str] = dataclasses.field(default_factory=dict)
    #: The base's manifest: its tensor chunks' and its files' digests.
    tensors: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    files: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)


def _read_base(folder: Path, step: int) -> tuple[dict[str, dict[str, Any]], Any, dict[str, dict[str, Any]]]:
    """The base step's manifest tensors and its DCP metadata, the metadata's bytes
    checked against the manifest before they are unpickled."""
    manifest = load_manifest(folder, step)
    want = (manifest.files or {}).get(_METADATA)
    if want is None:
        raise IntegrityError(f"{folder}: its manifest has no digest of {_METADATA}", step=step)
    got = file_digest(folder / _METADATA)
    if got["bytes"] != want["bytes"] or got["digest"] != want["digest"]:
        raise IntegrityError(f"{folder}: {_METADATA} is not what was committed", step=step)
    with open(folder / _METADATA, "rb") as f:
        metadata = pickle.load(f)  # checked against the committed digest above
    return manifest.tensors, metadata, manifest.files or {}


def _mine(
    staged: dict[str, Any], table: dict[str, dict[str, Any]], base: dict[str, dict[str, Any]], md: Any
) -> tuple[set[str], dict[str, list[str]]]:
    """This rank's view: the tensors it has a changed (or new, reshaped, resharded)
    chunk of, and per other tensor its chunk keys found unchanged in the base."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.tensor import DTensor

    sizes = {fqn: list(v.shape) for fqn, v in flatten(staged).items() if isinstance(v, DTensor)}
    changed: set[str] = set()
    same: dict[str, list[str]] = {}
    for k, fqn, local, _ in tensor_chunks(staged):
        entry, old = table.get(k), base.get(k)
        meta = md.state_dict_metadata.get(fqn)
        unchanged = (
            entry is not None
            and old is not None
            and isinstance(meta, TensorStorageMetadata)
            and list(meta.size) == sizes.get(fqn, list(local.shape))
            and meta.properties.dtype == local.dtype
            and entry.get("hash", HASH) == old["hash"]
            and entry["digest"] == old["digest"]
            and entry["shape"] == old["shape"]
            and entry["dtype"] == old["dtype"]
        )
        if unchanged:
            same.setdefault(fqn, []).append(k)
        else:
            changed.add(fqn)
    return changed, same


class Increments:
    """The incremental saves of one Writer: the previous commit (``committed``), each
    save's plan and its hold on the base until its commit."""

    def __init__(self, root: Path, ranks: Ranks) -> None:
        self.root = root
        self.ranks = ranks
        #: The previous commit of this Checkpointer: its step and commit number.
        self.last: tuple[int, int | None] | None = None
        self._plans: dict[int, Plan] = {}
        self._holds: dict[int, contextlib.ExitStack] = {}
        self._lock = threading.Lock()
        #: The referenced chunks read back and found as committed, with the identity
        #: (device, inode, size, mtime) of the file each is stored in: the first
        #: reference of a chunk reads its bytes, later ones only if its file changed.
        self._checked: set[tuple[str, tuple[int, int, int, int]]] = set()

    def committed(self, step: int) -> None:
        """A save of this Checkpointer committed ``step`` (every rank)."""
        seq = _commit.commit_number(self.root, step) if self.ranks.coordinator else None
        self.last = (step, seq)

    def plan(
        self, seq: int, step: int, staged: dict[str, Any], table: dict[str, dict[str, Any]], tmp: Path
    ) -> Plan | None:
        """Decide what save number ``seq`` (of ``step``, into ``tmp``) references and
        link the base's data files it names into ``tmp`` (every rank, in call order:
        collectives). None: it writes everything (the first save, a base that is gone
        or replaced, a damaged base). The base is held only while this runs: once
        linked, its data stays whatever becomes of its folder."""
        ranks = self.ranks
        base: tuple[int, int] | None = None
        if ranks.coordinator:
            base = self._hold(seq, step)
        try:
            base = ranks.broadcast(base)
            if base is None:
                return None
            plan = self._decide(base, staged, table)
            linked = True
            if plan is not None and ranks.coordinator:
                linked = self._link_files(plan, tmp)
            # Every rank read the base before the hold goes, and learns the links' fate.
            if not ranks.broadcast(linked):
                plan = None
        finally:
            self._let_go(seq)
        if plan is not None:
            with self._lock:
                self._plans[seq] = plan
        return plan

    def _decide(
        self, base: tuple[int, int], staged: dict[str, Any], table: dict[str, dict[str, Any]]
    ) -> Plan | None:
        ranks = self.ranks
        folder = _commit.step_dir(self.root, base[0])
        try:
            tensors, md, files = _read_base(folder, base[0])
            changed, same = _mine(staged, table, tensors, md)
        except (IntegrityError, OSError, pickle.UnpicklingError, EOFError, AttributeError) as exc:
            _log.warning("incremental: step %d is not referenced, every tensor is written: %s", base[0], exc)
            tensors, md, files, changed, same = {}, None, {}, {"\0"}, {}
        views = ranks.all_gather((changed, same)) if ranks.distributed else [(changed, same)]
        if any("\0" in c for c, _ in views):
            return None
        all_changed = set().union(*(c for c, _ in views))
        found: dict[str, set[str]] = {}
        for _, s in views:
            for fqn, keys in s.items():
                found.setdefault(fqn, set()).update(keys)
        reused = set()
        for fqn, keys in found.items():
            meta = md.state_dict_metadata.get(fqn)
            if fqn in all_changed or meta is None:
                continue
            if keys == {chunk_key(fqn, c.offsets) for c in meta.chunks}:
                reused.add(fqn)  # every chunk, as the base holds them: the same sharding
        skip = frozenset(k for fqn, keys in same.items() if fqn in reused for k in keys)
        nbytes = sum(
            int(local.numel() * local.element_size()) for k, _, local, _ in tensor_chunks(staged) if k in skip
        )
        return Plan(
            base[0], folder, base[1], frozenset(reused), skip, nbytes, md, tensors=tensors, files=files
        )

    def _link_files(self, plan: Plan, tmp: Path) -> bool:
        """Coordinator: link the base's data files that ``plan``'s references name;
        False (none left behind, a warning) when one can be neither linked nor copied:
        the save then writes everything."""
        try:
            self._check_base(plan)
        except (IntegrityError, OSError) as exc:
            # The base's bytes are not what it committed (damaged since): a step that
            # referenced them would be damaged from its birth, though this save holds
            # the good data. It writes everything instead, and is whole.
            _log.warning(
                "incremental: step %d is damaged, every tensor is written (not referenced): %s",
                plan.step,
                exc,
            )
            return False
        try:
            for index, info in plan.metadata.storage_data.items():
                rel = str(info.relative_path)
                if index.fqn in plan.reused and rel not in plan.names:
                    name = rel if rel.startswith(REF_PREFIX) else f"{REF_PREFIX}{plan.seq}-{rel}"
                    _link(plan.folder / rel, tmp / name)
                    plan.names[rel] = name
        except OSError as exc:
            _log.warning(
                "incremental: step %d is not referenced, every tensor is written: %s", plan.step, exc
            )
            for name in plan.names.values():
                with contextlib.suppress(OSError):
                    (tmp / name).unlink()
            return False
        return True

    def _check_base(self, plan: Plan) -> None:
        """Read back the base's tensor chunks ``plan`` references whose file is not
        known good (IntegrityError or OSError naming the file when one is not what was
        committed): each chunk's raw bytes hashed in the file through a 1 MiB buffer; a
        chunk the manifest cannot place, hashed otherwise, or not matching (damaged, or
        stored transposed) is read through DCP's reader, which decides."""
        marks: dict[str, list[tuple[str, tuple[int, int, int, int]]]] = {}
        current: set[tuple[str, tuple[int, int, int, int]]] = set()
        starts: dict[str, list[list[int]]] = {}  # each file's raw tensor ranges, by start
        for index, info in plan.metadata.storage_data.items():
            if index.fqn not in plan.reused:
                continue
            rel = str(info.relative_path)
            path = plan.folder / rel
            st = os.stat(path)
            key = chunk_key(index.fqn, index.offset or ())
            mark = (key, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
            current.add(mark)
            if mark in self._checked:
                continue
            entry = plan.tensors.get(key)
            if rel not in starts:
                starts[rel] = sorted((plan.files.get(rel) or {}).get("skip") or [])
            ranges = starts[rel]
            at = bisect.bisect_left(ranges, [info.offset])
            raw = ranges[at] if at < len(ranges) and ranges[at][0] < info.offset + info.length else None
            if raw is not None and at + 1 < len(ranges) and ranges[at + 1][0] < info.offset + info.length:
                raw = None  # two ranges in one item: not a tensor's own
            if entry is None or entry.get("hash", HASH) != HASH or raw is None:
                marks.setdefault(index.fqn, []).append(mark)
                continue
            got = file_digest(path, raw[0], raw[1])
            if got["bytes"] != raw[1] or got["digest"] != entry["digest"]:
                # Damaged, or stored in another memory order than the digest's row-major
                # one (a transposed tensor): DCP's reader decides.
                marks.setdefault(index.fqn, []).append(mark)
        if marks:
            verify_dcp(plan.folder, plan.step, only=set(marks))
        # Only what this save references: the next one's base references no other.
        self._checked = current

    def _let_go(self, seq: int) -> None:
        with self._lock:
            stack = self._holds.pop(seq, None)
        if stack is not None:
            stack.close()

    def _hold(self, seq: int, step: int) -> tuple[int, int] | None:
        """Coordinator: hold the previous commit for save number ``seq`` if it is still
        that commit (and not the step this save replaces); its step and commit number."""
        last = self.last
        if last is None or last[1] is None:
            return None
        stack = contextlib.ExitStack()
        try:
            got, _ = stack.enter_context(_commit.reading(self.root, last[0]))
        except (_commit.StepGone, OSError, Exception):  # noqa: BLE001 - no base: a full save
            stack.close()
            return None
        if got != last[1]:
            stack.close()  # replaced by another writer: not this job's data
            return None
        with self._lock:
            self._holds[seq] = stack
        return last[0], got

    def plan_of(self, seq: int) -> Plan | None:
        with self._lock:
            return self._plans.get(seq)

    def release(self, seq: int) -> None:
        """Forget save number ``seq``'s plan (idempotent)."""
        self._let_go(seq)
        with self._lock:
            self._plans.pop(seq, None)

    def link(self, seq: int, tmp: Path) -> None:
        """Coordinator, at the commit of save number ``seq`` into ``tmp``: add its
        references to ``.metadata`` (rewritten, fsynced, renamed into place), naming
        the links ``plan`` made."""
        plan = self.plan_of(seq)
        if plan is None or not plan.reused:
            return
        base_md = plan.metadata
        with open(tmp / _METADATA, "rb") as f:
            md = pickle.load(f)  # written by this save's DCP save a moment ago
        for index, info in base_md.storage_data.items():
            if index.fqn in plan.reused:
                md.storage_data[index] = dataclasses.replace(
                    info, relative_path=plan.names[str(info.relative_path)]
                )
        for fqn in plan.reused:
            md.state_dict_metadata[fqn] = base_md.state_dict_metadata[fqn]
            if base_md.planner_data is not None and fqn in base_md.planner_data:
                if md.planner_data is None:
                    md.planner_data = {}
                md.planner_data[fqn] = base_md.planner_data[fqn]
        part = tmp / f"{_METADATA}.tmp"
        with open(part, "wb") as f:
            pickle.dump(md, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, tmp / _METADATA)


def _link(src: Path, dst: Path) -> None:
    """``dst`` a hard link of ``src``; a copy where the file system has none."""
    try:
        os.link(src, dst)
    except FileExistsError:
        raise
    except OSError as exc:
        if not src.exists():
            raise
        _log.warning("incremental: %s could not be linked (%s): copied instead", src, exc)
        shutil.copyfile(src, dst)


def skipping_planner(skip: Collection[str]) -> Any:
    """A DCP save planner that writes every item but the tensor chunks in ``skip``
    (their manifest keys): what an incremental save references instead."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

    keys = frozenset(skip)

    class _Skipping(DefaultSavePlanner):
        def create_local_plan(self) -> SavePlan:
            plan = super().create_local_plan()
            items = [
                i
                for i in plan.items
                if i.type is WriteItemType.BYTE_IO or chunk_key(i.index.fqn, i.index.offset or ()) not in keys
            ]
            self.plan = dataclasses.replace(plan, items=items)
            return self.plan

    return _Skipping()
