"""The node budget's first step (``node_budget_bytes``): before a save stages, the node
decides how it meets the budget (``node_budget.admit``, in a worker thread: it may wait
up to ``ADMIT_SECONDS`` in the node's ticket order), and the save goes on along the
route that decision names: the staged route (``"cached"``, ``"staged"``: the granted
bytes are the ledger's credit for its stage) or the streamed route (``"streamed"``,
after this rank's idle staging memory was given back for its share).

``DEFERRED`` (waits for a buffer set: its admission counts as a holder) -> the
decision -> ``item.route`` is the chosen route, still ``DEFERRED``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from async_stager._checkpoint.node_budget import admit
from async_stager._checkpoint.routes.disk import DiskContext, DiskRoute
from async_stager._checkpoint.routes.staged import StagedRoute
from async_stager._checkpoint.routes.streamed import StreamedRoute
from async_stager._core.aio.threads import run_in_thread

if TYPE_CHECKING:
    import anyio.abc

    from async_stager._checkpoint.item import Lane, Route, SaveItem
    from async_stager._checkpoint.options import SaveStats

__all__ = ["AdmissionRoute"]

_log = logging.getLogger("async_stager.checkpoint")


class AdmissionRoute(DiskRoute):
    """A save at the node budget before its admission decided its route. ``largest``:
    its largest tensor item's bytes (checked at ``save()``)."""

    def __init__(self, sd: dict[str, Any], point: Any, ctx: DiskContext, largest: int) -> None:
        super().__init__(sd, point, ctx)
        assert ctx.ledger is not None
        self.largest = largest
        #: Its admission is being decided (it counts as a buffer set's holder meanwhile).
        self.admitting = False

    def holds_set(self, item: SaveItem) -> bool:
        return self.admitting

    def wants_set(self, item: SaveItem) -> bool:
        return not self.admitting and self.sd is not None

    def take_set(self, item: SaveItem, lane: Lane, tg: anyio.abc.TaskGroup) -> None:
        self.admitting = True
        tg.start_soon(self._admit, item, lane)

    async def _admit(self, item: SaveItem, lane: Lane) -> None:
        """Decide, log (INFO on ``async_stager.checkpoint`` when it waited or streams),
        then hand the save to its route and move on; a failure ends it (raised to its
        caller); a save given up meanwhile (a coroutine dropped unawaited, a caller
        cancelled) is not saved. Cancellation: deferred until the thread returns (it is
        bounded)."""
        ctx, sd = self.ctx, self.sd
        ledger = ctx.ledger
        assert ledger is not None
        try:
            if sd is None or item.ended:
                return
            try:
                adm = await run_in_thread(
                    functools.partial(admit, ledger, ctx.stager, sd, self.largest), name="async-stager-admit"
                )
            except Exception as exc:  # noqa: BLE001 - raised to the save's caller
                item.error = exc
                lane.end(item)
                return
            if item.ended or item.cancelled:
                ledger.drop_credit()
                return
            if adm.path == "streamed" or adm.waited >= 0.01:
                _log.info(
                    "checkpoint step %d: %s after %.3f s at the node budget (%d bytes): %s",
                    item.step,
                    adm.path,
                    adm.waited,
                    ledger.budget,
                    adm.why,
                )
            route: Route
            if adm.path == "streamed":
                released = await ctx.stager.trim()
                if released:
                    _log.info(
                        "checkpoint step %d: gave back %d idle staging bytes to stream", item.step, released
                    )
                if item.ended:
                    return
                route = StreamedRoute(sd, self.point, ctx, admission=adm.path, node_wait=adm.waited)
            else:
                route = StagedRoute(sd, self.point, ctx, admission=adm.path, node_wait=adm.waited)
            self.sd = None
            item.route = route
        finally:
            self.admitting = False
        lane.advance()
        lane.notify()

    # -- no write, no return before the decision --------------------------------------

    def writable(self, item: SaveItem, *, in_thread: bool = False) -> bool:
        return False

    def start_write(self, item: SaveItem, then: Callable[[], None]) -> NoReturn:
        raise AssertionError("a save is admitted before it writes")

    async def wait_write(self, item: SaveItem, lane: Lane) -> SaveStats:
        raise AssertionError("a save is admitted before it writes")

    def returns(self, item: SaveItem, *, coalesce: bool) -> bool:
        return False
