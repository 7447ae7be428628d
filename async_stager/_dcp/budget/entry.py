"""The budgeted save's one entry: ``budgeted_save(state_dict, stager, settings)``, its
checks and snapshot point at the call, and the ``BudgetedJob`` it returns (run
blocking in any thread, or awaited as ``dcp.save``'s coroutine), with cancellation.

The pipeline itself is ``pipeline`` (ring, copier thread), ``copies`` (its copies
through the device seam), ``pickling`` (bytes items into the ring), ``streaming``
(DCP's planner, writer and file system) and ``survey`` (what the call can check). The
device seam is the stager's, through its internal handle (``stager_internals``:
its ``lanes``, ``_core.run.lanes``): its ``Backend`` (a ``SimulatedBackend`` or ``FakeBackend`` in CPU
tests) answers the device questions at the call, a lane's copiers (their streams kept
from one save to the next) copy, the lane's ring (kept too, unless a node budget
reserved it) holds the pieces, pinned with the stager's pinner; the stager's fence
hooks make its ``fence()`` wait for the save.
"""

from __future__ import annotations

import functools
import os
import time
import weakref
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import torch

from async_stager._core.aio.stager import stager_internals
from async_stager._core.aio.threads import start_thread
from async_stager._core.aio.waiting import wait_future, wait_future_uninterrupted
from async_stager._core.copy.device import caller_cuda_device, graph_capture_error
from async_stager._core.memory.arena import Pinner
from async_stager._core.memory.ring import ALIGN
from async_stager._dcp.blocking import save_blocking
from async_stager._dcp.budget.pipeline import Pipeline
from async_stager._dcp.budget.share import BudgetStats
from async_stager._dcp.budget.streaming import PipelinePlanner, PipelineWriter
from async_stager._dcp.budget.survey import largest_tensor, survey
from async_stager.errors import BudgetTooSmallError, ClosedError, InvalidOptionError, StagingError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

    from async_stager._core.aio.stager import Stager
    from async_stager._core.memory.ledger import NodeLedger

__all__ = ["BudgetSettings", "BudgetedJob", "budgeted_save"]


@dataclass(frozen=True)
class BudgetSettings:
    """What a budgeted save is asked to do, besides its state dict and stager.

    ``budget``: the ring's bytes at most (``host_budget_bytes``). ``checkpoint_id``: the
    checkpoint's folder. ``process_group``/``no_dist``: DCP's. ``on_stats``: called (in
    the save's thread, before it returns; an exception from it fails the save) with
    the BudgetStats. ``digests`` (the Checkpointer's): filled with each written chunk's
    manifest entry (``_integrity``), hashed from its ring piece as it lands, before it
    is written. ``ledger``: a node budget the ring's bytes are reserved from: the ring
    is then at most ``min(budget, ledger.budget)`` and at least the largest tensor
    item, a share waited for at most the stager's ``buffer_wait_timeout`` seconds;
    ``owns_ledger``: the save closes it when it ends (also when it never runs, or when
    the call raises). ``captures``: a snapshot point taken earlier on the caller's
    streams (``StagerInternals.snapshot_point``, for a save its caller's policy deferred)
    instead of one taken at the call; its generator states too."""

    budget: int
    checkpoint_id: str | os.PathLike[str] | None
    process_group: Any = None
    no_dist: bool = False
    on_stats: Callable[[BudgetStats], None] | None = None
    digests: dict[str, dict[str, Any]] | None = None
    ledger: NodeLedger | None = None
    owns_ledger: bool = False
    captures: Mapping[torch.device, Any] | None = None


def budgeted_save(state_dict: dict[str, Any], stager: Stager, settings: BudgetSettings) -> BudgetedJob:
    """A budgeted save of ``state_dict`` through ``stager``'s device seam: the checks and
    the snapshot point now, the save in the returned job (``run()`` blocking in any
    thread, or ``coroutine()`` for ``dcp.save``).

    Raises at the call: InvalidOptionError, UnsupportedError (also when the caller's
    current stream of a device is capturing a CUDA graph), ClosedError, and
    BudgetTooSmallError (``survey``) for a tensor item or a value seen to need more than
    the budget in one piece. The save raises BudgetTooSmallError itself (not DCP's
    CheckpointException around it) for a value found too big when serialized."""
    try:
        return _prepare(state_dict, stager, settings)
    except BaseException:
        if settings.owns_ledger and settings.ledger is not None:
            settings.ledger.close()
        raise


def _prepare(state_dict: dict[str, Any], stager: Stager, settings: BudgetSettings) -> BudgetedJob:
    t0 = time.perf_counter()
    budget, ledger, checkpoint_id = settings.budget, settings.ledger, settings.checkpoint_id
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < ALIGN:
        raise InvalidOptionError(
            f"host_budget_bytes must be an int of at least {ALIGN} (bytes), not {budget!r}"
        )
    if ledger is not None:
        budget = min(budget, ledger.budget)
        path, need = largest_tensor(state_dict)
        if need > ledger.budget:
            raise BudgetTooSmallError(
                f"this tensor takes {need} bytes of host memory, more than the whole node budget "
                f"(node_budget_bytes={ledger.budget}) that the ranks of this machine share; pass "
                f"node_budget_bytes >= {need} (every rank the same)",
                path=path,
                needed_bytes=need,
            )
    if checkpoint_id is None:
        raise InvalidOptionError("a budgeted save needs checkpoint_id (the checkpoint's folder)")
    if stager.closed:
        raise ClosedError("the stager is closed")
    seen = survey(state_dict, budget)
    # The stager's device seam (``Stager(backend=...)``): what its stages copy with.
    handle = stager_internals(stager)
    lanes = handle.lanes
    backend = lanes.backend
    devices = list(dict.fromkeys(backend.known_devices()))
    # Checked before anything is made or recorded on a device (as stage() does): an
    # event recorded on a capturing stream belongs to the graph, so the copies could
    # not be ordered with it.
    for d in devices:
        if backend.capturing(d):
            raise graph_capture_error("dcp.save(host_budget_bytes=...)", d)
    # The snapshot point: a capture on the caller's current stream of every device a
    # source may live on, by the copier there of the lane this save takes (made on this
    # thread the first time: its copy stream is not the caller's; kept for the next
    # save). The stager's own copiers belong to its worker.
    lane = lanes.take(devices)
    captures = settings.captures
    try:
        if captures is None:
            taken = {d: lane.copiers[d].capture() for d in devices}
        else:
            # Taken at the caller's earlier call (an event on its stream, which any
            # stream may wait on), with the generator states read then.
            taken = {d: captures.get(d) for d in devices}
            seen.generators = {**seen.generators, **getattr(captures, "generators", {})}
        pipeline = Pipeline(
            budget,
            captures=taken,
            t0=t0,
            lanes=lanes,
            lane=lane,
            pinner=_ring_pinner(lanes.pinner, bool(captures)),
            seen=seen,
            digests=settings.digests,
            ledger=ledger,
            ledger_wait=stager.options.buffer_wait_timeout,
            owns_ledger=settings.owns_ledger,
        )
    except BaseException:
        lanes.give_back(lane, settled=True)
        raise
    remove = handle.add_fence_hook(pipeline.fence)
    save = functools.partial(
        save_blocking,
        state_dict,
        no_dist=settings.no_dist,
        cuda_device=caller_cuda_device(),
        storage_writer=PipelineWriter(checkpoint_id, pipeline),
        planner=PipelinePlanner(pipeline),
        process_group=settings.process_group,
    )
    return BudgetedJob(pipeline, remove, save, settings.on_stats)


class BudgetedJob:
    """A budgeted save made at the call (its checks, its snapshot point, its fence
    hook), run later by one blocking ``run()`` in any thread: a caller that runs it in
    a thread of its own (the Checkpointer's write) needs no event loop turn for the
    whole save; or awaited (``coroutine()``). ``abort()`` stops it from any thread (DCP
    then fails it before writing metadata); ``forget()`` drops one never run (its fence
    hook goes at once)."""

    def __init__(
        self,
        pipeline: Pipeline,
        remove: Callable[[], None],
        save: Callable[[], Any],
        on_stats: Callable[[BudgetStats], None] | None,
    ) -> None:
        self.pipeline = pipeline
        self._remove = remove
        self._save = save
        self._on_stats = on_stats

    @property
    def started(self) -> bool:
        return self.pipeline.started

    def run(self) -> Metadata:
        """The whole save, blocking: DCP's save through the ring. Raises its failure (a
        BudgetTooSmallError found when serializing is raised as itself)."""
        pipeline = self.pipeline
        pipeline.started = True
        try:
            result: Any = None
            error: BaseException | None = None
            try:
                result = self._save()
            except BaseException as e:  # noqa: BLE001 - raised below, once the ring is freed
                error = e
                own = pipeline.error
                if isinstance(own, StagingError) and own is not e:
                    # DCP wraps what failed in its writer (CheckpointException); a
                    # refusal of ours (a value beyond the budget, found when
                    # serialized) is raised as itself.
                    error = own
            # Before the waiter wakes: the ring is freed and the stats are delivered.
            pipeline.finish()  # also when DCP failed before write_data
            if self._on_stats is not None:
                try:
                    self._on_stats(pipeline.stats(time.perf_counter() - pipeline.t0))
                except Exception as e:  # noqa: BLE001 - a failing callback fails the save
                    error = error or e
            if error is not None:
                raise error
            metadata: Metadata = result
            return metadata
        finally:
            self._remove()

    def coroutine(self) -> Coroutine[Any, Any, Metadata]:
        """``dcp.save``'s coroutine: the job in a thread of its own (see ``_run``). One
        never awaited lets the fence go when it is collected (nothing was staged)."""
        coro = _run(self)
        weakref.finalize(coro, self.forget)
        return coro

    def abort(self) -> None:
        """Stop the save (any thread): its copies stop, DCP fails it."""
        self.pipeline.abort()

    def forget(self) -> None:
        """Drop it if it never ran (idempotent; nothing once it started)."""
        if not self.pipeline.started:
            self.pipeline.started = True  # it never runs now
            self._remove()
            self.pipeline.abort()
            self.pipeline.finish()


def _ring_pinner(pinner: Pinner | None, devices_in_use: bool) -> Pinner | None:
    """The ring pins as the stager's arenas do, with the engine's pinner (None when the
    stager does not pin): one registration, exact size. Not with a pinner that needs a
    device context while no device is in use (``Engine._skips_pinning``'s rule: no
    context is created for memory no device copy reads)."""
    if pinner is None or (getattr(pinner, "needs_context", False) and not devices_in_use):
        return None
    return pinner


async def _run(job: BudgetedJob) -> Metadata:
    """``dcp.save``'s coroutine: the job in a thread of its own. Cancellation: the
    copies stop, DCP fails the save before any metadata is written, and the thread is
    waited for (shielded: the ring must not be in use after)."""
    pipeline = job.pipeline
    pipeline.started = True  # (before the thread: forget() leaves it alone now)
    try:
        fut = start_thread(job.run, name="async-stager-dcp-save")
    except BaseException:
        pipeline.started = False
        job.forget()
        raise
    try:
        return await wait_future(fut)
    except BaseException:
        if not fut.done():
            pipeline.abort()
            with anyio.CancelScope(shield=True):
                try:
                    await wait_future_uninterrupted(fut)
                except BaseException:  # noqa: BLE001 - DCP's CheckpointException is one; the cancellation is raised
                    pass
        raise
