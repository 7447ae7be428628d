"""Checkpointer: stage, write, commit, retain, verify and restore, as one awaitable.

``save`` stages the state (a lease on the Stager's buffers) and returns; a background
task checksums the staged copy and writes it (DCP or ``torch.save``) into a temporary
folder, the coordinator commits it (see ``_commit``), applies retention and tells the
callbacks and iterators. ``restore`` verifies the newest committed checkpoint and loads
it in place, falling back to older ones that verify.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import torch
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from . import _commit, _integrity
from ._ckptdist import Ranks
from ._ckptoptions import CheckpointerOptions, Format, Policy, SaveStats
from ._errors import CheckpointError, ClosedError, IntegrityError, InvalidOptionError
from ._lease import Lease
from ._stager import Stager
from ._statefuls import TORCH_FILE, assign, is_stateful, resolve, staged_bytes, torch_write

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from ._budget import BudgetStats

__all__ = ["Checkpointer", "CheckpointerOptions", "SaveStats"]

_log = logging.getLogger("async_stager.checkpoint")


@dataclass
class _Staged:
    step: int
    #: The staged copy; None for a budgeted save, which stages as it writes.
    lease: Lease[dict[str, Any]] | None
    queued: float
    staged: float
    #: A budgeted save: the ``dcp.save`` pipeline (its snapshot point taken at ``save``),
    #: the manifest entries it fills, and its BudgetStats once done.
    pipeline: Coroutine[Any, Any, Any] | None = None
    digests: dict[str, dict[str, Any]] = field(default_factory=dict)
    budget: list[BudgetStats] = field(default_factory=list)

    def drop(self) -> None:
        """Superseded before its write: its staged copy goes (coalesce)."""
        if self.lease is not None:
            self.lease.release()


class Checkpointer:
    """Saves, commits, retains and restores checkpoints in ``directory``, awaitably.

    ``async with Checkpointer(directory, keep=3) as ckpt:`` then ``await
    ckpt.save(state, step=n)`` at a step boundary. ``state`` is a dict: tensors,
    nested containers and plain values, and Stateful objects (anything with
    ``state_dict``/``load_state_dict``: a module, an optimizer, a ``get_state_dict``
    wrapper), whose ``state_dict()`` is called at the save, as DCP does.

    Options: ``keep`` committed checkpoints are kept (older ones are deleted after a
    newer commit); ``format`` ``"dcp"`` (a folder per step, loadable by plain
    ``torch.distributed.checkpoint.load``) or ``"torch"`` (one ``torch.save`` file,
    one process only); ``max_in_flight`` background writes at most; ``policy`` when a
    save comes while that many are writing: ``"wait"`` (save waits for a slot, then
    stages), ``"skip"`` (save returns False at once, nothing staged), ``"coalesce"``
    (save stages now and queues the copy, replacing a queued older one, which is
    dropped; the newest is written next). On several ranks only ``"wait"`` is allowed
    (a per-rank decision could differ between ranks). ``checksum``: an XXH3-64 digest
    per tensor chunk, computed by the copy threads while staging (see ``_integrity``);
    ``checksum_threads`` threads hash what they could not (small chunks copied from a GPU). ``stager``: a Stager to
    use (else one of its own, closed on exit). ``process_group``: a gloo group for the
    checkpoint's collectives (default: the default group if gloo, else a new gloo
    group; constructing it is a collective). ``on_saved``: called on the event loop
    with each commit's SaveStats.

    ``host_budget_bytes=N`` (DCP format, policy ``"wait"`` or ``"skip"``): each save
    stages and writes in a pipeline holding at most ``N`` bytes of host memory for its
    tensors (``async_stager.dcp.save(..., host_budget_bytes=N)``) instead of a full
    staged copy; ``save`` then returns once the last piece is copied (the sources may
    change after that), so it blocks as long as the budget forces, and the write goes
    on in the background. Checksums are taken from each piece as it lands. At most
    ``max_in_flight`` such writes at once, so ``max_in_flight * N`` bytes.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep: int = 3,
        format: Format = "dcp",
        max_in_flight: int = 1,
        policy: Policy = "wait",
        checksum: bool = True,
        checksum_threads: int | None = None,
        host_budget_bytes: int | None = None,
        stager: Stager | None = None,
        process_group: ProcessGroup | None = None,
        on_saved: Callable[[SaveStats], None] | None = None,
    ) -> None:
        import torch.distributed.checkpoint  # noqa: F401 - imported here, not first in two threads at once

        threads = checksum_threads if checksum_threads is not None else max(1, (os.cpu_count() or 2) - 1)
        self.options = CheckpointerOptions(
            Path(directory), keep, format, max_in_flight, policy, checksum, threads, host_budget_bytes
        )
        self._ranks = Ranks.resolve(process_group)
        if self._ranks.distributed and policy != "wait":
            raise InvalidOptionError(f"policy must be 'wait' on several ranks, got {policy!r}")
        if self._ranks.distributed and format != "dcp":
            raise InvalidOptionError("format 'torch' is for one process; use 'dcp' on several ranks")
        self._stager = stager
        self._own_stager = stager is None
        self._on_saved = on_saved
        self._tg: anyio.abc.TaskGroup | None = None
        self._writing = 0
        self._pending: _Staged | None = None
        self._changed = anyio.Event()
        self._failure: BaseException | None = None
        self._streams: list[MemoryObjectSendStream[SaveStats]] = []
        self._write_lock = anyio.Lock()
        self._commit_lock = threading.Lock()
        self.dropped: list[int] = []
        """Steps not written: skipped (``"skip"``) or superseded (``"coalesce"``)."""
        self.last: SaveStats | None = None
        """The newest commit's stats in this session."""

    # -- lifecycle --------------------------------------------------------------------

    async def __aenter__(self) -> Checkpointer:
        root = self.options.directory
        if self._ranks.coordinator:

            def prepare() -> None:
                root.mkdir(parents=True, exist_ok=True)
                _commit.clean_stale(root)

            await anyio.to_thread.run_sync(prepare)
        await anyio.to_thread.run_sync(self._ranks.barrier)
        if self._stager is None:
            self._stager = Stager()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        """Waits for the writes in flight (shielded: a checkpoint being written is
        committed, not abandoned), then closes; raises a write's failure not yet raised."""
        assert self._tg is not None
        tg, self._tg = self._tg, None
        try:
            with anyio.CancelScope(shield=True):
                await self._drain()
                for s in self._streams:
                    s.close()
        finally:
            await tg.__aexit__(None, None, None)  # no writes left: returns at once
            with anyio.CancelScope(shield=True):
                if self._own_stager and self._stager is not None:
                    await self._stager.aclose()
                    self._stager = None
        if exc is None:
            self._raise_failure()
        return None

    @property
    def stager(self) -> Stager:
        if self._stager is None:
            raise ClosedError("the Checkpointer is not open: use it as `async with Checkpointer(...)`")
        return self._stager

    def _check_open(self) -> anyio.abc.TaskGroup:
        if self._tg is None:
            raise ClosedError("the Checkpointer is not open: use it as `async with Checkpointer(...)`")
        return self._tg

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def _raise_failure(self) -> None:
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    # -- saving -----------------------------------------------------------------------

    async def save(self, state: dict[str, Any], *, step: int) -> bool:
        """Stage ``state`` as checkpoint ``step`` and return once it is staged (the
        sources may change after this returns); the write runs in the background.
        Returns False if the ``"skip"`` policy skipped it. Raises the failure of an
        earlier background write (once), ClosedError if not open.

        Every rank calls it with the same step. Cancellation: while waiting for a slot
        or staging, nothing was saved; once staged, the write goes on."""
        tg = self._check_open()
        self._raise_failure()
        _commit.step_name(step)
        t0 = time.monotonic()
        limit = self.options.max_in_flight
        if self.options.policy == "skip" and self._writing >= limit:
            self.dropped.append(step)
            return False
        if self.options.policy == "wait":
            while self._writing >= limit:
                await self._changed.wait()
        sd = resolve(state)
        if self.options.host_budget_bytes is not None:
            await self._save_budgeted(tg, sd, step, t0)
            return True
        if self.options.policy == "coalesce" and self._writing >= limit and self._pending is not None:
            old, self._pending = self._pending, None
            old.drop()  # its buffer set is free for this stage
            self.dropped.append(old.step)
        t1 = time.monotonic()
        lease = await self.stager.lease(sd, checksums=self.options.checksum)
        del sd
        item = _Staged(step, lease, t1 - t0, time.monotonic() - t1)
        if self._writing >= limit:  # coalesce: queue behind the writes in flight
            if self._pending is not None:
                self._pending.drop()
                self.dropped.append(self._pending.step)
            self._pending = item
        else:
            self._writing += 1
            tg.start_soon(self._write_task, item)
        return True

    async def _save_budgeted(self, tg: anyio.abc.TaskGroup, sd: dict[str, Any], step: int, t0: float) -> None:
        """Start a budgeted save's write now (its snapshot point) and wait until it has
        copied its last piece. Cancellation: only that wait; the write goes on."""
        from ._budget_save import budgeted_save

        ranks = self._ranks
        t1 = time.monotonic()
        item = _Staged(step, None, t1 - t0, 0.0)
        item.pipeline = budgeted_save(
            sd,
            stager=self.stager,
            budget=self.options.host_budget_bytes or 0,
            checkpoint_id=str(_commit.tmp_dir(self.options.directory, step)),
            storage_writer=None,
            planner=None,
            process_group=ranks.group,
            no_dist=not ranks.distributed,
            on_stats=item.budget.append,
            digests=item.digests if self.options.checksum else None,
        )
        self._writing += 1
        tg.start_soon(self._write_task, item)
        await self.stager.fence()
        item.staged = time.monotonic() - t1

    async def fence(self) -> None:
        """Wait until every save so far has read its sources (``Stager.fence``): after
        this the sources may change. Cancellation: only the wait."""
        await self.stager.fence()

    async def wait(self) -> None:
        """Wait until every save so far is committed (or failed); raises the first
        failure not yet raised. Cancellation: only the wait; the writes go on."""
        await self._drain()
        self._raise_failure()

    async def _drain(self) -> None:
        while self._writing or self._pending is not None:
            await self._changed.wait()

    def saved(self) -> MemoryObjectReceiveStream[SaveStats]:
        """An async iterator of the SaveStats of every commit from now on; it ends when
        the Checkpointer closes. ``async for stats in ckpt.saved(): ...``"""
        send, receive = anyio.create_memory_object_stream[SaveStats](math.inf)
        self._streams.append(send)
        return receive

    async def _write_task(self, item: _Staged) -> None:
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

        try:
            while True:
                try:
                    stats = await self._write(item)
                except (Exception, CheckpointException) as group:  # noqa: BLE001 - kept for the next save/wait
                    exc: BaseException = group
                    while len(getattr(exc, "exceptions", ())) == 1:  # a task group's wrapper
                        exc = exc.exceptions[0]  # type: ignore[attr-defined]
                    _log.error("checkpoint step %d failed: %s", item.step, exc)
                    if self._failure is None:
                        self._failure = (
                            exc
                            if isinstance(exc, CheckpointError)
                            else CheckpointError(f"checkpoint step {item.step} failed: {exc}", step=item.step)
                        )
                        if self._failure is not exc:
                            self._failure.__cause__ = exc
                else:
                    self._deliver(stats)
                nxt, self._pending = self._pending, None
                if nxt is None:
                    break
                item = nxt
                self._notify()
        finally:
            self._writing -= 1
            self._notify()

    def _deliver(self, stats: SaveStats) -> None:
        self.last = stats
        for s in self._streams:
            try:
                s.send_nowait(stats)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass
        if self._on_saved is not None:
            self._on_saved(stats)

    async def _fresh_tmp(self, tmp: Path) -> None:
        """An empty temporary folder for this step on the coordinator, then a barrier."""
        if self._ranks.coordinator:

            def fresh() -> None:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()

            await anyio.to_thread.run_sync(fresh)
        await anyio.to_thread.run_sync(self._ranks.barrier)

    async def _write_budgeted(self, item: _Staged) -> tuple[dict[str, dict[str, Any]], float, int]:
        """Run a budgeted save's pipeline into its temporary folder: the manifest
        entries, the seconds and the tensor bytes it wrote."""
        pipeline = item.pipeline
        assert pipeline is not None
        tmp = _commit.tmp_dir(self.options.directory, item.step)
        await self._fresh_tmp(tmp)
        t0 = time.monotonic()
        item.pipeline = None
        await pipeline
        stats = item.budget[0] if item.budget else None
        return item.digests, time.monotonic() - t0, stats.tensor_bytes if stats is not None else 0

    async def _write(self, item: _Staged) -> SaveStats:
        opts, ranks = self.options, self._ranks
        root = opts.directory
        tmp = _commit.tmp_dir(root, item.step)
        # Several ranks: one write at a time, so every rank runs the collectives in the
        # same order. One process: writes may overlap; commits are serialized below.
        serial = self._write_lock if ranks.distributed else contextlib.nullcontext()
        if item.lease is None:
            try:
                async with serial:
                    t0 = time.monotonic()
                    manifest, _, nbytes = await self._write_budgeted(item)
            finally:
                if item.pipeline is not None:
                    # Never started (failed or cancelled before): its fence hook must
                    # go now, or the save waiting in fence() would wait for ever.
                    from ._budget_save import abandon

                    abandon(item.pipeline)
                    item.pipeline = None
            checksum_seconds = 0.0
        else:
            try:
                manifest, checksum_seconds, nbytes, t0 = await self._write_staged(
                    item, item.lease, serial, tmp
                )
            finally:
                # Also when cancelled or failed before the write took the lease over
                # (waiting for the write lock): the buffer set must not stay held.
                item.lease.release()
        return await self._commit_write(item, manifest, checksum_seconds, nbytes, t0)

    async def _write_staged(
        self, item: _Staged, lease: Lease[dict[str, Any]], serial: Any, tmp: Path
    ) -> tuple[dict[str, dict[str, Any]], float, int, float]:
        opts = self.options
        async with serial, lease as staged:
            t0 = time.monotonic()
            await self._fresh_tmp(tmp)
            # The copy threads hashed what they copied; what they could not (chunks
            # copied from a device, partial views) is hashed from the staged copy in
            # threads of its own while DCP (or torch.save) writes it; both finish
            # before the lease is released.
            hashing = (
                _integrity.checksum_in_thread(staged, opts.checksum_threads, lease.checksums)
                if opts.checksum
                else None
            )
            try:
                if opts.format == "dcp":
                    from .dcp import save_staged

                    await save_staged(
                        staged,
                        checkpoint_id=str(tmp),
                        process_group=self._ranks.group,
                        no_dist=not self._ranks.distributed,
                    )
                else:
                    await anyio.to_thread.run_sync(torch_write, staged, tmp / TORCH_FILE)
            finally:
                if hashing is not None:
                    with anyio.CancelScope(shield=True):
                        await anyio.to_thread.run_sync(futures.wait, [hashing])
            manifest, checksum_seconds, _ = hashing.result() if hashing is not None else ({}, 0.0, 0)
            nbytes = await anyio.to_thread.run_sync(staged_bytes, staged)
        # The lease is released: the staged buffers are free for the next stage.
        return manifest, checksum_seconds, nbytes, t0

    async def _commit_write(
        self,
        item: _Staged,
        manifest: dict[str, dict[str, Any]],
        checksum_seconds: float,
        nbytes: int,
        t0: float,
    ) -> SaveStats:
        ranks, root = self._ranks, self.options.directory
        t1 = time.monotonic()
        manifests = await anyio.to_thread.run_sync(ranks.gather, manifest)
        error: str | None = None
        if ranks.coordinator:
            assert manifests is not None
            try:
                await anyio.to_thread.run_sync(self._commit, item.step, manifests)
            except Exception as exc:  # noqa: BLE001 - told to every rank, raised below
                error = f"{type(exc).__name__}: {exc}"
        error = await anyio.to_thread.run_sync(ranks.broadcast, error)
        if error is not None:
            raise CheckpointError(f"checkpoint step {item.step} was not committed: {error}", step=item.step)
        t2 = time.monotonic()
        return SaveStats(
            step=item.step,
            path=str(_commit.step_dir(root, item.step)),
            bytes=nbytes,
            queued_seconds=item.queued,
            stage_seconds=item.budget[0].fence_seconds if item.budget else item.staged,
            write_seconds=t1 - t0,
            checksum_seconds=checksum_seconds,
            commit_seconds=t2 - t1,
            budget=item.budget[0] if item.budget else None,
        )

    def _commit(self, step: int, manifests: list[dict[str, dict[str, Any]]]) -> None:
        with self._commit_lock:
            self._commit_locked(step, manifests)

    def _commit_locked(self, step: int, manifests: list[dict[str, dict[str, Any]]]) -> None:
        root = self.options.directory
        merged: dict[str, dict[str, Any]] = {}
        for m in manifests:
            merged.update(m)  # a replicated tensor: every rank staged the same values
        if self.options.checksum:
            _integrity.write_manifest(_commit.tmp_dir(root, step), step, merged)
        _commit.commit(root, step)
        _commit.retain(root, self.options.keep)

    # -- restoring --------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps in the directory, oldest first."""
        return _commit.committed_steps(self.options.directory)

    async def restore(
        self, state: dict[str, Any], *, step: int | None = None, fallback: bool = True
    ) -> int | None:
        """Load the newest committed checkpoint that verifies into ``state`` in place
        (tensors copied into, Statefuls given ``load_state_dict``, plain values
        replaced) and return its step; None if there is none. ``step``: that one only.
        A checkpoint failing verification raises IntegrityError, or with ``fallback``
        (default) is logged and the next older one is tried (IntegrityError if none
        verifies). Every rank calls it; the ranks agree on the step.

        Verification reads the data once more before the load (with ``checksum=False``
        it is skipped). Cancellation: deferred until the thread reading the current
        candidate returns; ``state`` may then be partly loaded."""
        self._check_open()
        ranks, root = self._ranks, self.options.directory
        listed: list[int] = await anyio.to_thread.run_sync(ranks.broadcast, self.steps())
        candidates = [s for s in reversed(listed) if step is None or s == step]
        if step is not None and not candidates:
            raise CheckpointError(f"no committed checkpoint for step {step} in {root}", step=step)
        first_error: IntegrityError | None = None
        for s in candidates:
            folder = _commit.step_dir(root, s)
            try:
                await self._verify(s, folder)
                # torch format: read and verified before anything in state is touched.
                await anyio.to_thread.run_sync(self._load, state, folder, s)
            except IntegrityError as exc:
                if not fallback:
                    raise
                first_error = first_error or exc
                _log.warning("checkpoint step %d does not verify, trying an older one: %s", s, exc)
                continue
            return s
        if first_error is not None:
            raise first_error
        return None

    async def _verify(self, step: int, folder: Path) -> None:
        if not self.options.checksum or self.options.format == "torch":
            return  # torch: verified on the loaded copy, in _load
        ranks = self._ranks

        def mine() -> str | None:
            try:
                _integrity.verify_dcp(folder, step, part=(ranks.rank, ranks.world))
            except IntegrityError as exc:
                return f"{exc.tensor}\0{exc}"
            return None

        results = await anyio.to_thread.run_sync(ranks.all_gather, await anyio.to_thread.run_sync(mine))
        bad = next((r for r in results if r is not None), None)
        if bad is not None:
            tensor, message = bad.split("\0", 1)
            raise IntegrityError(message, step=step, tensor=tensor or None)

    def _load(self, state: dict[str, Any], folder: Path, step: int) -> None:
        if self.options.format == "torch":
            try:
                loaded = torch.load(folder / TORCH_FILE, map_location="cpu", weights_only=True)
            except Exception as exc:  # a torn or missing file: not trusted
                raise IntegrityError(f"{folder / TORCH_FILE}: unreadable ({exc})", step=step) from exc
            if self.options.checksum:
                _integrity.verify_flat(step, _integrity.read_manifest(folder, step), loaded)
            for k, v in loaded.items():
                if k in state and is_stateful(state[k]):
                    state[k].load_state_dict(v)
                else:
                    state[k] = assign(state[k], v) if k in state else v
            return
        import torch.distributed.checkpoint as dcp

        # DCP loads in place and calls load_state_dict on Stateful values itself.
        if self._ranks.distributed:
            dcp.load(state, checkpoint_id=str(folder), process_group=self._ranks.group)
        else:
            import warnings

            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(state, checkpoint_id=str(folder), no_dist=True)
