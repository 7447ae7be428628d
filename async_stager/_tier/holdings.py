"""What the node agent holds: one snapshot of one rank (``Held``: begun, or committed
and verified) and the arenas it uses (``Arena``: the agent's own descriptor, shared by
the snapshots that use it and closed by the agent once none does).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from async_stager._tier import sealing

__all__ = ["Arena", "Held"]


@dataclass(eq=False)
class Arena:
    """One arena held: the agent's descriptor, its bytes, and the snapshots using it."""

    fd: int
    nbytes: int
    key: tuple[int, int]
    users: int = 0


@dataclass(eq=False)
class Held:
    """One snapshot of one rank: begun (``complete`` False: never handed out) or
    committed and verified."""

    rank: int
    step: int
    world: int
    complete: bool = False
    arenas: list[Arena] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    payload: bytes = b""
    since: float = field(default_factory=time.time)
    #: The trainer process (its session token) that began it.
    session: str = ""
    #: Its namespace: the Checkpointer's folder (two in one job never mix).
    ns: str = ""
    #: The job's run it belongs to (the ranks agree on one at start and at each
    #: restore): a restore never mixes two runs' snapshots of one step.
    timeline: str = ""
    #: Sealed and verified after the seal (``sealing``), or not yet.
    seal: sealing.SealState = field(default_factory=sealing.SealState)

    @property
    def bytes(self) -> int:
        return sum(a.nbytes for a in self.arenas)

    def info(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "ns": self.ns,
            "step": self.step,
            "world": self.world,
            "complete": self.complete,
            "timeline": self.timeline,
            "bytes": self.bytes,
            "tensors": int(self.meta.get("tensors", 0)),
            "since": self.since,
        }
