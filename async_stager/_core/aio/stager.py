"""Stager: the awaitable staging API for asyncio, uvloop and trio.

``stage(sd)`` captures the snapshot point synchronously at the call (an event on the
caller's current CUDA stream), queues the walk-and-enqueue job on the stager's worker
thread, and returns a coroutine that waits for the job (the worker wakes the loop) and
then polls the copies' completion event with back-off. The event loop never blocks.

Validity of results: a staged result is never overwritten while it is reachable (the
staged dict, a tensor taken out of it, a view of one) or leased (``lease()``,
``snapshot()``). A later stage then writes into another buffer set (up to
``max_buffer_sets``) or waits until one is dropped or released; once a result is
dropped, its buffers are reused without any other call (checkpoint every N steps pays
for host memory once: this is the point). Releasing a lease (the end of a
``snapshot()`` block) empties the staged copy's top level and gives its set back at
once, so the name still bound to it after the block holds nothing (``_lease``); what
was taken out of it and is still referenced is protected as a plain result.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import os
import sys
import time
import weakref
from collections.abc import Callable, Coroutine
from types import FrameType, TracebackType
from typing import Any, Generic, Literal, TypeVar

import anyio.lowlevel

from async_stager._core.aio.internals import StagerInternals, register
from async_stager._core.aio.waiting import (
    Backoff,
    poll_completion,
    prepare_backend,
    wait_future,
    wait_future_uninterrupted,
)
from async_stager._core.checksum.digest import hasher
from async_stager._core.copy.device import Backend
from async_stager._core.memory.arena import Pinner
from async_stager._core.memory.lease import Lease, bind
from async_stager._core.memory.ledger import NodeLedger
from async_stager._core.options import AUTO, StagerOptions
from async_stager._core.run.jobs import StageJob, drop, job_done, log_stage_end, logged_run
from async_stager._core.run.make import build_engine
from async_stager._core.run.records import Captures, StageRecord
from async_stager._core.run.worker import Worker, WorkerForked, WorkerStopped
from async_stager._core.stats import StageStats
from async_stager.errors import ClosedError

__all__ = ["Stager", "stager_internals"]


def _refuse_sync_dcp(caller: FrameType) -> None:
    """Refuse a ``stage()`` called by DCP's ``async_save`` (a Stager given as its
    ``async_stager``): DCP takes the coroutine for a staged dict (it would write a
    coroutine, fail later with an AttributeError, and warn that the coroutine was never
    awaited). Only the caller's module name is read; nothing of DCP is imported here."""
    module = caller.f_globals.get("__name__", "")
    if isinstance(module, str) and module.startswith("torch.distributed.checkpoint"):
        raise TypeError(
            "async_stager.Stager cannot be DCP's async_stager: its stage() returns a coroutine "
            "for an event loop to await, and torch.distributed.checkpoint.async_save needs a "
            "staged dict or a Future. Pass async_stager=async_stager.DefaultStager() (DCP's "
            "staging API on the same engine), or from async code await "
            "async_stager.dcp.save(state_dict, stager=stager, checkpoint_id=...)"
        )


T = TypeVar("T")

#: The one source of the options' defaults (class attributes of the dataclass).
_D = StagerOptions

_log = logging.getLogger("async_stager.stage")


#: Bandwidth (bytes/second) assumed for a device before one copy was measured.
_DEFAULT_BANDWIDTH = 20e9


class Stager:
    """Stages nested state dicts into reusable host memory, awaitably.

    Keyword options (``None`` means what this machine supports):

    - ``pin_memory``: register host arenas with CUDA (default: when CUDA is available).
    - ``share_memory``: host arenas in shared memory, for writer processes (default off).
    - ``non_blocking``: asynchronous device-to-host copies (default: with CUDA).
    - ``max_buffer_sets``: host buffer generations: a result that is still reachable or
      leased is never overwritten; a stage that finds every set held waits for one.
    - ``buffer_wait_timeout``: seconds such a stage waits before BuffersHeldError
      (None: wait for ever).
    - ``copy_threads``: threads copying on the host, the worker included (default
      ``"auto"``: every core for a copy program mostly of tensors of 16 MiB or more,
      and for a first stage into new memory; all cores but one, which stays free for
      the event loop, otherwise).
    - ``preflight``: check host limits before mapping memory (``reserve()``, the first
      stage into a buffer set) and raise HostLimitError if the state cannot fit.
    - ``node_budget_bytes``: one host-memory budget (bytes) shared by every process of
      the job on this machine (the ranks of a node): each host arena is reserved from
      the node ledger before it is mapped, in FIFO order across the node, and given back
      when unmapped (``trim()``, ``aclose()``); a stage that cannot get its bytes within
      ``buffer_wait_timeout`` raises NodeBudgetError, one that needs more than the whole
      budget at once. Every rank gives the same. The ledger is found by
      ``node_budget_path`` (a directory) or the job's identity (``node_budget_job``,
      else ``TORCHELASTIC_RUN_ID``, else ``MASTER_ADDR:MASTER_PORT``); see
      docs/concepts.md. ``node_ledger``: an open ``NodeLedger`` to share instead (its
      owner closes it). With one process it is a plain per-process budget.
    - ``on_stage``: called on the event loop thread with each stage's StageStats.
    - ``backend``/``pinner``: the device seam (``async_stager.testing`` has fakes).

    Constructing binds nothing: the stager works with whichever loop awaits it. Use it
    as ``async with Stager() as stager:`` or call ``await stager.aclose()``.
    """

    def __init__(
        self,
        *,
        pin_memory: bool | None = None,
        share_memory: bool = _D.share_memory,
        non_blocking: bool | None = None,
        max_buffer_sets: int = _D.max_buffer_sets,
        buffer_wait_timeout: float | None = _D.buffer_wait_timeout,
        small_tensor_bytes: int = _D.small_tensor_bytes,
        scratch_bytes: int = _D.scratch_bytes,
        yield_interval: float = _D.yield_interval,
        worker_nice: int = _D.worker_nice,
        copy_threads: int | Literal["auto"] | None = None,
        preflight: bool = _D.preflight,
        node_budget_bytes: int | None = _D.node_budget_bytes,
        node_budget_path: str | os.PathLike[str] | None = _D.node_budget_path,
        node_budget_job: str | None = _D.node_budget_job,
        node_ledger: NodeLedger | None = None,
        backoff: Backoff | None = None,
        on_stage: Callable[[StageStats], None] | None = None,
        backend: Backend | None = None,
        pinner: Pinner | None = None,
    ) -> None:
        self._engine = build_engine(
            backend=backend,
            pinner=pinner,
            pin_memory=pin_memory,
            share_memory=share_memory,
            non_blocking=non_blocking,
            max_buffer_sets=max_buffer_sets,
            buffer_wait_timeout=buffer_wait_timeout,
            small_tensor_bytes=small_tensor_bytes,
            scratch_bytes=scratch_bytes,
            yield_interval=yield_interval,
            worker_nice=worker_nice,
            # Stager's own default: decided per copy program (see docs/benchmarks.md).
            copy_threads=copy_threads if copy_threads is not None else AUTO,
            preflight=preflight,
            node_budget_bytes=node_budget_bytes,
            node_budget_path=node_budget_path,
            node_budget_job=node_budget_job,
            ledger=node_ledger,
        )
        self.options: StagerOptions = self._engine.options
        prepare_backend()
        self._worker = Worker(nice=self.options.worker_nice)
        self._backoff = backoff if backoff is not None else Backoff()
        self._on_stage = on_stage
        self._stats: StageStats | None = None
        self._last_job: StageJob | None = None
        self._closed = False
        self._close_future: Any = None
        self._abandoned: set[StageJob] = set()
        self._internals = StagerInternals(self._engine, weakref.WeakMethod(self._start))
        register(self, self._internals)

    # -- staging ----------------------------------------------------------------------

    def stage(self, sd: T) -> Coroutine[Any, Any, T]:
        """Stage ``sd``; await the returned coroutine for the staged copy.

        The snapshot point is this call: values as of now, after all work already
        queued on the caller's current CUDA stream. Do not modify the sources in place
        until the coroutine returns (or ``await fence()`` has returned).

        The result is never overwritten while it is reachable: hold it (or any tensor
        or view taken out of it) as long as needed, and drop it (``del staged``) when
        done, so the next stage can reuse its buffers. While every one of the
        ``max_buffer_sets`` sets holds a reachable or leased result, a stage waits
        (cancellably) for one to be dropped, and raises BuffersHeldError after
        ``buffer_wait_timeout`` seconds. A state dict holding no tensor (``{"step":
        3}``) needs no set: its stage never waits (``stats.buffer_set`` is -1).

        Cancellation: a cancelled stage returned nothing. If the worker had not yet
        enqueued the copies, it stops; copies already in flight finish in the
        background with their buffers reserved, and the next stage waits for them.
        The stager stays usable. Raises ClosedError if the stager is closed, and
        StagingError subclasses naming the path for bad input.

        Passed to DCP as ``async_save(..., async_stager=stager)``, it raises TypeError
        at DCP's call, before anything is staged: DCP needs a staged dict or a Future
        from ``stage()`` (use ``DefaultStager``), not a coroutine.
        """
        _refuse_sync_dcp(sys._getframe(1))
        return self._start(sd, lease=False)

    def _start(
        self, sd: Any, *, lease: bool, checksums: bool = False, at: Captures | None = None
    ) -> Coroutine[Any, Any, Any]:
        """Submit the stage now (the snapshot point, or ``at``) and return the coroutine
        that finishes it: the result (``lease=False``) or a Lease."""
        if checksums:
            hasher()  # a missing xxhash fails here, at the call, not in a copy thread
        job = self._submit(sd, lease=lease, copy=True, checksums=checksums, at=at)
        coro = self._leased(job) if lease else self._result(job)
        # A coroutine never awaited (or whose task was cancelled before it started)
        # must stop the job like a cancelled one: abandon it when the coroutine dies.
        weakref.finalize(coro, job.abandon)
        return coro

    async def _result(self, job: StageJob) -> Any:
        staged = await self._complete(job)
        # Handed to the caller only: the job's future keeps the StageRecord, and a
        # result reachable from it would hold its buffer set for ever.
        result, staged.result = staged.result, None
        return result

    def lease(self, sd: T, *, checksums: bool = False) -> Coroutine[Any, Any, Lease[T]]:
        """Stage ``sd`` and hold its buffers: await for a ``Lease`` whose
        ``state_dict`` is the staged copy, protected until ``release()``.

        ``checksums=True``: the copy threads also hash what they copy, piece by piece
        as it lands (XXH3-64 per 8 MiB, see ``Checksums``), and a GPU hashes each
        source of 1 MiB or more before copying it (WSUM64, on a second stream);
        ``lease.checksums`` gives the digest of each staged tensor so hashed. Costs a
        second read of cached bytes on the CPU (docs/benchmarks.md); needs the
        ``xxhash`` package.

        For handing a result to another task, thread or process: ``lease = await
        stager.lease(sd)``, give the lease to the writer, the writer calls
        ``lease.release()`` (or uses ``async with lease as staged:``) when done.
        The snapshot point is this call, as for ``stage()``.

        Release means done: it empties the staged copy's top level (``staged == {}``)
        and gives the buffer set back at once, whoever still refers to the copy; a
        tensor, nested container, view or array taken out of it and still referenced
        keeps its values and holds the set, as a ``stage()`` result does (see
        ``Lease``).

        Cancellation: as for ``stage()``; a cancelled call leaves no lease behind.
        """
        return self._start(sd, lease=True, checksums=checksums)

    async def _leased(self, job: StageJob) -> Any:
        staged = await self._complete(job)
        lease = staged.lease
        assert lease is not None
        result, staged.result = staged.result, None
        bind(lease, result, staged.checksums)
        return lease

    def snapshot(self, sd: T) -> _Snapshot[T]:
        """``async with stager.snapshot(sd) as staged:`` a leased staged copy: sugar over
        ``async with await stager.lease(sd) as staged:`` (the same lease and release).

        The snapshot point is entering the block. No later stage overwrites the leased
        buffers until the block exits; such a stage uses a spare buffer set, or, when
        ``max_buffer_sets`` are all leased, waits (cancellably) for a release.

        Leaving the block is the release (see ``Lease``): the staged dict is emptied
        (``staged == {}`` after the block) and its buffer set is free at once, so a
        loop of ``async with stager.snapshot(sd) as staged: write(staged)`` stages
        into one buffer set every time. A tensor, nested container, view or array
        taken out of ``staged`` and kept after the block keeps its values and holds
        the set until dropped.

        Cancellation: while entering, as for ``stage()`` (no lease is left behind).
        Leaving the block releases the lease synchronously, so it cannot be
        interrupted.
        """
        return _Snapshot(self, sd)

    async def reserve(self, sd: Any) -> StageStats:
        """Allocate (and pin) host buffers and plan the layout for ``sd`` now, without
        copying, so the first real checkpoint costs what later ones do.

        Pre-flight (unless ``preflight=False``): before anything is allocated, what
        ``max_buffer_sets`` sets of buffers for ``sd`` need (host, pinned and shared
        bytes, descriptors; less what the stager holds) is compared with this process's
        limits; a state that cannot fit raises HostLimitError naming the limit, the need
        and the fix, and nothing is allocated (the stager stays usable). With a node
        budget it judges the node: ``LOCAL_WORLD_SIZE`` ranks' worth against the machine's
        memory (capped by what the budget may still grant), and this process's need
        against the whole budget (NodeBudgetError if it can never be granted).

        Cancellation: as for ``stage()``; buffers already allocated stay cached.
        """
        job = self._submit(sd, lease=False, copy=False)
        staged = await self._complete(job)
        staged.result = None
        assert self._stats is not None
        return self._stats

    async def trim(self) -> int:
        """Return the host memory of every buffer set that holds no result: each set
        neither leased nor holding a reachable result drops its plans and storage
        cache (after any copies still in flight into it have landed), and its arenas
        are unpinned and unmapped. Sets holding
        a reachable or leased result are left alone (their result stays valid).
        Returns the bytes released (``host_bytes`` drops by as much; a budgeted save's
        ring kept for the next one, dropped too, is not in ``host_bytes``).

        Memory is otherwise kept for the next checkpoint (see docs/concepts.md,
        "Memory"): a checkpoint whose storages fit what is held pays no new mapping or
        pinning. After a trim, the next stage into a trimmed set is a first stage
        again (it maps, pins and faults its memory in, and makes its plan). Call this
        when the host memory is wanted elsewhere for a while, or the state shrank for
        good.

        Cancellation: only the wait is cancelled; the trim runs to its end in the
        worker.
        """
        if self._closed:
            raise ClosedError("the stager is closed")
        try:
            fut = self._worker.submit(self._engine.trim)
        except WorkerStopped:
            raise ClosedError("the stager is closed") from None
        released: int = await wait_future(fut)
        return released

    def fence(self) -> Coroutine[Any, Any, None]:
        """Make the caller's current CUDA stream wait for the copies of every stage
        submitted so far; await the returned coroutine.

        The streams are read synchronously at this call, as ``stage()`` reads its
        snapshot point: the current stream of each CUDA device in the calling thread,
        whichever thread or task later runs the coroutine. Then it waits (without
        blocking the loop) until the worker has finished with the last stage submitted
        before the call (its copies *enqueued*, or the stage failed), and makes each of
        those streams wait for the latest copies enqueued on its device, whichever stage
        enqueued them: the host is never blocked on the copies themselves. Call it
        before modifying the sources in place (e.g. before ``optimizer.step()``) while a
        stage overlaps training. On the CPU the copies run in the worker, so the wait
        returns once they are done.

        Raises UnsupportedError at the call if the current stream is capturing a CUDA
        graph (a wait inside a capture belongs to the graph). It always gives the event
        loop one turn, even with nothing to wait for, so a training loop whose only
        await per step is ``fence()`` still lets its writer tasks run.

        Cancellation: only the wait is cancelled; no ordering was added.
        """
        job = self._last_job
        fut = job.future if job is not None else None
        del job
        apply = None if self._closed else self._engine.fence()
        hooked = [hook() for hook in tuple(self._internals.fence_hooks)]  # their points read now

        async def fenced() -> None:
            nonlocal fut
            await anyio.lowlevel.cancel_shielded_checkpoint()
            for wait in hooked:
                await wait()
            if fut is not None:
                try:
                    await wait_future(fut)
                except Exception:  # noqa: BLE001 - a failed stage still may have copies in flight
                    pass
                # The stage's future holds its result: not kept by this coroutine.
                fut = None
            if apply is not None and not self._closed:
                apply()

        return fenced()

    # -- internals --------------------------------------------------------------------

    def _submit(
        self, sd: Any, *, lease: bool, copy: bool, checksums: bool = False, at: Captures | None = None
    ) -> StageJob:
        if self._closed:
            raise ClosedError("the stager is closed")
        captures = self._engine.capture(sd) if at is None else at
        job = StageJob(self._engine, self._abandoned)
        run = functools.partial(
            logged_run,
            self._engine,
            sd,
            captures,
            lease=lease,
            cancel=job.cancel,
            copy=copy,
            checksums=checksums,
        )
        # The job runs in the caller's contextvars context (a copy taken now), as
        # asyncio.to_thread does: context variables set by the caller are visible to
        # the walk (a __reduce_ex__, a __torch_function__) and to logging filters.
        fn = functools.partial(contextvars.copy_context().run, run)
        try:
            # The job's cancel event is also set at interpreter exit (the worker stops
            # a running walk at its next check instead of finishing it).
            job.future = self._worker.submit(fn, cancel=job.cancel)
        except WorkerForked as e:
            raise ClosedError(str(e)) from None
        except WorkerStopped:
            raise ClosedError("the stager is closed") from None
        # A weak reference: the future must not keep its job (and engine) alive in a
        # reference cycle.
        job.future.add_done_callback(functools.partial(job_done, weakref.ref(job)))
        self._last_job = job
        return job

    async def _complete(self, job: StageJob) -> StageRecord:
        try:
            staged: StageRecord = await wait_future(job.future)
        except BaseException as e:
            _log.info(
                "stage failed after %.6f s: %s",
                time.perf_counter() - job.t0,
                "cancelled" if not isinstance(e, Exception) else repr(e),
            )
            del e
            job.abandon()
            fut = job.future
            if fut is not None and fut.done() and not fut.cancelled() and fut.exception() is not None:
                # The job failed: its future holds the error being raised, whose
                # traceback holds the frames that hold this job: a reference cycle
                # through the stager. Nothing needs the failed future any more
                # (fence() skips failed stages), so the job lets go of it.
                job.future = None
            del fut
            raise
        job.take()
        polls = 1
        t_wait = time.perf_counter()
        try:
            if staged.completions:
                for completion, device in zip(staged.completions, staged.devices):
                    bw = self._engine.bandwidth.get(device, _DEFAULT_BANDWIDTH)
                    polls += await poll_completion(
                        completion, expected_seconds=staged.nbytes / bw, backoff=self._backoff
                    )
                self._engine.settle(staged)
        except BaseException:
            # Cancelled while the copies were in flight: they finish in the background
            # and the set keeps them as in flight; the result and lease go now.
            drop(staged)
            raise
        now = time.perf_counter()
        wait_seconds = now - t_wait
        if staged.completions:
            self._engine.observe_bandwidth(staged.devices, staged.nbytes, wait_seconds)
        stats = StageStats(
            tensors=staged.tensors,
            storages=staged.storages,
            bytes=staged.nbytes,
            cache_hits=staged.hits,
            cache_misses=staged.misses,
            fast_path=staged.fast_path,
            buffer_set=-1 if staged.bufset is None else staged.bufset.index,
            host_bytes=self._engine.host_bytes,
            seconds=now - job.t0,
            worker_seconds=staged.worker_seconds,
            wait_seconds=wait_seconds,
            polls=polls,
        )
        self._stats = stats
        log_stage_end(stats)
        if self._on_stage is not None:
            try:
                self._on_stage(stats)
            except BaseException:
                # The caller gets the callback's error instead of the result, so
                # nobody would ever release a lease taken for it: every later stage
                # would then wait for that buffer set forever.
                drop(staged)
                raise
        return staged

    # -- state ------------------------------------------------------------------------

    @property
    def stats(self) -> StageStats | None:
        """The last completed stage's statistics (None before the first)."""
        return self._stats

    @property
    def host_bytes(self) -> int:
        """Host memory (bytes) this stager holds in its arenas."""
        return self._engine.host_bytes

    @property
    def buffer_sets(self) -> int:
        """Buffer sets made so far (at most ``options.max_buffer_sets``)."""
        return self._engine.buffer_sets

    @property
    def closed(self) -> bool:
        return self._closed

    # -- lifetime ---------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close: idempotent. A stage in its walk is stopped (it raises ClosedError);
        copies in flight are waited for; every arena is released and unpinned; the
        worker thread ends.

        Cancellation: deferred until the closing has completed, then raised (anyio/trio
        cancel scopes and a native asyncio ``Task.cancel()`` alike).
        """
        fut = self._begin_close()
        try:
            if fut is not None:
                await wait_future_uninterrupted(fut)
        finally:
            self._worker.stop()
            self._forget_results()

    def close(self) -> None:
        """Blocking ``aclose`` for synchronous code; do not call it on a running loop."""
        fut = self._begin_close()
        if fut is not None:
            fut.result()
        self._worker.stop()
        self._forget_results()

    def _forget_results(self) -> None:
        # The last job's future holds its staged result, whose tensors keep an arena
        # mapped (and its file descriptor open) for as long as this object lives.
        # Results the user still holds stay valid; the closed stager holds none.
        self._last_job = None

    def _begin_close(self) -> Any:
        if self._close_future is None:
            self._closed = True
            # Stops a walk at its next tick; queued jobs then fail with ClosedError.
            self._engine.begin_close()
            # The last job's future holds the last result: let its host memory go.
            self._last_job = None
            try:
                self._close_future = self._worker.submit(self._engine.close)
            except WorkerStopped:
                self._engine.close()
                return None
        return self._close_future

    async def __aenter__(self) -> Stager:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


class _Snapshot(Generic[T]):
    """The async context manager ``Stager.snapshot`` returns (see there)."""

    def __init__(self, stager: Stager, sd: T) -> None:
        self._stager = stager
        self._sd: T | None = sd
        self._lease: Lease[T] | None = None

    async def __aenter__(self) -> T:
        sd, self._sd = self._sd, None
        self._lease = await self._stager.lease(sd)  # type: ignore[arg-type]
        return self._lease.state_dict

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.release()


def stager_internals(stager: Stager) -> StagerInternals:
    """``stager``'s internal handle (``aio.internals.StagerInternals``)."""
    return stager._internals
