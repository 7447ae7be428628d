"""One Checkpointer save, from its staged copy to its commit, in a worker thread.

``Writer.write_and_commit`` is the whole background part of a staged save as one
blocking function: make the save's folder, write the staged copy through its format
while the staged bytes are hashed beside it, hand the staged copy back, wait for every
earlier save to end (commits happen in call order), commit on the coordinator and
retire old checkpoints. It runs in one daemon thread per save, so a save progresses
whether or not the event loop gets turns: the training loop's only awaits may be
``fence()`` and ``save()``. Only the end (its stats or its error) and the moment the
staged copy is free are delivered to the loop.

A budgeted save (``host_budget_bytes``) is a pipeline of pieces driven from the loop
(``_dcp/budget``); its folder, keys and commit use the same steps here, awaited.

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

from async_stager._checkpoint import commit as _commit, holds as _holds, integrity as _integrity
from async_stager._checkpoint.disk import failure_reason
from async_stager._checkpoint.formats import CheckpointFormat
from async_stager._checkpoint.item import Phase
from async_stager._checkpoint.manifest import MANIFEST
from async_stager._checkpoint.options import CheckpointerOptions, SaveStats
from async_stager._checkpoint.ranks import Ranks
from async_stager._checkpoint.statefuls import staged_bytes, typed_paths, write_typed_paths
from async_stager._core.aio.threads import run_in_thread, start_thread
from async_stager._core.checksum.digest import Checksums
from async_stager._dcp.files import disk_full_in, naming_file
from async_stager.errors import CheckpointError

if TYPE_CHECKING:
    from async_stager._checkpoint.item import SaveItem
    from async_stager._core.aio.lease import Lease

__all__ = ["GivenUp", "Writer", "hash_staged"]

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


class Writer:
    """Writes and commits SaveItems into a Checkpointer directory (one per open
    Checkpointer). ``token``: the writer's session token, the same on every rank."""

    def __init__(self, options: CheckpointerOptions, fmt: CheckpointFormat, ranks: Ranks, token: str) -> None:
        self.options = options
        self.format = fmt
        self.ranks = ranks
        self.token = token
        self.root = options.directory
        self._commit_lock = threading.Lock()

    def tmp(self, item: SaveItem) -> Path:
        return _commit.tmp_dir(self.root, item.step, self.token, item.seq)

    # -- a staged save, in its thread ------------------------------------------------

    def start(
        self,
        item: SaveItem,
        lease: Lease[dict[str, Any]],
        written: Callable[[], None],
        then: Callable[[], None] = lambda: None,
    ) -> Future[SaveStats]:
        """Start ``write_and_commit`` in a daemon thread of its own, now (where the
        write is decided: it must not wait for the loop's next turn, which a training
        loop that does not yield would never give). ``then`` is called in that thread
        once it ended (the next queued write may start). Its Future gives the stats or
        the error."""
        return start_thread(
            lambda: self._ending(then, self.write_and_commit, item, lease, written),
            name=f"async-stager-{self.format.name}-save",
            daemon=True,
        )

    def start_budgeted(self, item: SaveItem, then: Callable[[], None] = lambda: None) -> Future[SaveStats]:
        """Start a budgeted save's whole write (``write_budgeted``) in a daemon thread
        of its own, now, as ``start`` does for a staged one."""
        return start_thread(
            lambda: self._ending(then, self.write_budgeted, item),
            name="async-stager-budgeted-save",
            daemon=True,
        )

    @staticmethod
    def _ending(
        then: Callable[[], None], fn: Callable[..., SaveStats], item: SaveItem, *args: Any
    ) -> SaveStats:
        try:
            return fn(item, *args)
        finally:
            item.finished.set()  # later saves' threads may commit now, without the loop
            then()

    def write_and_commit(
        self, item: SaveItem, lease: Lease[dict[str, Any]], written: Callable[[], None]
    ) -> SaveStats:
        """The background part of a staged save (blocking). ``written`` is called (from
        this thread) once the staged copy is no longer read; it must only schedule
        work on the loop. Raises GivenUp if the caller gave the save up in time."""
        if self.ranks.distributed:
            # One save at a time on several ranks: the collectives in call order.
            item.wait_earlier()
        t0 = time.monotonic()
        if item.cancelled:
            raise GivenUp
        self.begin(item)
        manifest, entry, checksum_seconds, nbytes = self._write_staged(item, lease)
        written()
        t1 = time.monotonic()
        item.phase_detail = Phase.COMMITTING
        item.wait_earlier()
        # Its caller may still be cancelled inside save() (the loop has not resumed it
        # since this write started): wait until it returned or gave up.
        item.settled.wait()
        if item.cancelled:
            raise GivenUp
        self.commit(item, manifest, entry)
        return self.stats(item, nbytes, checksum_seconds, t0, t1)

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

    def _write_staged(
        self, item: SaveItem, lease: Lease[dict[str, Any]]
    ) -> tuple[Table, dict[str, Any] | None, float, int]:
        """Write a staged copy into the save's folder: the manifest's tensors table, what
        the format's ``stored`` needs, the checksum seconds and the tensor bytes."""
        opts = self.options
        staged = lease.state_dict
        item.phase_detail = Phase.WRITING
        item.bytes = staged_bytes(staged)
        # What the copy threads did not hash (everything, on the CPU: there the stage
        # leaves hashing to this point, off the caller's blocked path) is hashed from
        # the staged copy beside the write; both end before the copy is handed back.
        hashing = hash_staged(staged, opts.checksum_threads, lease.checksums) if opts.checksums else None
        try:
            entry = self.format.write(staged, self.tmp(item), self.ranks)
        finally:
            if hashing is not None:
                futures.wait([hashing])  # it reads the staged buffers, whatever happened
        del staged
        manifest, checksum_seconds, _ = hashing.result() if hashing is not None else ({}, 0.0, 0)
        return manifest, entry, checksum_seconds, item.bytes

    def commit(self, item: SaveItem, manifest: Table, entry: dict[str, Any] | None) -> None:
        """Gather the ranks' manifests; the coordinator commits; every rank learns the
        outcome (a CheckpointError on every rank if the commit failed)."""
        ranks = self.ranks
        manifests = ranks.gather(manifest)
        error: str | None = None
        local: Exception | None = None
        if ranks.coordinator:
            assert manifests is not None
            try:
                self._commit(item, manifests, entry)
            except Exception as exc:  # noqa: BLE001 - told to every rank, raised below
                local = exc
                error = failure_reason(exc, self.tmp(item))
        error = ranks.broadcast(error)
        if error is not None:
            # The coordinator chains its own error (a full disk's OSError first).
            raise CheckpointError(
                f"checkpoint step {item.step} was not committed: {error}", step=item.step
            ) from ((disk_full_in(local) or local) if local is not None else None)
        item.committed = True

    def _commit(self, item: SaveItem, manifests: list[Table], entry: dict[str, Any] | None) -> None:
        tmp = self.tmp(item)
        merged: Table = {}
        for m in manifests:
            merged.update(m)  # a replicated tensor: every rank staged the same values
        # The step's hold first (it waits for a reader of the step it replaces), then
        # the folder's lock: the order ``holds`` prescribes.
        with (
            self._commit_lock,
            _holds.exclusive(self.root, _commit.step_name(item.step), item.readers_hold),
            _commit.folder_lock(self.root),
        ):
            if self.options.checksums:
                files, objects = self.format.stored(tmp, entry)
                with naming_file(tmp / MANIFEST):
                    _integrity.write_manifest(tmp, item.step, merged, files=files, objects=objects)
            with naming_file(tmp / _commit.COMMIT):  # the record, then the fsyncs and the rename
                _commit.commit(self.root, tmp, item.step, layout=self.format.name)
            _commit.retain(self.root, self.options.keep)

    # -- a budgeted save, from the loop ----------------------------------------------

    def write_budgeted(self, item: SaveItem) -> SaveStats:
        """A budgeted save's write, blocking (its own thread): its folder, its job (the
        pipeline stages piece by piece and DCP writes them), then its commit, all
        without the event loop. Raises GivenUp if the caller gave the save up in time
        (its job is then aborted by the loop, or never run)."""
        job = item.job
        assert job is not None
        try:
            if self.ranks.distributed:
                item.wait_earlier()  # one save at a time: the collectives in call order
            t0 = time.monotonic()
            if item.cancelled:
                raise GivenUp
            self.begin(item)
            sd, item.sd = item.sd, None
            if self.ranks.coordinator and sd is not None:
                write_typed_paths(self.tmp(item), typed_paths(sd))
            del sd
            item.phase_detail = Phase.WRITING
            job.run()
            stats = item.budget[0] if item.budget else None
            nbytes = stats.tensor_bytes if stats is not None else 0
            item.bytes = nbytes
            t1 = time.monotonic()
            item.phase_detail = Phase.COMMITTING
            item.wait_earlier()
            item.settled.wait()  # its caller may still give it up (see write_and_commit)
            if item.cancelled:
                raise GivenUp
            self.commit(item, item.digests, None)
            return self.stats(item, nbytes, 0.0, t0, t1)
        finally:
            job.forget()  # never run (given up before): its fence hook goes

    async def discard(self, item: SaveItem) -> None:
        """Remove a save's folder after it failed or was cancelled (coordinator).
        Cancellation: deferred until the folder is removed."""
        if self.ranks.coordinator and not item.committed:
            tmp = self.tmp(item)
            await run_in_thread(lambda: _commit.remove_tmp(tmp), name="async-stager-discard", daemon=True)

    def stats(self, item: SaveItem, nbytes: int, checksum_seconds: float, t0: float, t1: float) -> SaveStats:
        t2 = time.monotonic()
        budget = item.budget[0] if item.budget else None
        return SaveStats(
            step=item.step,
            path=str(_commit.step_dir(self.root, item.step)),
            bytes=nbytes,
            queued_seconds=item.queued,
            stage_seconds=budget.fence_seconds if budget is not None else item.staged,
            write_seconds=t1 - t0,
            checksum_seconds=checksum_seconds,
            commit_seconds=t2 - t1,
            budget=budget,
            admission=item.admission,
            node_wait_seconds=item.node_wait + (budget.node_wait_seconds if budget is not None else 0.0),
        )
