"""Checkpointer: stage, write, commit, retain, verify and restore, as one awaitable.

The facade over the checkpoint layer's parts, one job each: ``saves`` (the save
policy: which saves stage, wait, are dropped, start writing, whatever their route),
``routes`` (how a save travels: staged, streamed, admitted by the node budget; each
writes, checksums, commits and retains in a worker thread of its own), ``commit``
(the commit protocol and retention on disk), ``restore`` (verify and load), and
``formats`` (how a folder is written and read: DCP or torch). ``save`` takes its
snapshot at the call (a lease on the Stager's buffers) and returns once staged; the
write goes on in its thread whether or not the event loop gets turns.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import anyio.lowlevel

from async_stager._checkpoint import restore as _restore, session as _session, tiered as _tiered
from async_stager._checkpoint.exiting import close_by, exit_fast_if_abandoned
from async_stager._checkpoint.formats import format_for
from async_stager._checkpoint.node_budget import CreditLedger
from async_stager._checkpoint.options import (
    CheckpointerOptions,
    Format,
    Policy,
    SaveStats,
    buffer_sets_needed,
    check_loop,
    check_stager,
    check_step,
    resolve_directory,
)
from async_stager._checkpoint.progress import (
    SaveProgress,
    SaveRequest,
    finish_request,
    interrupted_line,
    status_line,
    take_request,
)
from async_stager._checkpoint.ranks import Ranks
from async_stager._checkpoint.routes import DiskContext, Schedule
from async_stager._checkpoint.saved import SavedStream, Subscribers
from async_stager._checkpoint.saves import SaveQueue
from async_stager._checkpoint.store_place import make_place
from async_stager._checkpoint.write import Writer
from async_stager._core.aio.stager import Stager
from async_stager._core.aio.threads import run_in_thread
from async_stager._core.checksum.digest import hash_threads
from async_stager.errors import CheckpointError, ClosedError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from async_stager._tier.client import AgentClient
    from async_stager._tier.stats import MemoryStats

__all__ = ["Checkpointer", "CheckpointerOptions", "SaveStats"]

_log = logging.getLogger("async_stager.checkpoint")


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
    several ranks only ``"wait"`` is allowed. ``checksums``: every stored byte is covered
    by ``checksums.json`` (the staged host copy's tensors hashed in the write's thread,
    beside the write, see ``_integrity``; other stored values and files hashed as
    written, see ``_stored``); ``checksum_threads`` threads hash the staged copy. ``stager``: a Stager to use (else one of its
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

    ``node_budget_bytes=N`` (DCP format, policy ``"wait"`` or ``"skip"``): one host-memory
    budget of ``N`` bytes that every rank of this machine shares through a node ledger
    (``node_budget_path``: its directory; ``node_budget_job``: the job's identity, by
    default torchrun's run id or ``MASTER_ADDR:MASTER_PORT``; every rank gives the same
    ``N``). The Checkpointer's own Stager reserves each arena from it (cached buffer sets
    stay counted; closing gives them back). Before each save stages, the node decides:
    a staged copy whose new bytes the ledger grants within a short bounded wait (leaving
    the other ranks room to stream), else the save streams through the budgeted
    pipeline within a share of the node budget (at least the largest tensor, at most
    what fits). ``SaveStats.admission`` and ``node_wait_seconds`` say which and how long
    it waited; the log says so at INFO when it waited or streamed. A state whose largest
    tensor is bigger than ``N`` is refused at ``save()`` (BudgetTooSmallError naming it).
    With one process it is a per-process budget. Not with ``stager=`` (pass the node
    budget to that Stager instead).

    ``incremental=True`` (DCP format, checksums on): a save after this Checkpointer's
    first writes only the tensors whose digests differ from its previous commit and
    references the rest (hard links in the step's folder: every step stays whole).

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
        node_budget_bytes: int | None = None,
        node_budget_path: str | os.PathLike[str] | None = None,
        node_budget_job: str | None = None,
        stager: Stager | None = None,
        process_group: ProcessGroup | None = None,
        on_saved: Callable[[SaveStats], None] | None = None,
        checksum: bool | None = None,
        agent: str | AgentClient | None = None,
        memory_every: int = 1,
        persist_every: int = 1,
        memory_keep: int = 2,
        agent_timeout: float = 5.0,
        incremental: bool = False,
        replicate: bool = False,
        replica_share: float = 0.1,
        replica_rate: float | None = None,
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

        threads = checksum_threads if checksum_threads is not None else hash_threads()
        directory, url = resolve_directory(directory)
        self.options = CheckpointerOptions(
            directory,
            keep,
            format,
            max_in_flight,
            policy,
            checksums,
            threads,
            host_budget_bytes,
            node_budget_bytes,
            os.fspath(node_budget_path) if isinstance(node_budget_path, os.PathLike) else node_budget_path,
            node_budget_job,
            incremental,
            url,
        )
        self._place = make_place(self.options)  # the folder, or the store (and its scratch folder)
        check_stager(self.options, stager)
        self._format = format_for(format)
        self._ranks = Ranks.resolve(process_group)
        sets = buffer_sets_needed(self.options, self._format.several_ranks, self._ranks.distributed, stager)
        self._sets = sets
        # The memory tier (agent=...): its own Stager and the schedule (``tiered``).
        self._tier, every = _tiered.make_tier(
            agent,
            memory_every=memory_every,
            persist_every=persist_every,
            policy=policy,
            ranks=self._ranks,
            agent_timeout=agent_timeout,
            keep=memory_keep,
            namespace=url or str(directory.resolve()),
            replicate=replicate,
            replica_share=replica_share,
            replica_rate=replica_rate,
        )
        self._stager = stager
        self._own_stager = stager is None
        self._ledger: CreditLedger | None = None
        self._on_saved = on_saved
        self._tg: anyio.abc.TaskGroup | None = None
        self._session: _session.Session | None = None
        #: Why this Checkpointer is open for restore only ("" when it can save).
        self._read_only = ""
        #: The coordinator's open made the folder (it did not exist).
        self._created = False
        self._saves = SaveQueue(self.options, sets, self._deliver)  # the folder's
        self._schedule = Schedule.make(self._saves, self._format, self._tier, every)
        self._request: SaveRequest | None = None
        self._streams = Subscribers()  # saved()'s iterators, held weakly
        self._leave_at: float | None = None
        self._exit_code = 1
        self._closing = False
        self._loop_thread = -1
        self.last: SaveStats | None = None
        """The newest commit's stats in this session."""

    @property
    def dropped(self) -> list[int]:
        """Steps not written: skipped (``"skip"``), superseded (``"coalesce"``); with an
        agent, memory-only steps not taken (``"skip"``, the agent away)."""
        return self._schedule.dropped

    @property
    def memory(self) -> MemoryStats | None:
        """The memory tier's counts and newest snapshot (None without ``agent=``)."""
        return None if self._tier is None else self._tier.stats

    # -- lifecycle --------------------------------------------------------------------

    async def __aenter__(self) -> Checkpointer:
        """Open the folder: take a writer lock and remove what dead writers left (or, if
        it cannot be written, open it for restore only), then the ranks meet."""
        if self._tg is not None:
            raise CheckpointError("this Checkpointer is already open")
        self._closing = False
        self._leave_at = None  # a deadline missed in an earlier session does not carry over
        root, ranks = self.options.directory, self._ranks
        opts = self.options
        if opts.node_budget_bytes is not None and self._ledger is None:
            # Opened before the ranks meet, so that every rank's slot is in the ledger
            # by the first save (its admission counts the ranks of the node).
            budget = opts.node_budget_bytes
            self._ledger = await run_in_thread(
                lambda: CreditLedger.open(budget, path=opts.node_budget_path, job=opts.node_budget_job),
                name="async-stager-open",
            )
        try:
            await run_in_thread(self._place.open, name="async-stager-open")
            session, created, token = await _session.meet(root, ranks)
        except BaseException:
            self._place.close()  # (a store's connections and thread)
            if self._ledger is not None:
                self._ledger.close()  # nothing was reserved through it yet
                self._ledger = None
            raise
        if created is not None:  # the coordinator opened the folder
            self._session, self._created = session, created
        self._read_only = token[1:] if token.startswith("?") else ""
        token = "" if self._read_only else token
        if self._stager is None:
            self._stager = Stager(max_buffer_sets=self._sets, node_ledger=self._ledger)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._loop_thread = threading.get_ident()
        writer = Writer(self.options, self._format, ranks, token, self._place)
        self._schedule.disk.open(DiskContext(self.options, ranks, writer, self._stager, self._ledger))
        if self._tier is not None:
            self._tier.open(self._tg)
        self._schedule.open(self._tg)
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
        self._schedule.closing()  # (a memory save never awaited holds nothing)
        request, self._request = self._request, None
        if request is not None:
            finish_request(request, None)  # never taken: no save answers it
        # Left by Ctrl-C (or a cancellation) while saves are in flight: one line says
        # which committed (the traceback that follows does not).
        # (On asyncio, Ctrl-C cancels the main task: the block sees a cancellation.)
        stopped = isinstance(exc, (KeyboardInterrupt, anyio.get_cancelled_exc_class()))
        interrupted = list(self._saves.items) if stopped else []
        try:
            with anyio.CancelScope(shield=True) as scope:
                if self._leave_at is not None:
                    scope.deadline = self._leave_at
                await self._schedule.drain()
            if scope.cancelled_caught:
                self._abandon()
        finally:
            self._streams.finish()
            self._schedule.close()
            # Shielded: a block left by a cancellation (on trio every await in it raises
            # again) must still close; it left the stager, the writer lock and the
            # Checkpointer itself open.
            tg.cancel_scope.shield = True
            await tg.__aexit__(None, None, None)  # nothing left in flight: returns at once
            self._tg = None
            if self._tier is not None:
                with anyio.CancelScope(shield=True):
                    await self._tier.aclose()  # the agent keeps what it holds
            abandoned = self._saves.abandoned
            with anyio.CancelScope(shield=True):
                # An abandoned write's thread may still read the staged buffers: they
                # stay mapped until the process exits.
                if self._own_stager and self._stager is not None and not abandoned:
                    if self._leave_at is None:
                        await self._stager.aclose()
                    elif not await close_by(self._stager.close, self._leave_at, name="async-stager-close"):
                        # Past a missed deadline, a stage still running (a value slow to
                        # copy, its save given up) is not waited for either.
                        abandoned = True
                        exit_fast_if_abandoned(self._exit_code)
                        _log.warning(
                            "left the Checkpointer at the shutdown deadline: a snapshot still being taken "
                            "in the stager's thread (a value slow to copy; its save was given up, nothing "
                            "of it is saved) was abandoned; its host memory stays until the process exits"
                        )
                    self._stager = None
                if self._ledger is not None and not abandoned:
                    # After the stager (its arenas' bytes go back as they are unmapped).
                    # An abandoned write still reads its staged copy: its bytes stay
                    # counted until the process exits.
                    self._ledger.close()
                    self._ledger = None
                if self._session is not None:
                    session = self._session
                    if not abandoned:
                        await run_in_thread(
                            lambda: _session.remove_own_leftovers(session.root, session.token),
                            name="async-stager-close",
                        )
                    await run_in_thread(session.close, name="async-stager-close")
                    self._session = None
                await run_in_thread(self._place.close, name="async-stager-close")
        if interrupted and exc is not None:
            _log.warning("%s", interrupted_line(exc, interrupted, self.last))
        if exc is None:
            self._schedule.raise_failure(closing=True)
        return None

    def _abandon(self) -> None:
        """The exit deadline passed: stop waiting for the saves in flight. Their
        threads go on until the process exits; their folders are left for the next
        open to remove (their writer lock is released when this Checkpointer closes)."""
        what = ", ".join(f"step {p.step} ({p.phase})" for p in self.in_flight()) or "nothing"
        if self._saves.items:
            exit_fast_if_abandoned(self._exit_code)
        self._schedule.abandon()
        newest = f"step {self.last.step}" if self.last is not None else "the newest earlier commit"
        _log.warning(
            "left the Checkpointer at the shutdown deadline: abandoned %s (nothing more is committed; "
            "%s stays the one a restart restores)",
            what,
            newest,
        )

    @property
    def stager(self) -> Stager:
        if self._stager is None:
            raise ClosedError("the Checkpointer is not open: use it as `async with Checkpointer(...)`")
        return self._stager

    def _check_open(self, call: str) -> anyio.abc.TaskGroup:
        if self._tg is None or self._closing:
            raise ClosedError("the Checkpointer is not open: use it as `async with Checkpointer(...)`")
        check_loop(self._loop_thread, call)
        return self._tg

    # -- saving -----------------------------------------------------------------------

    def save(self, state: dict[str, Any], *, step: int) -> Coroutine[Any, Any, bool]:
        """Save ``state`` as checkpoint ``step``: await the returned coroutine, which
        returns once the state is staged (the sources may change after that, or after
        ``await fence()``); the write runs in the background. Returns False if the
        ``"skip"`` policy skipped it. Call it on the event loop that opened the
        Checkpointer.

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
        self._check_open("save()")
        check_step(step)
        if self._read_only:
            raise CheckpointError(
                f"cannot save step {step}: this Checkpointer is open for restore only: {self._read_only}",
                step=step,
            )
        self._schedule.raise_failure()
        return self._schedule.save(state, step, time.monotonic())

    def fence(self) -> Coroutine[Any, Any, None]:
        """Wait until every save called so far has read its sources: after this, they
        may change. The ordering points are read at this call (``Stager.fence``).
        Cancellation: only the wait."""
        check_loop(self._loop_thread, "fence()")
        self.stager  # noqa: B018 - ClosedError when not open
        fences, pending = self._schedule.fence()

        async def fenced() -> None:
            # Always one turn of the loop, even with nothing to wait for (the writes
            # run in threads of their own and need none; the loop-side ends of a
            # write, which hand the staged copy back, get theirs here).
            await anyio.lowlevel.cancel_shielded_checkpoint()
            try:
                await fences[0]  # the folder's stager
                for read in pending:
                    await read.wait()
                for fence in fences[1:]:
                    await fence  # the memory snapshots' stages
            finally:
                for fence in fences:
                    fence.close()  # (not awaited if cancelled before: no warning)

        return fenced()

    async def wait(self) -> None:
        """Wait until every save so far is committed (or failed), the memory tier's
        too; raises the first failure not yet raised. Cancellation: only the wait;
        the writes go on."""
        self._check_open("wait()")
        await self._schedule.drain(settle=True)
        session = self._session
        if session is not None and not self._saves.abandoned:
            live = frozenset(i.seq for i in self._saves.items)
            await run_in_thread(
                lambda: _session.remove_own_leftovers(session.root, session.token, live),
                name="async-stager-leftovers",
            )
        self._schedule.raise_failure()

    # -- what a service sees and asks for ------------------------------------------

    def in_flight(self) -> list[SaveProgress]:
        """The saves not yet ended (committed, failed or dropped): the disk saves, oldest
        call first, then the memory snapshot in flight (``agent=``): step, phase,
        seconds since the call. A snapshot; cheap (no I/O)."""
        return self._schedule.in_flight()

    def status_line(self) -> str:
        """``in_flight()`` as one line for a person (a log, a status page, a terminal):
        per save its step, phase, seconds, MiB and time left when known, or ``"no save
        in flight"``. No I/O."""
        return status_line(self.in_flight())

    def request_save(self) -> SaveRequest:
        """Ask for a save from any task of this event loop (a request handler, a timer):
        the training loop takes it at its next ``save_if_requested`` call, its step
        boundary. Requests not yet taken are one request. ``await request.taken()`` for
        the step it was taken at, ``await request.wait()`` for its commit. Raises
        ClosedError if not open."""
        self._check_open("request_save()")
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
        take_request(request, step)
        seq = self._saves.seq
        try:
            coro = self.save(state, step=step)
        except BaseException as exc:
            finish_request(request, None, exc if isinstance(exc, Exception) else None)
            raise
        for made in (i for i in self._saves.items if i.seq == seq):  # the save this call made, if any
            made.request = request
        try:
            accepted = await coro
        except BaseException as exc:
            finish_request(request, None, exc if isinstance(exc, Exception) else None)
            raise
        if not accepted:
            finish_request(request, None)
        return accepted

    def saved(self) -> SavedStream:
        """An async iterator of the SaveStats of every commit from now on; it ends when
        the Checkpointer closes. ``async for stats in ckpt.saved(): ...``"""
        return self._streams.new()

    def _deliver(self, stats: SaveStats) -> None:
        self.last = stats
        self._streams.offer(stats)
        if self._on_saved is not None:
            try:
                self._on_saved(stats)
            except Exception:  # noqa: BLE001 - a callback's bug must not cancel training
                _log.exception("the on_saved callback raised for step %d (the step is committed)", stats.step)

    # -- restoring --------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps in the directory, oldest commit first (the last is the
        newest: what ``restore()`` tries first)."""
        return self._place.committed_steps()

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
        self._check_open("restore()")
        if self._tier is not None:
            got = await _tiered.restore(self._tier, self._ranks, self._place, state, step)
            if got is not None:
                return got
        return await _restore.restore(
            self.options,
            self._place,
            self._format,
            self._ranks,
            state,
            step=step,
            fallback=fallback,
            created=self._created,
        )


def leave_by(ckpt: Checkpointer, deadline: float, exit_code: int) -> None:
    """Make leaving ``ckpt``'s block stop waiting for writes at ``deadline`` (anyio
    clock): ``Shutdown.final_checkpoint`` after it missed its deadline. ``exit_code``:
    the status the process exits with if an abandoned write is still running then. A
    function, not a method: a Checkpointer shows its users only what they call."""
    ckpt._leave_at = deadline
    ckpt._exit_code = exit_code
