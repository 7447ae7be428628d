"""What the routes to the folder share: their context (``DiskContext``) and base class.

A save to the folder travels the staged route (``staged``: a lease on a buffer set,
then the write through the format) or the streamed route (``streamed``: the budgeted
pipeline), possibly after the node budget's admission (``node``) chose one of them.
Each writes in a daemon thread of its own through the ``Writer``'s common steps
(its folder, the ranks' check, the commit, the stats).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from async_stager._checkpoint.item import Route

if TYPE_CHECKING:
    from async_stager._checkpoint.item import SaveItem
    from async_stager._checkpoint.node_budget import CreditLedger
    from async_stager._checkpoint.options import CheckpointerOptions
    from async_stager._checkpoint.ranks import Ranks
    from async_stager._checkpoint.write import Writer
    from async_stager._core.aio.stager import Stager

__all__ = ["DiskContext", "DiskRoute"]


@dataclass(frozen=True)
class DiskContext:
    """What every route to the folder of one open Checkpointer uses: its options, ranks,
    writer, stager and node budget's ledger (None without ``node_budget_bytes``)."""

    options: CheckpointerOptions
    ranks: Ranks
    writer: Writer
    stager: Stager
    ledger: CreditLedger | None = None


class DiskRoute(Route):
    """A save to the folder: its resolved state until its stage or pipeline takes it
    (``sd``), and its snapshot point, taken at the ``save`` call on the caller's streams
    (``StagerInternals.snapshot_point``): a deferred save stages from it, whenever it stages."""

    def __init__(self, sd: dict[str, Any], point: Any, ctx: DiskContext) -> None:
        super().__init__()
        self.sd: dict[str, Any] | None = sd
        self.point = point
        self.ctx = ctx

    def release(self) -> None:
        self.sd = None

    async def discard(self, item: SaveItem) -> None:
        await self.ctx.writer.discard(item)
