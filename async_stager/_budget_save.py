"""``dcp.save(..., host_budget_bytes=N)``: the call, the coroutine and cancellation.

The pipeline itself (ring, copier thread, DCP planner and writer) is ``_budget``.
"""

from __future__ import annotations

import functools
import os
import threading
import time
import weakref
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import anyio
import torch

from ._budget import BudgetStats, Pipeline, PipelinePlanner, PipelineWriter
from ._copiers import CudaEvent
from ._device import caller_cuda_device, cuda_context_devices
from ._errors import BudgetTooSmallError, ClosedError, InvalidOptionError, UnsupportedError
from ._options import AUTO, loop_friendly_threads
from ._ring import ALIGN, padded
from ._waiting import wait_future, wait_future_uninterrupted

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

    from ._stager import Stager

__all__ = ["abandon", "budgeted_save", "largest_tensor"]


def _tensors(obj: Any, path: tuple[Any, ...]) -> Iterator[tuple[tuple[Any, ...], torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, (*path, k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, (*path, i))


def _local_nbytes(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def largest_tensor(state_dict: Any) -> tuple[tuple[Any, ...], int]:
    """The path and ring bytes (padded) of the biggest tensor of ``state_dict`` (a
    DTensor counts its local shard: what this rank writes)."""
    best: tuple[tuple[Any, ...], int] = ((), 0)
    for path, t in _tensors(state_dict, ()):
        n = padded(_local_nbytes(t))
        if n > best[1]:
            best = (path, n)
    return best


def budgeted_save(
    state_dict: dict[str, Any],
    *,
    stager: Stager,
    budget: int,
    checkpoint_id: str | os.PathLike[str] | None,
    storage_writer: Any,
    planner: Any,
    process_group: Any,
    no_dist: bool,
    on_stats: Callable[[BudgetStats], None] | None,
    digests: dict[str, dict[str, Any]] | None = None,
) -> Coroutine[Any, Any, Metadata]:
    """Checks and the snapshot point at the call; the save in the coroutine.
    ``digests`` (the Checkpointer's): filled with each written chunk's manifest entry
    (``_integrity``), hashed from its ring piece as it lands, before it is written."""
    t0 = time.perf_counter()
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < ALIGN:
        raise InvalidOptionError(
            f"host_budget_bytes must be an int of at least {ALIGN} (bytes), not {budget!r}"
        )
    if storage_writer is not None or planner is not None:
        raise UnsupportedError(
            "a budgeted save brings its own planner and FileSystemWriter: pass checkpoint_id "
            "(a folder) and leave storage_writer and planner None"
        )
    if checkpoint_id is None:
        raise InvalidOptionError("a budgeted save needs checkpoint_id (the checkpoint's folder)")
    if stager.closed:
        raise ClosedError("the stager is closed")
    path, need = largest_tensor(state_dict)
    if need > budget:
        raise BudgetTooSmallError(
            f"this tensor takes {need} bytes of host memory, more than host_budget_bytes={budget}; "
            f"pass host_budget_bytes >= {need}",
            path=path,
            needed_bytes=need,
        )
    # The snapshot point: the caller's current stream of every device with a context.
    captures = {d: CudaEvent(torch.cuda.current_stream(d)) for d in cuda_context_devices()}
    threads = stager.options.copy_threads
    pipeline = Pipeline(
        budget,
        captures=captures,
        t0=t0,
        # One core is left to the writer, as by default for the loop.
        copy_threads=loop_friendly_threads() if threads == AUTO or isinstance(threads, str) else threads,
        digests=digests,
    )
    remove = stager.add_fence(pipeline.fence)
    coro = _run(
        pipeline,
        remove,
        state_dict,
        checkpoint_id=checkpoint_id,
        process_group=process_group,
        no_dist=no_dist,
        cuda_device=caller_cuda_device(),
        on_stats=on_stats,
    )
    # Never awaited: nothing was staged; the fence must not wait for it.
    _ABANDON[coro] = weakref.finalize(coro, _forget, pipeline, remove)
    return coro


#: Per budgeted save not yet awaited: what lets its fence hook and pipeline go.
_ABANDON: weakref.WeakKeyDictionary[Any, weakref.finalize[Any, Any]] = weakref.WeakKeyDictionary()


def abandon(coro: Coroutine[Any, Any, Any]) -> None:
    """Drop a budgeted save that will never be awaited, now: its fence hook is removed
    (a ``fence()`` waiting on it returns) and its pipeline stopped. Waiting for the
    coroutine to be collected is not enough: a traceback that holds a frame holding it
    would keep every later ``fence()`` waiting. No-op for a save already started."""
    fin = _ABANDON.pop(coro, None)
    info = fin.peek() if fin is not None else None
    if info is None or info[2][0].started:
        return  # running (or done): it cleans up after itself
    coro.close()
    assert fin is not None
    fin()


def _forget(pipeline: Pipeline, remove: Callable[[], None]) -> None:
    remove()
    pipeline.abort()
    pipeline.finish()


async def _run(
    pipeline: Pipeline,
    remove: Callable[[], None],
    state_dict: dict[str, Any],
    *,
    checkpoint_id: str | os.PathLike[str],
    process_group: Any,
    no_dist: bool,
    cuda_device: int | None,
    on_stats: Callable[[BudgetStats], None] | None,
) -> Metadata:
    from .dcp import _save_blocking

    pipeline.started = True
    fn = functools.partial(
        _save_blocking,
        state_dict,
        no_dist=no_dist,
        cuda_device=cuda_device,
        storage_writer=PipelineWriter(checkpoint_id, pipeline),
        planner=PipelinePlanner(pipeline),
        process_group=process_group,
    )
    fut: Future[Metadata] = Future()

    def target() -> None:
        if not fut.set_running_or_notify_cancel():
            return
        result: Any = None
        error: BaseException | None = None
        try:
            result = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
            error = e
        # Before the waiter wakes: the ring is freed and the stats are delivered.
        pipeline.finish()  # also when DCP failed before write_data
        if on_stats is not None:
            try:
                on_stats(pipeline.stats(time.perf_counter() - pipeline.t0))
            except Exception as e:  # noqa: BLE001 - a failing callback fails the save
                error = error or e
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    try:
        threading.Thread(target=target, name="async-stager-dcp-save", daemon=False).start()
        try:
            return await wait_future(fut)
        except BaseException:
            if not fut.done():
                # Cancelled mid-stream: stop the copies; DCP's writer then raises
                # SaveAborted and DCP fails the save before writing any metadata. The
                # thread is waited for (shielded): the ring must not be in use after.
                pipeline.abort()
                with anyio.CancelScope(shield=True):
                    try:
                        await wait_future_uninterrupted(fut)
                    except BaseException:  # noqa: BLE001 - DCP's CheckpointException is one; the cancellation is raised
                        pass
            raise
    finally:
        remove()
