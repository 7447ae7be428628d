"""A budgeted save's figures (``BudgetStats``) and the share of a node budget its ring
takes (``reserve_share``).

With a node budget (``node_budget_bytes``, a ``NodeLedger`` the ranks of a machine
share), a budgeted save's ring is reserved from the ledger before it is allocated or
pinned, inside this rank's DCP ``write_data``, and given back at its end (before DCP's
last collectives): a rank waiting for its share waits only for other rings, each of
which ends with its own rank's write, never for a rank that waits for it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from async_stager._core.memory.ring import ALIGN
from async_stager.errors import BudgetTooSmallError

if TYPE_CHECKING:
    from async_stager._core.memory.ledger import NodeLedger, Reservation

__all__ = ["BudgetStats", "node_ranks", "reserve_share"]


@dataclass(frozen=True)
class BudgetStats:
    """What one budgeted save did (``dcp.save(..., on_budget_stats=...)``).

    Bytes: ``budget_bytes`` (asked), ``arena_bytes`` (allocated: the budget, or less
    when the state needs less), ``peak_bytes`` (most ring bytes held at once, padding
    included), ``tensor_bytes`` (tensor items copied), ``object_bytes`` (the serialized
    non-tensor values, DCP's bytes items, tensors inside them included: streamed
    through the ring too). ``pieces``: tensor items. Seconds: ``blocked_seconds`` (the
    copier waiting for ring space: how much longer the sources had to stay unchanged
    because of the budget), ``writer_wait_seconds`` (the writer waiting for a copy),
    ``fence_seconds`` (from the call until the last copy was enqueued: when ``fence()``
    may return), ``total_seconds`` (until the save returned).

    With a node budget (``node_budget_bytes``): ``arena_bytes`` is the share of it the
    ring was granted (at least the largest tensor item, at most what the state needs),
    and ``node_wait_seconds`` the seconds the save waited for that share in the node's
    ticket order (0.0 without a node budget, or when it was granted at once).
    """

    budget_bytes: int
    arena_bytes: int
    peak_bytes: int
    pieces: int
    tensor_bytes: int
    object_bytes: int
    blocked_seconds: float
    writer_wait_seconds: float
    fence_seconds: float
    total_seconds: float
    node_wait_seconds: float = 0.0


def node_ranks(ledger_path: str) -> int:
    """How many ranks share a node ledger: ``LOCAL_WORLD_SIZE`` (torchrun sets it) when
    set, else the slots open in the ledger's directory now (at least 1)."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit() and int(local) > 0:
        return int(local)
    try:
        slots = sum(1 for f in os.listdir(ledger_path) if f.startswith("slot-") and not f.endswith(".new"))
    except OSError:
        slots = 1
    return max(1, slots)


def reserve_share(
    ledger: NodeLedger,
    need: int,
    capacity: int,
    *,
    timeout: float | None,
    stop: Callable[[], None] | None = None,
    path: tuple[Any, ...] | None = None,
) -> tuple[Reservation, float]:
    """Reserve a ring's bytes from ``ledger`` (blocking: the writer thread) and return
    the reservation and the seconds waited. Its size: ``capacity`` (what the state
    needs, at most the budget) or a fair share of what the node has free now (split
    with every other rank of the node holding nothing yet, each of which may need a
    ring too), whichever is less, but at least ``need`` (the largest piece); a multiple
    of ``ALIGN``. Granted at once when free, else waited for in the node's ticket order
    at most ``timeout`` seconds (NodeBudgetError after); ``stop`` may raise to end the
    wait. BudgetTooSmallError at once when ``need`` is more than the whole budget,
    naming ``path`` (the largest piece's tensor in the state dict) and the option."""
    what = f"the ring of a budgeted DCP save (pid {os.getpid()})"
    if need > ledger.budget:
        raise BudgetTooSmallError(
            f"this tensor takes {need} bytes of host memory, more than the whole node budget "
            f"(node_budget_bytes={ledger.budget}); pass node_budget_bytes >= {need}",
            path=path,
            needed_bytes=need,
        )
    usage = ledger.usage()
    me = os.getpid()
    idle = max(0, node_ranks(ledger.path) - 1 - len([p for p in usage.by_pid if p != me]))
    fair = usage.free // (1 + idle) // ALIGN * ALIGN
    got = ledger.try_reserve(max(need, min(capacity, fair)), what)
    if got is not None:
        return got, 0.0
    free = ledger.usage().free // ALIGN * ALIGN
    share = max(need, min(capacity, fair, free))
    t0 = time.perf_counter()
    got = ledger.reserve(share, timeout=timeout, what=what, stop=stop)
    return got, time.perf_counter() - t0
