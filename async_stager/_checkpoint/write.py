"""One Checkpointer save, from its staged copy to its commit.

A ``SaveItem`` is one accepted ``save`` call; ``Writer`` writes it into its own
temporary folder, checksums it, waits for every earlier save to end (commits happen in
call order), commits it on the coordinator and retires old checkpoints. Blocking work
runs in daemon threads (``run_daemon``): a write that the Checkpointer abandons at a
shutdown deadline must not keep the process alive.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Coroutine
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import anyio

from async_stager._checkpoint import commit as _commit, integrity as _integrity
from async_stager._checkpoint.options import CheckpointerOptions, SaveStats
from async_stager._checkpoint.ranks import Ranks
from async_stager._checkpoint.statefuls import (
    KEYS,
    TORCH_FILE,
    staged_bytes,
    torch_write,
    typed_paths,
    write_typed_paths,
)
from async_stager._checkpoint.stored import dcp_stored, file_digest
from async_stager._core.aio.waiting import wait_future
from async_stager._core.copy.device import caller_cuda_device
from async_stager.errors import CheckpointError

if TYPE_CHECKING:
    from async_stager._core.aio.lease import Lease
    from async_stager._dcp.budget import BudgetStats

__all__ = ["SaveItem", "Writer", "run_daemon"]

T = TypeVar("T")


def run_daemon(fn: Callable[[], T], name: str) -> Coroutine[Any, Any, T]:
    """Run ``fn`` in a new daemon thread; await its result. Cancellation: only the
    wait; the thread goes on (and dies with the process)."""
    fut: futures.Future[T] = futures.Future()

    def target() -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            fut.set_exception(exc)

    threading.Thread(target=target, name=name, daemon=True).start()
    return wait_future(fut)


@dataclass(eq=False)
class SaveItem:
    """One accepted ``save`` call. ``phase``: ``deferred`` (waits for a buffer set, or
    for a write slot when budgeted), ``staging``, ``queued`` (staged, waits for a write
    slot), ``writing``, ``done``. ``read`` is set once its sources were read (or it
    ended without reading them); ``done`` once it is committed, failed or dropped."""

    seq: int
    step: int
    read: anyio.Event
    done: anyio.Event
    phase: str = "deferred"
    #: The resolved state, until its stage is submitted (or its pipeline built).
    sd: dict[str, Any] | None = None
    #: The submitted stage (``stager.lease`` coroutine), until it is awaited.
    stage: Coroutine[Any, Any, Lease[dict[str, Any]]] | None = None
    lease: Lease[dict[str, Any]] | None = None
    #: A budgeted save: its ``dcp.save`` pipeline, until the write runs it.
    pipeline: Coroutine[Any, Any, Any] | None = None
    digests: dict[str, dict[str, Any]] = field(default_factory=dict)
    budget: list[BudgetStats] = field(default_factory=list)
    queued: float = 0.0
    staged: float = 0.0
    #: The write's own cancel scope (shielded from outer scopes): cancelled only to
    #: drop a budgeted save whose caller was cancelled, or at a missed exit deadline.
    scope: anyio.CancelScope = field(default_factory=lambda: anyio.CancelScope(shield=True))
    #: The stage task's scope: cancelled when the caller cancels the save while staging.
    stage_scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    committed: bool = False
    #: When ``save`` was called (monotonic seconds).
    called: float = 0.0
    #: The caller awaited the save's coroutine / gave it up / its stage failed.
    awaited: bool = False
    cancelled: bool = False
    #: Dropped by ``"coalesce"``: a newer save replaced it before its write.
    superseded: bool = False
    #: Its ``save()`` returned (the caller can no longer give it up): only then does it
    #: replace older queued saves (``"coalesce"``), so a save cancelled before it
    #: returned never drops the one it would have replaced.
    returned: bool = False
    #: The SaveRequest this save answers (``save_if_requested``), and its outcome.
    request: Any = None
    stats: Any = None
    failure: BaseException | None = None
    error: BaseException | None = None
    #: Its write started (a budgeted save's pipeline, or a staged copy's write).
    wrote: bool = False

    def release(self) -> None:
        """Give its staged copy back (idempotent)."""
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.release()
        self.sd = None
        stage, self.stage = self.stage, None
        if stage is not None:
            stage.close()  # never awaited: no warning; the stager abandons its job


def drop_planner_state(planner: Any) -> None:
    """Empty a DCP save planner's references to the state it planned (its flattened
    state dict, mappings and plans), whatever DCP still holds the planner by."""
    for name in ("state_dict", "original_state_dict", "mappings"):
        if isinstance(getattr(planner, name, None), dict):
            setattr(planner, name, {})
    for name in ("plan", "metadata"):
        if hasattr(planner, name):
            setattr(planner, name, None)


class Writer:
    """Writes and commits SaveItems into a Checkpointer directory (one per open
    Checkpointer). ``token``: the writer's session token, the same on every rank."""

    def __init__(self, options: CheckpointerOptions, ranks: Ranks, token: str) -> None:
        self.options = options
        self.ranks = ranks
        self.token = token
        self.root = options.directory
        self._commit_lock = threading.Lock()

    async def _collective(self, fn: Callable[[], T]) -> T:
        """A collective on the Checkpointer's group, in a thread; one process: inline
        (it returns at once, and a thread per no-op would cost the loop turns)."""
        if not self.ranks.distributed:
            return fn()
        return await run_daemon(fn, "async-stager-collective")

    def tmp(self, item: SaveItem) -> Path:
        return _commit.tmp_dir(self.root, item.step, self.token, item.seq)

    async def start(self, item: SaveItem) -> None:
        """The coordinator makes the save's folder; the ranks check that they save the
        same step as the same save (a rank with another step would commit metadata
        naming files in another folder: a checkpoint that can never be restored)."""
        if self.ranks.coordinator:
            await run_daemon(lambda: self.tmp(item).mkdir(), "async-stager-mkdir")
        seen = await run_daemon(
            lambda: self.ranks.all_gather((item.step, item.seq)), "async-stager-collective"
        )
        if len(set(seen)) > 1:
            steps = ", ".join(f"rank {r}: step {s} (save #{q})" for r, (s, q) in enumerate(seen))
            raise CheckpointError(
                f"the ranks saved different steps ({steps}): every rank must call save() with the same "
                "step in the same order; nothing was written",
                step=item.step,
            )

    async def write_staged(
        self, item: SaveItem, lease: Lease[dict[str, Any]]
    ) -> tuple[dict[str, dict[str, Any]], dict[str, Any] | None, float, int]:
        """Write a staged copy into the save's folder: the manifest's tensors table, the
        torch file's digest, the checksum seconds and the tensor bytes."""
        opts, tmp = self.options, self.tmp(item)
        staged = lease.state_dict
        # The copy threads hashed what they copied; what they could not (chunks copied
        # from a device, partial views) is hashed from the staged copy in threads of
        # its own while DCP (or torch.save) writes it; both finish before the lease is
        # released.
        hashing = (
            _integrity.checksum_in_thread(staged, opts.checksum_threads, lease.checksums)
            if opts.checksums
            else None
        )
        file_entry: dict[str, Any] | None = None
        try:
            if opts.format == "dcp":
                if self.ranks.coordinator:
                    paths = await run_daemon(lambda: typed_paths(staged), "async-stager-keys")
                    write_typed_paths(tmp, paths)
                await run_daemon(self._dcp_writer(staged, tmp), "async-stager-dcp-save")
            else:
                file_entry = await run_daemon(
                    lambda: torch_write(staged, tmp / TORCH_FILE), "async-stager-write"
                )
        finally:
            if hashing is not None:
                # The hashing threads read the staged buffers: the lease is kept until
                # they end, whatever happened to the write.
                with anyio.CancelScope(shield=True):
                    await run_daemon(lambda: futures.wait([hashing]), "async-stager-wait")
        manifest, checksum_seconds, _ = hashing.result() if hashing is not None else ({}, 0.0, 0)
        nbytes = await run_daemon(lambda: staged_bytes(staged), "async-stager-bytes")
        return manifest, file_entry, checksum_seconds, nbytes

    def _dcp_writer(self, staged: dict[str, Any], tmp: Path) -> Callable[[], Any]:
        from async_stager._dcp.blocking import _save_blocking

        # _save_blocking picks the host writer (no CUDA stream sync) for the path.
        kwargs: dict[str, Any] = {"checkpoint_id": str(tmp), "cuda_device": caller_cuda_device()}
        if self.ranks.distributed:
            kwargs.update(process_group=self.ranks.group, no_dist=False)
        else:
            kwargs.update(no_dist=True)

        def write() -> Any:
            from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

            planner = DefaultSavePlanner()
            try:
                return _save_blocking(staged, planner=planner, **kwargs)
            finally:
                # Hazard: after a failed save DCP keeps the planner reachable (a closure
                # of its write step outlives the call, out of reach of the collector),
                # and the planner holds its flattened copy of the staged dict: the
                # staged buffers would count as held for ever. Drop what it holds.
                drop_planner_state(planner)

        return write

    async def write_budgeted(self, item: SaveItem) -> tuple[dict[str, dict[str, Any]], int]:
        """Run a budgeted save's pipeline into its folder: the manifest's tensors table
        (filled piece by piece) and the tensor bytes written."""
        pipeline, item.pipeline = item.pipeline, None
        assert pipeline is not None
        if self.ranks.coordinator and item.sd is not None:
            sd = item.sd
            paths = await run_daemon(lambda: typed_paths(sd), "async-stager-keys")
            write_typed_paths(self.tmp(item), paths)
        item.sd = None
        await pipeline
        stats = item.budget[0] if item.budget else None
        return item.digests, stats.tensor_bytes if stats is not None else 0

    async def commit(
        self,
        item: SaveItem,
        manifest: dict[str, dict[str, Any]],
        file_entry: dict[str, Any] | None,
    ) -> None:
        """Gather the ranks' manifests; the coordinator commits; every rank learns the
        outcome (a CheckpointError on every rank if the commit failed)."""
        ranks = self.ranks
        manifests = await self._collective(lambda: ranks.gather(manifest))
        error: str | None = None
        if ranks.coordinator:
            assert manifests is not None
            try:
                await run_daemon(lambda: self._commit(item, manifests, file_entry), "async-stager-commit")
            except Exception as exc:  # noqa: BLE001 - told to every rank, raised below
                error = f"{type(exc).__name__}: {exc}"
        error = await self._collective(lambda: ranks.broadcast(error))
        if error is not None:
            raise CheckpointError(f"checkpoint step {item.step} was not committed: {error}", step=item.step)
        item.committed = True

    def _commit(
        self, item: SaveItem, manifests: list[dict[str, dict[str, Any]]], file_entry: dict[str, Any] | None
    ) -> None:
        tmp = self.tmp(item)
        merged: dict[str, dict[str, Any]] = {}
        for m in manifests:
            merged.update(m)  # a replicated tensor: every rank staged the same values
        with self._commit_lock, _commit.folder_lock(self.root):
            if self.options.checksums:
                if self.options.format == "dcp":
                    files, objects = dcp_stored(tmp)
                    if (tmp / KEYS).exists():
                        files[KEYS] = file_digest(tmp / KEYS)
                else:
                    files, objects = {TORCH_FILE: file_entry or file_digest(tmp / TORCH_FILE)}, {}
                _integrity.write_manifest(tmp, item.step, merged, files=files, objects=objects)
            _commit.commit(self.root, tmp, item.step)
            _commit.retain(self.root, self.options.keep)

    async def discard(self, item: SaveItem) -> None:
        """Remove a save's folder after it failed or was cancelled (coordinator).
        Cancellation: shielded, it runs to its end."""
        if self.ranks.coordinator and not item.committed:
            with anyio.CancelScope(shield=True):
                await run_daemon(lambda: _commit.remove_tmp(self.tmp(item)), "async-stager-discard")

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
        )
