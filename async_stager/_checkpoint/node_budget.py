"""A Checkpointer's saves at the node budget (``node_budget_bytes``): staged or streamed.

Every rank of a node opens one ledger (``NodeLedger``) through its Checkpointer; the
Checkpointer's own Stager reserves each arena from it, and a streamed save reserves
its ring from it. Before each save stages, ``admit`` (a worker thread) chooses:

- ``"cached"``: a free buffer set of the stager already maps the staged copy's bytes:
  it stages there, reserving nothing new (its bytes stayed counted since).
- ``"staged"``: the new bytes the staged copy needs, plus a *floor* left for the other
  ranks of the node (``floor``), are granted within ``ADMIT_SECONDS`` in the node's
  ticket order; the floor is given back at once and the new bytes are kept as a
  *credit* (``CreditLedger``) that the stager's arena reservations draw from, so no
  other rank can take them between the grant and the stage.
- ``"streamed"``: they are not (or the staged copy is bigger than the whole budget):
  the save streams through the budgeted pipeline (``dcp.save(host_budget_bytes=...)``)
  whose ring takes a share of the node budget (at least the largest tensor, at most
  what fits: what is free split with the ranks of the node that hold nothing yet),
  reserved inside this rank's ``write_data`` and given back at its end.

Why the floor. A staged copy is held until the save's DCP collectives end, and those
wait for every rank. A rank that streams needs at least its largest tensor to get
through its ``write_data``; if staged copies held all the budget, it would wait for
bytes that come back only after it finishes: a cross-rank wait that only its bound
ends. So a rank stages only while it leaves, for each other rank of the node, the
larger of its own largest tensor and a fair share (``budget / ranks``): every other
rank can then always stream (at about the speed a per-process budget would give
it), and a ring is freed at the end of its own rank's write, never waiting on
another rank. So a rank whose staged copy is within its fair share stages (and keeps
its cached set); a bigger one streams, with the bytes the small ones leave. (The
other ranks' largest tensors are taken to be comparable to this rank's: a rank with
much bigger tensors than the others should set a larger budget; its wait is bounded
either way.)

A budget smaller than the largest single tensor is refused at ``save()``
(BudgetTooSmallError naming the tensor and both sizes).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from async_stager._core.aio.stager import stager_internals
from async_stager._core.aio.threads import run_in_thread
from async_stager._core.memory.arena import MIN_ARENA_BYTES, align
from async_stager._core.memory.ledger import NodeLedger, Reservation
from async_stager.errors import BudgetTooSmallError, NodeBudgetError

_log = logging.getLogger("async_stager.checkpoint")

if TYPE_CHECKING:
    from async_stager._core.aio.stager import Stager

__all__ = [
    "ADMIT_SECONDS",
    "Admission",
    "CreditLedger",
    "admit",
    "check_largest",
    "ranks_on_node",
    "yield_idle",
]

#: Seconds a save waits (in the node's ticket order) for the bytes of a staged copy
#: before it streams instead: short, because streaming is always possible.
ADMIT_SECONDS = 0.2
#: The smallest share a streamed save's ring is given (bytes): room for the pickled
#: non-tensor values' pieces besides the largest tensor.
MIN_SHARE = 64 * 1024

Path = Literal["cached", "staged", "streamed"]


@dataclass(frozen=True)
class Admission:
    """How one save met the node budget: ``path`` (``"cached"``, ``"staged"`` or
    ``"streamed"``), ``waited`` seconds in the node's ticket order, ``need`` the bytes
    a staged copy would map anew, and ``why`` (for the log)."""

    path: Path
    waited: float
    need: int
    why: str


class CreditLedger(NodeLedger):
    """A NodeLedger with a per-process *credit*: bytes already granted by the node
    (they stay in this process's slot) that the next reservations of this handle draw
    from before they ask the node. ``admit`` grants a staged copy's bytes and hands
    them on to the stager's arena reservations this way; ``drop_credit`` gives back
    what was not drawn. Thread-safe (its own lock)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._credit = 0
        self._credit_lock = threading.Lock()
        #: The last admission waited its bound in vain (``admit``).
        self.gave_up = False

    @classmethod
    def open(
        cls, budget_bytes: int, *, path: str | os.PathLike[str] | None = None, job: str | None = None
    ) -> CreditLedger:
        ledger = super().open(budget_bytes, path=path, job=job)
        assert isinstance(ledger, CreditLedger)
        return ledger

    def add_credit(self, reservation: Reservation) -> None:
        """``reservation``'s bytes become credit (it no longer releases them)."""
        if reservation.released:
            return
        with self._credit_lock:
            self._credit += reservation.nbytes
        reservation._ledger = None  # the credit owns its bytes now

    def drop_credit(self) -> int:
        """Give back the credit not drawn; returns its bytes."""
        with self._credit_lock:
            n, self._credit = self._credit, 0
        if n:
            self._give_back(n)
        return n

    @property
    def credit(self) -> int:
        return self._credit

    def _draw(self, nbytes: int) -> int:
        with self._credit_lock:
            take = min(nbytes, self._credit)
            self._credit -= take
        return take

    def _undraw(self, n: int) -> None:
        with self._credit_lock:
            self._credit += n

    def _whole(self, got: Reservation | None, nbytes: int, what: str, take: int) -> Reservation:
        if got is not None:
            got._ledger = None  # folded into one reservation of the whole
        return Reservation(self, nbytes, what)

    def try_reserve(self, nbytes: int, what: str = "host memory") -> Reservation | None:
        self._check_request(nbytes, what)
        take = self._draw(nbytes)
        if take == nbytes:
            return Reservation(self, nbytes, what)
        got = super().try_reserve(nbytes - take, what)
        if got is None:
            self._undraw(take)
            return None
        return self._whole(got, nbytes, what, take)

    def reserve(
        self,
        nbytes: int,
        *,
        timeout: float | None,
        what: str = "host memory",
        stop: Callable[[], None] | None = None,
    ) -> Reservation:
        self._check_request(nbytes, what)
        take = self._draw(nbytes)
        if take == nbytes:
            return Reservation(self, nbytes, what)
        try:
            got = super().reserve(nbytes - take, timeout=timeout, what=what, stop=stop)
        except BaseException:
            self._undraw(take)
            raise
        return self._whole(got, nbytes, what, take)


def _tensors(value: Any, out: list[torch.Tensor], depth: int = 0) -> None:
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif depth < 64 and isinstance(value, dict):
        for v in value.values():
            _tensors(v, out, depth + 1)
    elif depth < 64 and isinstance(value, (list, tuple)):
        for v in value:
            _tensors(v, out, depth + 1)


def staged_bytes(sd: Any) -> int:
    """About the host bytes a first stage of ``sd`` maps (one arena: every distinct
    storage's bytes, each block aligned, at least ``MIN_ARENA_BYTES``). An estimate:
    what the stager maps beyond it is reserved by the stager itself, bounded."""
    from torch.distributed.tensor import DTensor

    ts: list[torch.Tensor] = []
    _tensors(sd, ts)
    seen: set[int] = set()
    total = 0
    for t in ts:
        if isinstance(t, DTensor):
            t = t.to_local()  # what this rank stages: its local shard
        if t.device.type == "meta":
            continue
        try:
            st = t.untyped_storage()
            key = st.data_ptr() or id(st)
            n = st.nbytes()
        except Exception:  # noqa: BLE001 - a wrapper subclass without a real storage
            total += align(t.numel() * t.element_size())
            continue
        if key in seen:
            continue
        seen.add(key)
        total += align(n)
    return max(total, MIN_ARENA_BYTES) if total else 0


def check_largest(sd: dict[str, Any], budget: int) -> int:
    """Refuse at ``save()`` a state whose largest tensor item is bigger than the whole
    node budget (BudgetTooSmallError naming it and both sizes); returns its bytes."""
    from async_stager._dcp.budget import largest_tensor

    path, need = largest_tensor(sd)
    if need > budget:
        raise BudgetTooSmallError(
            f"this tensor takes {need} bytes of host memory, more than the whole node budget "
            f"(node_budget_bytes={budget}) that the ranks of this machine share: no save of it "
            f"can ever fit; pass node_budget_bytes >= {need} (every rank the same)",
            path=path,
            needed_bytes=need,
        )
    return need


def ranks_on_node(ledger: NodeLedger) -> int:
    """How many ranks share the ledger (``_dcp.budget.node_ranks``)."""
    from async_stager._dcp.budget import node_ranks

    return node_ranks(ledger.path)


def admit(ledger: CreditLedger, stager: Stager, sd: dict[str, Any], largest: int) -> Admission:
    """Blocking (a worker thread): choose how a save meets the node budget (module
    doc). ``largest``: its largest tensor item's bytes (``check_largest``). On
    ``"staged"`` the new bytes are this ledger's credit until the stage draws them;
    the caller drops what is left (``drop_credit``) once the stage ended."""
    need = staged_bytes(sd)
    new = max(0, need - stager_internals(stager).reusable_bytes)
    if new == 0:
        return Admission("cached" if need else "staged", 0.0, 0, "a cached buffer set holds the staged copy")
    n = ranks_on_node(ledger)
    floor = (n - 1) * max(largest, MIN_SHARE, ledger.budget // n)
    if new + floor > ledger.budget:
        return Admission(
            "streamed",
            0.0,
            new,
            f"a staged copy ({new} new bytes) and the other ranks' floor ({floor}) exceed the node "
            f"budget ({ledger.budget})",
        )
    what = f"a staged checkpoint copy (pid {os.getpid()})"
    t0 = time.monotonic()
    # After a save that waited its whole bound in vain, the next ones only look (no
    # wait) until one is granted: a rank whose share is taken by the others' cached
    # sets would otherwise pay the bound at every save.
    bound = 0.0 if ledger.gave_up else ADMIT_SECONDS
    got = ledger.try_reserve(new + floor, what)
    if got is None and bound > 0:
        try:
            got = ledger.reserve(new + floor, timeout=bound, what=what)
        except NodeBudgetError:
            got = None
    if got is None:
        ledger.gave_up = True
        return Admission(
            "streamed",
            time.monotonic() - t0,
            new,
            f"the node budget could not grant {new + floor} bytes ({new} for the staged copy, {floor} "
            f"left for the other ranks) within {bound:g} s",
        )
    ledger.gave_up = False
    waited = time.monotonic() - t0
    # Granted whole; the floor goes back at once (it only proved that the others keep
    # room to stream), the staged copy's bytes stay as credit for the stage.
    floor_part = Reservation(ledger, floor, what)
    staged = Reservation(ledger, new, what)
    got._ledger = None
    floor_part.release()
    ledger.add_credit(staged)
    return Admission("staged", waited, new, "granted")


async def yield_idle(stager: Stager, ledger: NodeLedger) -> None:
    """A staged copy was handed back: if another process of the node waits for the
    budget, give back the stager's idle buffer sets (``trim``) instead of keeping them
    cached, so one rank's cache never makes another wait out its bound. Cancellation:
    as ``Stager.trim``."""
    if ledger.held == 0:
        return
    me = os.getpid()
    usage = await run_in_thread(ledger.usage, name="async-stager-ledger")
    if any(t.pid != me for t in usage.waiting):
        released = await stager.trim()
        if released:
            _log.info(
                "gave back %d bytes of idle staging memory: another rank waits for the node budget", released
            )
