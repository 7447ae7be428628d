"""Stage-then-save with PyTorch Distributed Checkpoint (DCP), awaitably.

``await async_stager.dcp.save(sd, stager=stager, checkpoint_id=path)`` stages ``sd``
into the stager's host buffers (holding a lease on them, see ``Stager.snapshot``; the
snapshot point is the call to ``save``, even when the coroutine starts later), then
runs ``torch.distributed.checkpoint.save`` on the staged copy in a worker thread and
returns the checkpoint's ``Metadata`` once DCP has finished writing it (with DCP's
``FileSystemWriter``, whose ``sync_files=True`` default fsyncs every file, that means
durable on disk). The event loop is never blocked: the walk and copies run in the
stager's worker, the serialization and writes in a thread of their own.

Who owns what: the caller owns ``sd`` and may modify it again as soon as the staging
half is done; ``save`` returns only after the write, so to overlap training with the
write, run it as a task (``asyncio.create_task``, a trio nursery) and modify the sources
only after ``await stager.fence()`` (or once staging is known to be done). The staged
buffers belong to the stager; the lease keeps later stages out of them until the write
has finished, so a checkpoint in flight is never torn by the next one (that stage uses
another buffer set, or waits when ``max_buffer_sets`` are all leased).

Multi-rank jobs: call ``save`` on every rank with the same ``checkpoint_id``; DCP's
collectives run in the worker thread on the default (or given) process group, exactly
as DCP's own ``async_save`` does. See docs/recipes.md for gloo and NCCL.
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from async_stager._core.aio.threads import run_in_thread
from async_stager._core.copy.device import caller_cuda_device
from async_stager._dcp.blocking import save_blocking as save_blocking  # patched by tests
from async_stager._dcp.budget import BudgetSettings, BudgetStats, budgeted_save
from async_stager._dcp.store_io import StoreWriter, is_store_url
from async_stager.errors import (
    InvalidOptionError,
    InvalidOptionTypeError,
    InvalidStateDictError,
    UnsupportedError,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import SavePlanner
    from torch.distributed.checkpoint.storage import StorageWriter

    from async_stager._core.aio.stager import Stager
    from async_stager._core.memory.lease import Lease
    from async_stager._core.memory.ledger import NodeLedger

__all__ = ["BudgetStats", "save", "save_staged"]

T = TypeVar("T")


def save(
    state_dict: dict[str, Any],
    *,
    stager: Stager,
    checkpoint_id: str | os.PathLike[str] | None = None,
    storage_writer: StorageWriter | None = None,
    planner: SavePlanner | None = None,
    process_group: ProcessGroup | None = None,
    no_dist: bool = False,
    host_budget_bytes: int | None = None,
    on_budget_stats: Callable[[BudgetStats], None] | None = None,
    node_budget_bytes: int | None = None,
    node_budget_path: str | None = None,
    node_budget_job: str | None = None,
    node_ledger: NodeLedger | None = None,
) -> Coroutine[Any, Any, Metadata]:
    """Stage ``state_dict`` with ``stager``, then save the staged copy with DCP; await
    the returned coroutine (or run it as a task) for DCP's ``Metadata``.

    The snapshot point is this call, as for ``Stager.stage``: the values as of now,
    ordered after the work already queued on the caller's current CUDA stream, even if
    the coroutine only starts later (``asyncio.create_task``, ``nursery.start_soon``).
    So ``task = create_task(save(...)); await stager.fence(); optimizer.step()`` is
    safe. The coroutine returns once ``torch.distributed.checkpoint.save`` has returned,
    i.e. once every rank's files and the metadata are written (fsynced with the default
    ``FileSystemWriter``). The staged buffers stay leased until then.

    ``state_dict`` must be DCP-shaped: a ``dict`` with ``str`` keys whose values are
    tensors, DTensors or nested containers of them and plain Python values; call
    ``get_state_dict``/``model.state_dict()`` first (objects with a ``state_dict()``
    method are staged as objects, not called). Other arguments are passed to
    ``torch.distributed.checkpoint.save``; ``no_dist=True`` saves from this process
    alone (and silences DCP's warning about it, which the caller asked for).

    Cancellation: while staging, as for ``Stager.snapshot``: nothing was saved and no
    lease is left behind. Once the save has started it cannot be interrupted (the
    thread is in DCP's serialization, file writes and, with several ranks, collectives
    that the other ranks are waiting in), so a cancellation then is deferred: ``save``
    waits for the thread, releases the lease, and only then raises the cancellation.
    The checkpoint on disk is then complete, even though ``save`` raised. (Abandoning
    the thread instead would leave the staged buffers in use by a writer while the
    stager believes them free.) Errors from DCP propagate unchanged after the lease is
    released. A coroutine that is dropped without being awaited gives its lease back
    when it is garbage collected.

    ``host_budget_bytes=N``: stage and write in a pipeline that holds at most ``N``
    bytes of host memory for what it writes instead of a full staged copy; the stager's
    buffer sets are not used. Each write item is copied into a ring of ``N`` bytes just
    ahead of DCP's ``FileSystemWriter`` (one thread, its serial loader) and its memory
    reused as soon as it is written: a tensor item (a tensor, a DTensor's local shard)
    in one piece, a non-tensor value (what DCP pickles as a bytes item: an int, a
    tuple, a dataclass or other object, with the tensors inside it) serialized by
    ``torch.save`` as DCP would, in pieces, so a CPU tensor inside an object needs no
    more than the ring. ``await stager.fence()`` returns once the last copy is enqueued
    (the sources, tensors inside objects included, must not change until then), so it
    waits as long as the budget forces. ``on_budget_stats`` is called (in the save's
    thread, before the save returns; an exception from it fails the save) with the
    BudgetStats (blocked seconds, peak bytes). ``storage_writer`` and ``planner`` must
    be None (the pipeline brings its own; UnsupportedError otherwise).

    BudgetTooSmallError (with ``path`` and ``needed_bytes``) for what cannot be cut
    into pieces and is bigger than ``N``: a tensor item; a value's pickle (the value
    without its CPU tensors' data, which ``torch.save`` builds whole: a big bytes
    object, numpy array, string or list of numbers); a device tensor inside a value
    (``torch.save`` moves its storage to host memory whole). Raised at the call, before
    anything is staged, for what can be seen without pickling; otherwise by the
    coroutine when the value is serialized (before any metadata is written). The fix
    it names: store such data as a tensor of the state dict, or a bigger budget.
    Besides the ring, one such pickle (at most ``N``) is held while its value is
    serialized.

    Cancellation stops the copies; DCP then fails the write on every rank before any
    metadata is written (no checkpoint becomes visible), the ring is freed, the fence
    no longer waits for the save, and the cancellation is raised once DCP's thread has
    returned. docs/concepts.md has the pipeline.

    Raises ClosedError (at the call) if the stager is closed, and InvalidStateDictError
    (at the call) for a ``state_dict`` that is not a dict (as DCP's ``save`` takes), or
    that holds a module or optimizer below its top level. A top-level value with
    ``state_dict()`` (a module, an optimizer, a Stateful) is DCP's Stateful: its
    ``state_dict()`` is what is saved (called at the call, before staging).

    ``node_budget_bytes=N`` (or ``node_ledger``, an open ``NodeLedger`` the caller owns):
    the save runs in the budgeted pipeline (``host_budget_bytes``, which defaults to
    ``N`` then) and its ring is reserved from the node ledger that the ranks of this
    machine share, before it is allocated or pinned: the whole ring when it fits, else
    a share of what the node has free (at least the largest tensor item; waited for in
    the node's ticket order at most ``stager.options.buffer_wait_timeout`` seconds,
    NodeBudgetError after). The share is given back when this rank's files are written
    (before DCP's last collectives), also when the save fails or is cancelled.
    BudgetTooSmallError at the call, naming the tensor and both sizes, for a tensor
    item bigger than the whole node budget. ``BudgetStats.node_wait_seconds``: the wait.
    The ledger is found as for ``Stager``: ``node_budget_path`` or the job's identity
    (``node_budget_job``, torchrun's run id, ``MASTER_ADDR:MASTER_PORT``); opened at the
    call and closed when the save ends. Every rank of the node gives the same ``N``.
    """
    from async_stager._core.aio.stager import Stager as _Stager

    if not isinstance(stager, _Stager):
        raise InvalidOptionTypeError(
            f"stager must be an async_stager.Stager, got {type(stager).__name__}"
            + (
                " (a DefaultStager is DCP's staging API: give it to torch.distributed.checkpoint"
                ".async_save(..., async_stager=...), or use async_stager.Stager() here)"
                if hasattr(stager, "synchronize_staging")
                else ""
            )
        )
    state_dict = _resolve_top_level(state_dict)
    if node_ledger is not None and node_budget_bytes not in (None, node_ledger.budget):
        raise InvalidOptionError(
            f"node_budget_bytes={node_budget_bytes} differs from the budget of the node ledger given "
            f"({node_ledger.budget}); pass one of them"
        )
    node = node_ledger is not None or node_budget_bytes is not None
    if not node and (node_budget_path is not None or node_budget_job is not None):
        raise InvalidOptionError("node_budget_path and node_budget_job need node_budget_bytes")
    if node or host_budget_bytes is not None:
        if is_store_url(checkpoint_id):
            raise UnsupportedError(
                f"checkpoint_id={checkpoint_id!r}: a budgeted save writes a local folder; to an object "
                "store, save without host_budget_bytes/node_budget_bytes (its uploads are bounded by "
                "the store's part budget), or use Checkpointer(url, host_budget_bytes=...)"
            )
        if storage_writer is not None or planner is not None:
            raise UnsupportedError(
                "a budgeted save brings its own planner and FileSystemWriter: pass checkpoint_id "
                "(a folder) and leave storage_writer and planner None"
            )
        ledger = node_ledger
        if ledger is None and node_budget_bytes is not None:
            from async_stager._core.memory.ledger import NodeLedger

            ledger = NodeLedger.open(node_budget_bytes, path=node_budget_path, job=node_budget_job)
        if host_budget_bytes is None:
            assert ledger is not None
            host_budget_bytes = ledger.budget
        settings = BudgetSettings(
            host_budget_bytes,
            checkpoint_id,
            process_group=process_group,
            no_dist=no_dist,
            on_stats=on_budget_stats,
            ledger=ledger,
            owns_ledger=node_ledger is None and ledger is not None,
        )
        return budgeted_save(state_dict, stager, settings).coroutine()
    if storage_writer is None and is_store_url(checkpoint_id):
        # An object store's checkpoint: DCP's writer on our store (DCP alone would pick
        # fsspec's, or a local folder named "s3:").
        storage_writer = StoreWriter(str(checkpoint_id))
    # The staging job is submitted now, leased (what ``snapshot`` does on entering),
    # and the caller's CUDA device read now: the coroutine may run in another thread.
    leasing = stager.lease(state_dict)
    started = [False]
    coro = _save(
        leasing,
        started,
        cuda_device=_current_cuda_device(),
        checkpoint_id=checkpoint_id,
        storage_writer=storage_writer,
        planner=planner,
        process_group=process_group,
        no_dist=no_dist,
    )
    weakref.finalize(coro, _abandon_unstarted, leasing, started)
    return coro


def _resolve_top_level(state_dict: Any) -> Any:
    """DCP's rule at the call: a dict, whose top-level Statefuls (anything with
    ``state_dict`` and ``load_state_dict`` but a tensor) are their ``state_dict()``,
    called now, as DCP's ``save`` and ``async_save`` do before staging (the stager
    refuses a module or optimizer object: ``stateful_object_error``)."""
    from collections.abc import Mapping

    import torch

    if not isinstance(state_dict, Mapping):
        raise InvalidStateDictError(
            f"dcp.save takes a state dict (a dict, as DCP's save does), got {type(state_dict).__name__}"
            + (
                " (pass {'model': model}: its state_dict() is saved)"
                if hasattr(state_dict, "state_dict")
                else ""
            ),
            path=(),
        )

    def stateful(v: Any) -> bool:
        return (
            not isinstance(v, torch.Tensor)
            and callable(getattr(v, "state_dict", None))
            and callable(getattr(v, "load_state_dict", None))
        )

    if not any(map(stateful, state_dict.values())):
        return state_dict
    return {k: v.state_dict() if stateful(v) else v for k, v in state_dict.items()}


def _abandon_unstarted(leasing: Coroutine[Any, Any, Any], started: list[bool]) -> None:
    if not started[0]:
        # Never awaited: closing it (no "never awaited" warning) lets it be collected,
        # which abandons its job (the lease is released once the job is done).
        leasing.close()


async def _save(
    leasing: Coroutine[Any, Any, Lease[dict[str, Any]]],
    started: list[bool],
    *,
    cuda_device: int | None,
    **kwargs: Any,
) -> Metadata:
    started[0] = True
    lease = await leasing  # on cancellation: no lease left behind
    # Released after the write, whatever happens (the write's cancellation is deferred).
    with lease as staged:
        return await _save_staged(staged, cuda_device=cuda_device, **kwargs)


def save_staged(
    staged: dict[str, Any],
    *,
    checkpoint_id: str | os.PathLike[str] | None = None,
    storage_writer: StorageWriter | None = None,
    planner: SavePlanner | None = None,
    process_group: ProcessGroup | None = None,
    no_dist: bool = False,
) -> Coroutine[Any, Any, Metadata]:
    """Save an already staged state dict with DCP in a worker thread; await the
    returned coroutine for DCP's ``Metadata``.

    For callers that hold a lease themselves (``async with stager.snapshot(sd) as
    staged:``), e.g. to send the same staged copy to a writer process as well. The
    caller must keep ``staged`` unchanged (leased) until this returns. The caller's
    CUDA device (which DCP's collectives use) is read at this call, in the calling
    thread.

    Cancellation: deferred until the save's thread has finished, then raised (see
    ``save``); the checkpoint on disk is complete in that case.
    """
    return _save_staged(
        staged,
        cuda_device=_current_cuda_device(),
        checkpoint_id=checkpoint_id,
        storage_writer=storage_writer,
        planner=planner,
        process_group=process_group,
        no_dist=no_dist,
    )


async def _save_staged(staged: dict[str, Any], *, cuda_device: int | None, **kwargs: Any) -> Metadata:
    fn = functools.partial(save_blocking, staged, cuda_device=cuda_device, **kwargs)
    metadata: Metadata = await run_in_thread(fn, name="async-stager-dcp-save")
    return metadata


def _current_cuda_device() -> int | None:
    """The calling thread's CUDA device, if CUDA is in use in this process: its current
    device when that has a context, else the first device that has one (never one
    without: the save thread's ``set_device`` would create a context there)."""
    return caller_cuda_device()
