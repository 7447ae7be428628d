"""PyTorch Distributed Checkpoint (DCP) with async_stager: stage-then-save
(``save``, ``save_staged``, the budgeted pipeline's ``BudgetStats``) and the seed's
staging interface (``DefaultStager``, ``CheckpointStager``, ``CheckpointStagerConfig``).

The code lives in ``async_stager._dcp``; this module is its public face. ``save`` here
is ``_dcp.save.save`` with the node budget's options (``node_budget_bytes`` and the
ledger's whereabouts): a save within one host-memory budget that the ranks of a
machine share.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from async_stager._dcp import save as _save
from async_stager._dcp.budget import BudgetStats
from async_stager._dcp.default_stager import DefaultStager
from async_stager._dcp.interface import CheckpointStager, CheckpointStagerConfig
from async_stager._dcp.save import save_staged
from async_stager.errors import InvalidOptionError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import SavePlanner
    from torch.distributed.checkpoint.storage import StorageWriter

    from async_stager._core.aio.stager import Stager
    from async_stager._core.memory.ledger import NodeLedger

__all__ = [
    "BudgetStats",
    "CheckpointStager",
    "CheckpointStagerConfig",
    "DefaultStager",
    "save",
    "save_staged",
]


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
    the returned coroutine (or run it as a task) for DCP's ``Metadata``. Everything but
    the node budget is ``async_stager._dcp.save.save`` (its docstring, and
    docs/api.md, have the snapshot point, cancellation and ``host_budget_bytes``).

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
    if node_ledger is not None and node_budget_bytes not in (None, node_ledger.budget):
        raise InvalidOptionError(
            f"node_budget_bytes={node_budget_bytes} differs from the budget of the node ledger given "
            f"({node_ledger.budget}); pass one of them"
        )
    if node_ledger is None and node_budget_bytes is None:
        if node_budget_path is not None or node_budget_job is not None:
            raise InvalidOptionError("node_budget_path and node_budget_job need node_budget_bytes")
        return _save.save(
            state_dict,
            stager=stager,
            checkpoint_id=checkpoint_id,
            storage_writer=storage_writer,
            planner=planner,
            process_group=process_group,
            no_dist=no_dist,
            host_budget_bytes=host_budget_bytes,
            on_budget_stats=on_budget_stats,
        )
    from async_stager._core.memory.ledger import NodeLedger
    from async_stager._dcp.budget_save import budgeted_save

    owns = node_ledger is None
    ledger = node_ledger
    if ledger is None:
        assert node_budget_bytes is not None
        ledger = NodeLedger.open(node_budget_bytes, path=node_budget_path, job=node_budget_job)
    return budgeted_save(
        state_dict,
        stager=stager,
        budget=host_budget_bytes if host_budget_bytes is not None else ledger.budget,
        checkpoint_id=checkpoint_id,
        storage_writer=storage_writer,
        planner=planner,
        process_group=process_group,
        no_dist=no_dist,
        on_stats=on_budget_stats,
        ledger=ledger,
        owns_ledger=owns,
    )
