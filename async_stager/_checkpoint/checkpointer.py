"""Checkpointer: stage, write, commit, retain, verify and restore, as one awaitable.

``save`` takes its snapshot at the call (a lease on the Stager's buffers) and returns
once staged; a background task checksums the staged copy and writes it (DCP or
``torch.save``) into a temporary folder of its own, then commits it in call order (see
``_commit``), applies retention and tells the callbacks and iterators (``_ckptwrite``).
``restore`` verifies the newest commit and loads every saved value into the state in
place, falling back to older commits that verify.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import time
import traceback
import warnings
import weakref
from collections.abc import Callable, Coroutine
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import anyio.lowlevel
import torch
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from async_stager._checkpoint import commit as _commit, integrity as _integrity
from async_stager._checkpoint.options import CheckpointerOptions, Format, Policy, SaveStats
from async_stager._checkpoint.progress import SaveProgress, SaveRequest, progress_of
from async_stager._checkpoint.ranks import Ranks
from async_stager._checkpoint.statefuls import (
    TORCH_FILE,
    apply_loaded,
    check_matches,
    check_torch_restorable,
    load_dcp,
    resolve,
)
from async_stager._checkpoint.write import SaveItem, Writer
from async_stager._core.aio.stager import Stager
from async_stager.errors import (
    CheckpointError,
    ClosedError,
    IntegrityError,
    InvalidOptionError,
    InvalidOptionTypeError,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["Checkpointer", "CheckpointerOptions", "SaveStats"]

_log = logging.getLogger("async_stager.checkpoint")
#: Seconds between the progress records of a save still writing (at most one record
#: per save per interval: a long save is visible in the logs, a short one is quiet).
PROGRESS_SECONDS = 10.0


_exit_hook: list[int] = []


def _exit_fast_if_abandoned(code: int) -> None:
    """At interpreter exit, if an abandoned write's thread is still inside torch (a
    daemon thread), leave with ``os._exit(code)`` after flushing stdio: finalizing the
    interpreter under it aborts the process ("terminate called without an active
    exception", status 134), so the exit status a scheduler reads would be lost."""
    if _exit_hook:
        _exit_hook[0] = code
        return
    _exit_hook.append(code)

    def hook() -> None:
        import sys
        import threading

        busy = [
            t
            for t in threading.enumerate()
            if t.daemon and t.is_alive() and t.name.startswith("async-stager-")
        ]
        if busy:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            os._exit(_exit_hook[0])

    atexit.register(hook)


class _GivenUp(Exception):
    """A save whose caller was cancelled before ``save`` returned: not committed."""


def _clear_frames(exc: BaseException) -> None:
    """Clear the locals of every frame an error's tracebacks reach: they hold the staged
    copy (``torch.save``'s and DCP's locals), and a handler or caller keeping the error
    must not keep the buffer set held. Walks causes, contexts, exception groups and
    DCP's ``CheckpointException.failures`` (per rank: an error or an (error, stack)
    pair), each error once."""
    todo: list[Any] = [exc]
    seen: set[int] = set()
    while todo:
        e = todo.pop()
        if isinstance(e, tuple):
            todo.extend(e)
            continue
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)
        todo.extend((e.__cause__, e.__context__))
        todo.extend(getattr(e, "exceptions", ()) or ())
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo.extend(failures.values())


async def _returns(value: bool) -> bool:
    # A skipped save still yields once: a loop whose only await is save() must give
    # the background write its turns.
    await anyio.lowlevel.checkpoint()
    return value


class Checkpointer:
    """Saves, commits, retains and restores checkpoints in ``directory``, awaitably.

    ``async with Checkpointer(directory, keep=3) as ckpt:`` then ``await
    ckpt.save(state, step=n)`` at a step boundary. ``state`` is a dict: tensors,
    nested containers and plain values, and Stateful objects (anything with
    ``state_dict``/``load_state_dict``: a module, an optimizer, a ``get_state_dict``
    wrapper), whose ``state_dict()`` is called at the save, as DCP does.

    Order is commit order: saves commit in the order they were called; ``steps()``,
    ``latest`` and retention follow commit order, not step numbers (a lower step saved
    after a higher one is the newest checkpoint; saving a step again replaces it).

    Options: ``keep`` newest commits are kept (older ones are deleted after a newer
    commit; the newest is never deleted); ``format`` ``"dcp"`` (a folder per step,
    loadable by plain ``torch.distributed.checkpoint.load``) or ``"torch"`` (one
    ``torch.save`` file, one process only; values that ``torch.load(weights_only=True)``
    cannot rebuild are refused at ``save``); ``max_in_flight`` background writes at
    most; ``policy`` when a save comes while that many are in flight: ``"wait"`` (save
    stages, then waits for a write slot), ``"skip"`` (save returns False at once,
    nothing staged), ``"coalesce"`` (save stages and queues the copy; once staged it
    replaces a queued older one, which is dropped; the newest is written next). On
    several ranks only ``"wait"`` is allowed. ``checksum``: every stored byte is covered
    by ``checksums.json`` (tensors hashed while staging, see ``_integrity``; other
    stored values and files hashed as written, see ``_stored``); ``checksum_threads``
    threads hash what staging could not. ``stager``: a Stager to use (else one of its
    own, with enough buffer sets for ``max_in_flight`` and ``policy``, closed on exit).
    ``process_group``: a gloo group for the checkpoint's collectives (default: the
    default group if gloo, else a new gloo group; constructing it is a collective).
    ``on_saved``: called on the event loop with each commit's SaveStats; an exception
    it raises is logged (``async_stager.checkpoint``), never raised into the caller.

    ``host_budget_bytes=N`` (DCP format, policy ``"wait"`` or ``"skip"``): each save
    stages and writes in a pipeline holding at most ``N`` bytes of host memory for its
    tensors (``async_stager.dcp.save(..., host_budget_bytes=N)``) instead of a full
    staged copy; ``save`` then returns once the last piece is copied (the sources may
    change after that). At most ``max_in_flight`` such writes at once.

    A folder this process cannot write opens for restore only (``save`` raises
    CheckpointError). Other Checkpointers (other processes) may use the same folder:
    none deletes another live one's temporary folders, and commits are serialized by a
    lock file.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep: int = 3,
        format: Format = "dcp",
        max_in_flight: int = 1,
        policy: Policy = "wait",
        checksums: bool = True,
        checksum_threads: int | None = None,
        host_budget_bytes: int | None = None,
        stager: Stager | None = None,
        process_group: ProcessGroup | None = None,
        on_saved: Callable[[SaveStats], None] | None = None,
        checksum: bool | None = None,
    ) -> None:
        import torch.distributed.checkpoint  # noqa: F401 - imported here, not first in two threads at once

        if checksum is not None:
            # One spelling per feature (``Stager.stage(checksums=...)``); the old one
            # still works, with a warning.
            warnings.warn(
                "Checkpointer(checksum=...) is now Checkpointer(checksums=...)",
                DeprecationWarning,
                stacklevel=2,
            )
            checksums = checksum

        threads = checksum_threads if checksum_threads is not None else max(1, (os.cpu_count() or 2) - 1)
        self.options = CheckpointerOptions(
            Path(directory), keep, format, max_in_flight, policy, checksums, threads, host_budget_bytes
        )
        self._ranks = Ranks.resolve(process_group)
        if self._ranks.distributed and policy != "wait":
            raise InvalidOptionError(f"policy must be 'wait' on several ranks, got {policy!r}")
        if self._ranks.distributed and format != "dcp":
            raise InvalidOptionError("format 'torch' is for one process; use 'dcp' on several ranks")
        # Buffer sets a save needs: one per write in flight, one for the save staging
        # next, and with "coalesce" one for the queued save it may replace.
        self._sets = max_in_flight + (2 if policy == "coalesce" else 1)
        if stager is not None and host_budget_bytes is None and stager.options.max_buffer_sets < self._sets:
            raise InvalidOptionError(
                f"the stager has max_buffer_sets={stager.options.max_buffer_sets}; a Checkpointer with "
                f"max_in_flight={max_in_flight} and policy {policy!r} needs {self._sets} "
                f"(Stager(max_buffer_sets={self._sets}))"
            )
        self._stager = stager
        self._own_stager = stager is None
        self._on_saved = on_saved
        self._tg: anyio.abc.TaskGroup | None = None
        self._writer: Writer | None = None
        self._session: _commit.Session | None = None
        self._read_only = False
        self._seq = 0
        self._items: list[SaveItem] = []
        self._request: SaveRequest | None = None
        self._writing = 0
        self._changed: anyio.Event | None = None
        #: Failed writes not yet raised, (call order, error): raised oldest call first.
        self._failures: list[tuple[int, BaseException]] = []
        self._streams: list[MemoryObjectSendStream[SaveStats]] = []
        self._write_lock: anyio.Lock | None = None
        self._leave_at: float | None = None
        self._exit_code = 1
        self._closing = False
        self._abandoned = False
        self.dropped: list[int] = []
        """Steps not written: skipped (``"skip"``) or superseded (``"coalesce"``)."""
        self.last: SaveStats | None = None
        """The newest commit's stats in this session."""

    # -- lifecycle --------------------------------------------------------------------

    async def __aenter__(self) -> Checkpointer:
        """Open the folder: take a writer lock and remove what dead writers left (or, if
        it cannot be written, open it for restore only), then the ranks meet."""
        if self._tg is not None:
            raise CheckpointError("this Checkpointer is already open")
        self._closing = False
        self._leave_at = None  # a deadline missed in an earlier session does not carry over
        self._abandoned = False
        root, ranks = self.options.directory, self._ranks
        token = ""
        if ranks.coordinator:
            try:
                self._session = await anyio.to_thread.run_sync(_commit.Session.open, root)
            except CheckpointError as exc:
                if not ranks.distributed:
                    raise
                token = "!" + str(exc)  # every rank raises it, none waits for the others
            else:
                token = self._session.token if self._session is not None else ""
        token = await anyio.to_thread.run_sync(ranks.broadcast, token)
        if token.startswith("!"):
            raise CheckpointError(token[1:])
        self._read_only = not token
        self._writer = Writer(self.options, ranks, token)
        self._changed = anyio.Event()
        self._write_lock = anyio.Lock()
        if self._stager is None:
            self._stager = Stager(max_buffer_sets=self._sets)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        """Wait for the writes in flight (shielded: a checkpoint being written is
        committed, not abandoned; but not past a deadline ``Shutdown.final_checkpoint``
        missed), then close; raises a write's failure not yet raised."""
        if self._tg is None:
            return None
        tg = self._tg
        self._closing = True  # no new saves; the queued ones still start
        request, self._request = self._request, None
        if request is not None:
            request._finish(None)  # never taken: no save answers it
        try:
            with anyio.CancelScope(shield=True) as scope:
                if self._leave_at is not None:
                    scope.deadline = self._leave_at
                await self._drain()
            if scope.cancelled_caught:
                self._abandon()
        finally:
            for s in self._streams:
                s.close()
            await tg.__aexit__(None, None, None)  # nothing left in flight: returns at once
            self._tg = None
            with anyio.CancelScope(shield=True):
                # An abandoned write's thread may still read the staged buffers: they
                # stay mapped until the process exits.
                if self._own_stager and self._stager is not None and not self._abandoned:
                    await self._stager.aclose()
                    self._stager = None
                if self._session is not None:
                    session = self._session
                    if not self._abandoned:
                        await anyio.to_thread.run_sync(
                            _commit.remove_own_leftovers, session.root, session.token
                        )
                    await anyio.to_thread.run_sync(session.close)
                    self._session = None
        if exc is None and len(self._failures) > 1:
            # Nothing comes after a close to raise the others: one error for all of
            # them (each is also logged when it happened), the oldest as its cause.
            failures = [f for _, f in self._failures]
            self._failures = []
            steps = [getattr(f, "step", None) for f in failures]
            err = CheckpointError(
                f"{len(failures)} checkpoint writes failed before the close (steps {steps}): "
                + "; ".join(str(f).splitlines()[0] for f in failures)
            )
            err.failures = failures  # type: ignore[attr-defined]
            raise err from failures[0]
        if exc is None:
            self._raise_failure()
        return None

    def _abandon(self) -> None:
        """The exit deadline passed: stop waiting for the saves in flight. Their
        threads go on until the process exits; their folders are left for the next
        open to remove (their writer lock is released when this Checkpointer closes)."""
        self._abandoned = True
        if self._items:
            _exit_fast_if_abandoned(self._exit_code)
        for item in list(self._items):
            if item.phase == "writing":
                item.scope.cancel()
            else:
                item.stage_scope.cancel()
                self._end(item)
        _log.warning("left the Checkpointer with saves unfinished (a shutdown deadline passed)")

    @property
    def stager(self) -> Stager:
        if self._stager is None:
            raise ClosedError("the Checkpointer is not open: use it as `async with Checkpointer(...)`")
        return self._stager

    def _check_open(self) -> anyio.abc.TaskGroup:
        if self._tg is None or self._closing:
            raise ClosedError("the Checkpointer is not open: use it as `async with Checkpointer(...)`")
        return self._tg

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = anyio.Event()

    async def _changes(self) -> None:
        assert self._changed is not None
        await self._changed.wait()

    def _raise_failure(self) -> None:
        if self._failures:
            raise self._failures.pop(0)[1]

    def _leave_by(self, deadline: float, exit_code: int) -> None:
        """Make leaving the block stop waiting for writes at ``deadline`` (anyio clock):
        ``Shutdown.final_checkpoint`` after it missed its deadline. ``exit_code``: the
        status the process exits with if an abandoned write is still running then."""
        self._leave_at = deadline
        self._exit_code = exit_code

    # -- saving -----------------------------------------------------------------------

    def save(self, state: dict[str, Any], *, step: int) -> Coroutine[Any, Any, bool]:
        """Save ``state`` as checkpoint ``step``: await the returned coroutine, which
        returns once the state is staged (the sources may change after that, or after
        ``await fence()``); the write runs in the background. Returns False if the
        ``"skip"`` policy skipped it.

        The snapshot point is this call (``state_dict()`` of each Stateful is called
        now), so ``create_task(ckpt.save(...)); await ckpt.fence()`` saves the values as
        of the call. With ``"wait"``, when a staged save already waits for a write slot,
        the stage waits for a buffer set: ``fence()`` covers it either way.

        Raises at the call: InvalidOptionTypeError/InvalidOptionError for a ``step``
        that is not an int >= 0, the failure of an earlier background write (once),
        CheckpointError for a read-only folder or a value the format cannot restore,
        ClosedError if not open.

        Cancellation: before it returns, nothing is saved for this call (its stage is
        abandoned, a budgeted save's pipeline cancelled); once it returned, the write
        goes on and commits."""
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int):
            raise InvalidOptionTypeError(
                f"save(step=...) must be an int >= 0, got {step!r} ({type(step).__name__})"
            )
        if step < 0:
            raise InvalidOptionError(f"save(step=...) must be an int >= 0, got {step}")
        if self._read_only:
            raise CheckpointError(
                f"{self.options.directory} is not writable: this Checkpointer is open for restore only",
                step=step,
            )
        self._raise_failure()
        opts = self.options
        t0 = time.monotonic()
        if opts.policy == "skip" and len(self._items) >= opts.max_in_flight:
            self.dropped.append(step)
            return _returns(False)
        sd = resolve(state)
        if opts.format == "torch":
            check_torch_restorable(sd)
        item = SaveItem(self._seq, step, anyio.Event(), anyio.Event(), sd=sd, called=t0)
        self._seq += 1
        self._items.append(item)
        self._advance()
        coro = self._await_save(item)
        # A coroutine never awaited must not hold a buffer set or a place in the
        # commit order: it is abandoned when it dies, unless its write has started.
        weakref.finalize(coro, self._forget, weakref.ref(item))
        return coro

    def _forget(self, ref: weakref.ref[SaveItem]) -> None:
        item = ref()
        if item is not None and not item.awaited and item.phase in ("deferred", "staging", "queued"):
            self._cancel(item)

    def _holders(self) -> int:
        """Buffer sets held or about to be: saves staging, and staged copies not yet
        released (queued, or being written)."""
        return sum(1 for i in self._items if i.phase == "staging" or i.lease is not None)

    def _advance(self) -> None:
        """Move the saves forward, oldest first: submit stages while buffer sets are
        free (the snapshot point of a deferred save), then start writes while slots are
        free, strictly in call order (a save never starts writing before an older one,
        so a commit never waits for a save that waits for its slot). Runs in background
        tasks and at each call: a save progresses whether or not its caller awaits."""
        tg = self._tg
        if tg is None or self._abandoned:
            return
        opts = self.options
        budgeted = opts.host_budget_bytes is not None
        if not budgeted:
            free = self._sets - self._holders()
            for item in self._items:
                if free <= 0:
                    break
                if item.phase == "deferred" and item.sd is not None:
                    item.stage = self.stager.lease(item.sd, checksums=opts.checksums)
                    item.sd = None
                    item.phase = "staging"
                    item.queued = time.monotonic() - item.called
                    tg.start_soon(self._stage_task, item)
                    free -= 1
        for item in self._items:
            if self._writing >= opts.max_in_flight:
                break
            if item.phase == "queued":
                self._start_write(tg, item)
            elif budgeted and item.phase == "deferred":
                self._start_budgeted(tg, item)
            elif item.phase != "writing":
                break
        self._notify()

    def _start_write(self, tg: anyio.abc.TaskGroup, item: SaveItem) -> None:
        item.phase = "writing"
        item.wrote = True
        self._writing += 1
        tg.start_soon(self._write_task, item)
        tg.start_soon(self._report, item)

    async def _report(self, item: SaveItem) -> None:
        """Log a long save's progress every ``PROGRESS_SECONDS`` until it ends, then its
        outcome once if it was long (INFO on ``async_stager.checkpoint``)."""
        long = False
        while True:
            with anyio.move_on_after(PROGRESS_SECONDS):
                await item.done.wait()
            if item.done.is_set():
                break
            long = True
            staged = f", staged in {item.staged:.1f} s" if item.staged else ""
            _log.info(
                "checkpoint step %d: writing for %.1f s since save()%s",
                item.step,
                time.monotonic() - item.called,
                staged,
            )
        if long:
            outcome = "committed" if item.committed else "not committed"
            _log.info(
                "checkpoint step %d: %s after %.1f s", item.step, outcome, time.monotonic() - item.called
            )

    def _end(self, item: SaveItem, *, dropped: bool = False) -> None:
        """An item leaves: committed, failed, dropped or abandoned (idempotent)."""
        if item.phase == "done":
            return
        if item.phase == "writing":
            self._writing -= 1
        item.phase = "done"
        item.release()
        item.read.set()
        item.done.set()
        if item in self._items:
            self._items.remove(item)
        if dropped:
            item.superseded = True
            self.dropped.append(item.step)
        if item.request is not None:
            item.request._finish(item.stats if item.committed else None, item.failure)
        self._advance()
        self._notify()

    def _cancel(self, item: SaveItem) -> None:
        """The caller gave the save up before it returned: nothing is saved for it."""
        item.cancelled = True
        if item.phase == "staging":
            item.stage_scope.cancel()  # the stage task ends it
        elif item.phase in ("deferred", "queued"):
            self._end(item)
        elif item.phase == "writing" and item.lease is None and not item.read.is_set():
            item.scope.cancel()  # a budgeted save before its last piece: nothing committed
        # A staged save already handed its write slot: the write task sees
        # ``cancelled`` before it writes, and again before it commits.

    async def _stage_task(self, item: SaveItem) -> None:
        """Finish a submitted stage (in the background: the caller may await later)."""
        stage, item.stage = item.stage, None
        assert stage is not None
        t1 = time.monotonic()
        lease = None
        try:
            with item.stage_scope:  # cancelled when the caller cancels its save
                lease = await stage
        except Exception as exc:  # noqa: BLE001 - the stage failed: raised to the save's caller
            item.error = exc
        del stage
        if lease is not None and (item.cancelled or item.phase == "done"):
            lease.release()
            lease = None
        if lease is None:
            self._end(item)
            return
        item.lease = lease
        item.staged = time.monotonic() - t1
        item.phase = "queued"
        item.read.set()
        self._advance()
        self._coalesce()
        self._notify()

    def _coalesce(self) -> None:
        """``"coalesce"``: of the queued saves, keep the newest whose ``save()``
        returned and every newer one (still cancellable); drop the older ones. Keyed by
        call order, not by when a stage finished: concurrent stages finish in any
        order, and an older one finishing last must not stay queued beside a newer."""
        if self.options.policy != "coalesce":
            return
        kept = [i.seq for i in self._items if i.phase == "queued" and i.returned]
        if not kept:
            return
        newest = max(kept)
        for older in [i for i in self._items if i.phase == "queued" and i.seq < newest]:
            self._end(older, dropped=True)

    def _start_budgeted(self, tg: anyio.abc.TaskGroup, item: SaveItem) -> None:
        """Build a budgeted save's pipeline (its snapshot point) and start its write;
        a task of its own waits until the last piece is copied (``item.read``)."""
        from async_stager._dcp.budget_save import budgeted_save

        assert self._writer is not None
        ranks = self._ranks
        item.queued = time.monotonic() - item.called
        try:
            item.pipeline = budgeted_save(
                item.sd or {},
                stager=self.stager,
                budget=self.options.host_budget_bytes or 0,
                checkpoint_id=str(self._writer.tmp(item)),
                storage_writer=None,
                planner=None,
                process_group=ranks.group,
                no_dist=not ranks.distributed,
                on_stats=item.budget.append,
                digests=item.digests if self.options.checksums else None,
            )
        except Exception as exc:  # noqa: BLE001 - refused at its start: raised to the save's caller
            item.error = exc
            self._end(item)
            return
        self._start_write(tg, item)
        tg.start_soon(self._budget_fence_task, item)

    async def _budget_fence_task(self, item: SaveItem) -> None:
        t1 = time.monotonic()
        try:
            await self.stager.fence()  # covers the pipeline's last piece (its fence hook)
        finally:
            item.staged = time.monotonic() - t1
            item.read.set()
            self._notify()

    async def _await_save(self, item: SaveItem) -> bool:
        """The caller's side of a save: wait until it is staged (``"coalesce"``: queued
        is enough; ``"wait"``: until its write started; budgeted: until its last piece
        is copied). Cancellation: before that, the save is given up."""
        item.awaited = True
        opts = self.options
        try:
            while True:
                if item.error is not None:
                    raise item.error
                if opts.host_budget_bytes is not None:
                    if item.read.is_set() and item.phase != "deferred":
                        break
                elif item.phase == "writing" or (item.phase == "queued" and opts.policy == "coalesce"):
                    break
                if item.phase == "done":
                    if item.committed or item.wrote or item.superseded:
                        break
                    raise ClosedError("the Checkpointer closed before this save was staged")
                await self._changes()
        except BaseException:
            if item.error is None:
                self._cancel(item)
            raise
        # No await from the loop's exit to here: a cancellation cannot come between
        # "staged" and "returned", so a queued save replaces older ones only once its
        # caller can no longer give it up.
        item.returned = True
        self._coalesce()
        return True

    def fence(self) -> Coroutine[Any, Any, None]:
        """Wait until every save called so far has read its sources: after this, they
        may change. The ordering points are read at this call (``Stager.fence``).
        Cancellation: only the wait."""
        stager_fence = self.stager.fence()
        pending = [i.read for i in self._items if not i.read.is_set()]

        async def fenced() -> None:
            # Always one turn of the loop, even with nothing to wait for: a training
            # loop that awaits only fence() and save() gives the background writes
            # their turns here (their completion and commit steps run as loop tasks),
            # so a write goes on during the steps, not only inside the next save().
            await anyio.lowlevel.cancel_shielded_checkpoint()
            await stager_fence
            for read in pending:
                await read.wait()

        return fenced()

    async def wait(self) -> None:
        """Wait until every save so far is committed (or failed); raises the first
        failure not yet raised. Cancellation: only the wait; the writes go on."""
        self._check_open()
        await self._drain()
        session = self._session
        if session is not None and not self._abandoned:
            live = frozenset(i.seq for i in self._items)
            await anyio.to_thread.run_sync(_commit.remove_own_leftovers, session.root, session.token, live)
        self._raise_failure()

    async def _drain(self) -> None:
        for item in list(self._items):
            await item.done.wait()

    # -- what a service sees and asks for ------------------------------------------

    def in_flight(self) -> list[SaveProgress]:
        """The saves not yet ended (committed, failed or dropped), oldest call first:
        step, phase, seconds since the call. A snapshot; cheap (no I/O)."""
        now = time.monotonic()
        return [progress_of(i, now) for i in self._items]

    def request_save(self) -> SaveRequest:
        """Ask for a save from any task of this event loop (a request handler, a timer):
        the training loop takes it at its next ``save_if_requested`` call, its step
        boundary. Requests not yet taken are one request. ``await request.wait()`` for
        its commit. Raises ClosedError if not open."""
        self._check_open()
        if self._request is None:
            self._request = SaveRequest()
        return self._request

    @property
    def save_requested(self) -> bool:
        """A request waits for the training loop's next ``save_if_requested``."""
        return self._request is not None

    async def save_if_requested(self, state: dict[str, Any], *, step: int) -> bool:
        """At a step boundary: ``save(state, step=step)`` if a save was requested (the
        request then answers with this save), else nothing (no yield to the loop).
        Returns whether a save was accepted (False: none requested, or ``"skip"``
        skipped it, which answers the request with None). Raises as ``save``.
        Cancellation: as ``save``; the request is then answered with None."""
        request, self._request = self._request, None
        if request is None:
            return False
        request.step = step
        seq = self._seq
        try:
            coro = self.save(state, step=step)
        except BaseException as exc:
            request._finish(None, exc if isinstance(exc, Exception) else None)
            raise
        made = [i for i in self._items if i.seq == seq]  # the save this call made, if any
        if made:
            made[0].request = request
        try:
            accepted = await coro
        except BaseException as exc:
            request._finish(None, exc if isinstance(exc, Exception) else None)
            raise
        if not accepted:
            request._finish(None)
        return accepted

    def saved(self) -> MemoryObjectReceiveStream[SaveStats]:
        """An async iterator of the SaveStats of every commit from now on; it ends when
        the Checkpointer closes. ``async for stats in ckpt.saved(): ...``"""
        send, receive = anyio.create_memory_object_stream[SaveStats](math.inf)
        self._streams.append(send)
        return receive

    async def _write_task(self, item: SaveItem) -> None:

        writer = self._writer
        assert writer is not None and self._write_lock is not None
        stats: SaveStats | None = None
        try:
            outcome = await self._write_outcome(writer, item)
            if isinstance(outcome, BaseException):
                # Caught one frame down, in a frame that has returned: clearing the
                # error's frames then reaches every frame that held the staged copy
                # (an executing frame, this one, cannot be cleared).
                self._record_failure(item, outcome)
            else:
                stats = item.stats = outcome
            del outcome
        finally:
            if not item.committed and not self._abandoned:
                await writer.discard(item)
            self._end(item)
        if stats is not None:
            self._deliver(stats)

    async def _write_outcome(self, writer: Writer, item: SaveItem) -> SaveStats | BaseException | None:
        """Run the write: its stats, its failure (returned, not raised), or None when
        its caller gave it up before ``save()`` returned (nothing committed)."""
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

        try:
            with item.scope:  # shielded: outer cancellation does not stop a write
                return await self._write(writer, item)
        except _GivenUp:
            return None
        except (Exception, CheckpointException) as group:  # noqa: BLE001 - kept for the next save/wait
            return group
        return None  # its scope was cancelled (a budgeted save given up): nothing committed

    async def _write(self, writer: Writer, item: SaveItem) -> SaveStats:
        # Several ranks: one write at a time, so every rank runs the collectives in the
        # same order. One process: writes may overlap; commits run in call order.
        serial = self._write_lock if self._ranks.distributed else None
        assert self._write_lock is not None
        if serial is not None:
            await serial.acquire()
        try:
            t0 = time.monotonic()
            if item.cancelled:
                raise _GivenUp
            await writer.start(item)
            file_entry = None
            checksum_seconds = 0.0
            if item.lease is None:
                manifest, nbytes = await writer.write_budgeted(item)
            else:
                manifest, file_entry, checksum_seconds, nbytes = await writer.write_staged(item, item.lease)
                item.release()  # the staged buffers are free for the next stage
                self._advance()
            t1 = time.monotonic()
            for earlier in [i for i in self._items if i.seq < item.seq]:
                await earlier.done.wait()
            if item.cancelled:
                raise _GivenUp
            await writer.commit(item, manifest, file_entry)
            return writer.stats(item, nbytes, checksum_seconds, t0, t1)
        finally:
            if serial is not None:
                serial.release()
            if item.pipeline is not None:
                # Never started (failed or cancelled before): its fence hook must go
                # now, or a save waiting in fence() would wait for ever.
                from async_stager._dcp.budget_save import abandon

                abandon(item.pipeline)
                item.pipeline = None

    def _record_failure(self, item: SaveItem, group: BaseException) -> None:
        exc: BaseException = group
        while len(getattr(exc, "exceptions", ())) == 1:  # a task group's wrapper
            exc = exc.exceptions[0]  # type: ignore[attr-defined]
        _clear_frames(exc)
        _log.error("checkpoint step %d failed: %s", item.step, exc)
        failure = (
            exc
            if isinstance(exc, CheckpointError)
            else CheckpointError(f"checkpoint step {item.step} failed: {exc}", step=item.step)
        )
        if failure is not exc:
            failure.__cause__ = exc
        item.failure = failure
        self._failures.append((item.seq, failure))  # each raised once, oldest call first
        self._failures.sort(key=lambda f: f[0])

    def _deliver(self, stats: SaveStats) -> None:
        self.last = stats
        for s in self._streams:
            try:
                s.send_nowait(stats)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass
        if self._on_saved is not None:
            try:
                self._on_saved(stats)
            except Exception:  # noqa: BLE001 - a callback's bug must not cancel training
                _log.exception("the on_saved callback raised for step %d (the step is committed)", stats.step)

    # -- restoring --------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps in the directory, oldest commit first (the last is the
        newest: what ``restore()`` tries first)."""
        return _commit.committed_steps(self.options.directory)

    async def restore(
        self, state: dict[str, Any], *, step: int | None = None, fallback: bool = True
    ) -> int | None:
        """Load the newest committed checkpoint that verifies into ``state`` in place
        and return its step; None if there is none. Every saved value is restored:
        tensors copied into, Statefuls given ``load_state_dict`` with their whole saved
        state (a fresh optimizer gets its saved ``state``), plain values replaced, saved
        keys that ``state`` lacks added. ``step``: that one only.

        A checkpoint that fails verification or cannot be read raises IntegrityError,
        or with ``fallback`` (default) is logged and the next older commit is tried
        (IntegrityError if none verifies). A state that does not match the checkpoint (a
        key it lacks, a tensor of another shape) raises CheckpointError naming the path
        and both shapes, before anything is loaded. Every rank calls it; the ranks
        agree on the step. Needs no write access to the folder.

        Cancellation: deferred until the thread reading the current candidate returns;
        ``state`` may then be partly loaded."""
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
        if not self.options.checksums or self.options.format == "torch":
            return  # torch: verified in _load, the file before it is unpickled
        ranks = self._ranks

        def mine() -> str | None:
            try:
                _integrity.verify_dcp(folder, step, part=(ranks.rank, ranks.world))
            except IntegrityError as exc:
                return f"{exc.tensor or ''}\0{exc}"
            return None

        results = await anyio.to_thread.run_sync(ranks.all_gather, await anyio.to_thread.run_sync(mine))
        bad = next((r for r in results if r is not None), None)
        if bad is not None:
            tensor, message = bad.split("\0", 1)
            raise IntegrityError(message, step=step, tensor=tensor or None)

    def _load(self, state: dict[str, Any], folder: Path, step: int) -> None:
        if self.options.format == "dcp":
            load_dcp(state, folder, step, group=self._ranks.group, distributed=self._ranks.distributed)
            return
        manifest = _integrity.load_manifest(folder, step) if self.options.checksums else None
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
