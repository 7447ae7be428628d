"""The steps every save to the folder shares, in its write's thread: ``Writer``.

A route (``routes``) runs its whole write in a daemon thread of its own
(``Writer.start``), so a save progresses whether or not the event loop gets turns: the
training loop's only awaits may be ``fence()`` and ``save()``. Through the writer it
makes the save's folder and checks that the ranks save the same step (``begin``),
commits on the coordinator and retires old checkpoints (``commit``), and reports its
stats (``stats``); a failed or given-up save's folder is removed (``discard``). Only
the end (its stats or its error) is delivered to the loop, by the thread's Future.

Hazards: the collectives (several ranks) run in the save's thread, one save at a time,
in call order on every rank (a save's thread first waits for every earlier save to
end); a write the Checkpointer abandons at a missed shutdown deadline must not keep
the process alive (daemon threads; ``run_in_thread(abandon_on_cancel=True)``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from async_stager._checkpoint import commit as _commit, integrity as _integrity
from async_stager._checkpoint.disk import failure_reason
from async_stager._checkpoint.formats import CheckpointFormat, Stored
from async_stager._checkpoint.incremental import Increments
from async_stager._checkpoint.manifest import MANIFEST
from async_stager._checkpoint.options import CheckpointerOptions, SaveStats
from async_stager._checkpoint.place import FolderPlace, Place
from async_stager._checkpoint.ranks import Ranks
from async_stager._core.aio.threads import run_in_thread, start_thread
from async_stager._core.checksum.digest import Checksums
from async_stager._dcp.files import disk_full_in, naming_file
from async_stager.errors import CheckpointError, StoreError

if TYPE_CHECKING:
    from async_stager._checkpoint.item import SaveItem
    from async_stager._dcp.budget import BudgetStats

__all__ = ["GivenUp", "Table", "Writer", "hash_staged"]

T = TypeVar("T")

#: The tensors table of a manifest: chunk key -> entry.
Table = dict[str, dict[str, Any]]


class GivenUp(Exception):
    """A save whose caller was cancelled before ``save`` returned: not committed."""


def hash_staged(
    staged: dict[str, Any], threads: int, known: Checksums | None = None
) -> futures.Future[tuple[Table, float, int]]:
    """Hash the staged copy in a thread of its own (``threads`` more for the digests):
    the manifest's tensors table, the seconds it took and the bytes hashed (what the
    stage did not, ``known``). The staged bytes are hashed before the disk sees them,
    so the manifest covers what was staged. The caller keeps ``staged`` (its lease)
    until the future is done."""

    def run() -> tuple[Table, float, int]:
        t0 = time.monotonic()
        table, hashed = _integrity.checksum_state(staged, threads=threads, known=known)
        return table, time.monotonic() - t0, hashed

    return start_thread(run, name="async-stager-checksum")


def _store_failure(exc: Exception, tmp: Path) -> str:
    """One line: a store's error whole (it names the object, and says where credentials
    come from), anything else as ``failure_reason`` says it."""
    if isinstance(exc, StoreError):
        return str(exc)
    return failure_reason(exc, tmp)


class Writer:
    """Writes and commits SaveItems into a Checkpointer directory (one per open
    Checkpointer). ``token``: the writer's session token, the same on every rank."""

    def __init__(
        self,
        options: CheckpointerOptions,
        fmt: CheckpointFormat,
        ranks: Ranks,
        token: str,
        place: Place | None = None,
    ) -> None:
        self.options = options
        self.format = fmt
        self.ranks = ranks
        self.token = token
        self.root = options.directory
        #: Where the committed steps go (``place``): the folder itself, or a store.
        self.place = place if place is not None else FolderPlace(options.directory)
        self._commit_lock = threading.Lock()
        #: ``incremental=True``: the previous commit and each save's references.
        self.increments = Increments(self.root, ranks) if options.incremental else None

    def tmp(self, item: SaveItem) -> Path:
        return _commit.tmp_dir(self.root, item.step, self.token, item.seq)

    def start(
        self, item: SaveItem, body: Callable[[], SaveStats], *, name: str, then: Callable[[], None]
    ) -> Future[SaveStats]:
        """Start a route's write ``body`` in a daemon thread of its own, now (where the
        write is decided: it must not wait for the loop's next turn, which a training
        loop that does not yield would never give). ``then`` is called in that thread
        once it ended (the next queued write may start). Its Future gives the stats or
        the error."""

        def run() -> SaveStats:
            try:
                return body()
            finally:
                item.finished.set()  # later saves' threads may commit now, without the loop
                then()

        return start_thread(run, name=name, daemon=True)

    def begin(self, item: SaveItem) -> None:
        """The coordinator makes the save's folder; the ranks check that they save the
        same step as the same save (a rank with another step would commit metadata
        naming files in another folder: a checkpoint that can never be restored)."""
        if self.ranks.coordinator:
            self.tmp(item).mkdir()
        seen = self.ranks.all_gather((item.step, item.seq))
        if len(set(seen)) > 1:
            steps = ", ".join(f"rank {r}: step {s} (save #{q})" for r, (s, q) in enumerate(seen))
            raise CheckpointError(
                f"the ranks saved different steps ({steps}): every rank must call save() with the same "
                "step in the same order; nothing was written",
                step=item.step,
            )

    def commit(self, item: SaveItem, manifest: Table, entry: dict[str, Any] | None) -> None:
        """Gather the ranks' manifests (and the digests of their own files); the
        coordinator commits; every rank learns the outcome (a CheckpointError on every
        rank if the commit failed). No rank reads another's files: on several nodes
        each has its own local folder (an object store's scratch)."""
        ranks, tmp = self.ranks, self.tmp(item)
        stored: str | None = None
        own: Stored | None = None
        try:
            if ranks.distributed and self.options.checksums and self.format.several_ranks:
                own, stored = self._own_stored(tmp)
            if stored is None:
                # Each rank's own files reach the store before the ranks meet (a folder's
                # are in place already): the commit follows every rank's data.
                self.place.upload_own(tmp, ranks.rank, ranks.world)
        except Exception as exc:  # noqa: BLE001 - told to the coordinator, raised on every rank
            stored = _store_failure(exc, tmp)
            if ranks.distributed:
                stored = f"rank {ranks.rank} could not store its files: {stored}"
        gathered = ranks.gather((manifest, stored, own))
        error: str | None = None
        local: Exception | None = None
        if ranks.coordinator:
            assert gathered is not None
            manifests = [m for m, _, _ in gathered]
            failed = next((e for _, e, _ in gathered if e is not None), None)
            if failed is not None:
                error = failed
            else:
                parts: Stored | None = None
                if own is not None:
                    parts = ({}, {})
                    for _, _, (files, objects) in gathered:
                        parts[0].update(files)
                        parts[1].update(objects)
                try:
                    self._commit(item, manifests, entry, parts)
                except Exception as exc:  # noqa: BLE001 - told to every rank, raised below
                    local = exc
                    error = _store_failure(exc, tmp)
        error = ranks.broadcast(error)
        if not ranks.coordinator:
            self.place.leave(tmp, ranks.rank)  # (a scratch folder of its own: its copy)
        if error is not None:
            # The coordinator chains its own error (a full disk's OSError first).
            raise CheckpointError(
                f"checkpoint step {item.step} was not committed: {error}", step=item.step
            ) from ((disk_full_in(local) or local) if local is not None else None)
        item.committed = True
        if self.increments is not None:
            self.increments.committed(item.step)  # the next save's base

    def _own_stored(self, tmp: Path) -> tuple[Stored | None, str | None]:
        """The digests of this rank's own files for the manifest (every rank; the
        coordinator's layout of the files first, sent to every rank), or why not."""
        ranks = self.ranks
        layout: Any = None
        why: str | None = None
        if ranks.coordinator:
            try:
                layout = self.format.layout(tmp)
            except Exception as exc:  # noqa: BLE001 - every rank learns it, none waits
                why = failure_reason(exc, tmp)
        layout, why = ranks.broadcast((layout, why))
        if why is not None:
            return None, why if ranks.coordinator else "the coordinator could not read the step's metadata"
        if layout is None:
            return None, None
        return self.format.own_stored(tmp, layout, ranks.rank), None

    def _commit(
        self, item: SaveItem, manifests: list[Table], entry: dict[str, Any] | None, parts: Stored | None
    ) -> None:
        tmp = self.tmp(item)
        merged: Table = {}
        for m in manifests:
            merged.update(m)  # a replicated tensor: every rank staged the same values
        increments = self.increments

        def prepare() -> None:
            if increments is not None:
                increments.link(item.seq, tmp)  # before the manifest digests the folder
            if self.options.checksums:
                files, objects = self.format.stored(tmp, entry, parts)
                with naming_file(tmp / MANIFEST):
                    _integrity.write_manifest(tmp, item.step, merged, files=files, objects=objects)

        def committed() -> None:
            if increments is not None:
                increments.release(item.seq)  # its plan (its links are in the step)

        with self._commit_lock:
            self.place.commit(
                item.step, tmp, self.format.name, self.options.keep, prepare, committed, item.readers_hold
            )

    async def discard(self, item: SaveItem) -> None:
        """Remove a save's folder after it failed or was cancelled (coordinator).
        Cancellation: deferred until the folder is removed."""
        if item.committed:
            return
        tmp, rank = self.tmp(item), self.ranks.rank
        if self.ranks.coordinator:
            await run_in_thread(lambda: _commit.remove_tmp(tmp), name="async-stager-discard", daemon=True)
        else:
            await run_in_thread(lambda: self.place.leave(tmp, rank), name="async-stager-discard", daemon=True)

    def stats(
        self,
        item: SaveItem,
        nbytes: int,
        checksum_seconds: float,
        t0: float,
        t1: float,
        *,
        stage_seconds: float,
        budget: BudgetStats | None = None,
        admission: str | None = None,
        node_wait: float = 0.0,
        reused_bytes: int = 0,
    ) -> SaveStats:
        """A commit's stats: ``t0`` its write's start, ``t1`` its files' end (now: the
        commit's end); what only its route knows is passed in."""
        return SaveStats(
            step=item.step,
            path=self.place.step_path(item.step),
            bytes=nbytes,
            queued_seconds=item.queued,
            stage_seconds=stage_seconds,
            write_seconds=t1 - t0,
            checksum_seconds=checksum_seconds,
            commit_seconds=time.monotonic() - t1,
            budget=budget,
            admission=admission,
            node_wait_seconds=node_wait,
            reused_bytes=reused_bytes,
        )
