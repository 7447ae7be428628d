"""The routes a Checkpointer's save travels, one module each, and ``Routes``: which
route a save of this Checkpointer takes (the schedule's part that the options decide).

- ``staged``: a lease on a buffer set, then the write through the format.
- ``streamed``: the budgeted pipeline (``host_budget_bytes``, or a node budget that
  could not hold a staged copy).
- ``node``: the node budget's admission, which hands the save to one of the two.

The queue (``saves``) orders the saves and applies the policy through the ``Route``
interface (``item``); it never asks which route a save takes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from async_stager._checkpoint.node_budget import check_largest
from async_stager._checkpoint.routes.disk import DiskContext
from async_stager._checkpoint.routes.node import AdmissionRoute
from async_stager._checkpoint.routes.staged import StagedRoute
from async_stager._checkpoint.routes.streamed import StreamedRoute
from async_stager._core.aio.stager import stager_internals

if TYPE_CHECKING:
    from async_stager._checkpoint.formats import CheckpointFormat
    from async_stager._checkpoint.item import Route

__all__ = ["DiskContext", "Routes"]


class Routes:
    """The route of each save to the folder of one open Checkpointer: streamed with
    ``host_budget_bytes``, admitted by the node budget with ``node_budget_bytes``, else
    staged."""

    def __init__(self, fmt: CheckpointFormat) -> None:
        self.format = fmt
        self._ctx: DiskContext | None = None

    def open(self, ctx: DiskContext) -> None:
        """With the Checkpointer: what its routes use while it is open."""
        self._ctx = ctx

    @property
    def ctx(self) -> DiskContext:
        assert self._ctx is not None, "Routes.open first"
        return self._ctx

    def check(self, sd: dict[str, Any]) -> int:
        """Refuse at ``save()`` what no route can save: a value the format cannot
        restore, a tensor bigger than the whole node budget. Returns the largest tensor
        item's bytes (0 when no node budget asks for it)."""
        self.format.check_savable(sd)
        node = self.ctx.options.node_budget_bytes
        return check_largest(sd, node) if node is not None else 0

    def disk(self, sd: dict[str, Any], largest: int = 0) -> Route:
        """The route of a save of ``sd`` to the folder; its snapshot point is taken now,
        on the caller's current streams, whenever the policy lets it stage (a deferred
        save stages from it later)."""
        ctx = self.ctx
        point = stager_internals(ctx.stager).snapshot_point(sd)
        if ctx.options.host_budget_bytes is not None:
            admission = "streamed" if ctx.ledger is not None else None
            return StreamedRoute(sd, point, ctx, admission=admission)
        if ctx.ledger is not None:
            return AdmissionRoute(sd, point, ctx, largest)
        return StagedRoute(sd, point, ctx)
