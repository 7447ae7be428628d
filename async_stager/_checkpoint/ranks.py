"""The Checkpointer's view of torch.distributed: one process, or ranks on a gloo group.

Every collective here runs in a worker thread (never on the event loop) and only on the
Checkpointer's own gloo group, so training's collectives (NCCL or its own gloo group)
are not interleaved with them. The Checkpointer runs at most one of these sequences at
a time, in the same order on every rank, which is what collectives need.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["Ranks"]


@dataclass(frozen=True)
class Ranks:
    """This process's place: ``world == 1`` and ``group is None`` for one process."""

    rank: int
    world: int
    group: ProcessGroup | None
    distributed: bool

    @classmethod
    def resolve(cls, group: ProcessGroup | None) -> Ranks:
        """The given group, else (in a distributed job) a new gloo group over every rank
        (a collective: every rank constructs its Checkpointer at the same point).

        Hazard: never the default group, even a gloo one: the background writes run
        their collectives in worker threads while training runs its own (FSDP's
        all-gathers) on the default group, and two threads' collectives on one group
        interleave differently on each rank (gloo: "Received data size doesn't match")."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls(rank=0, world=1, group=None, distributed=False)
        if group is None:
            group = dist.new_group(backend="gloo")
        return cls(rank=dist.get_rank(group), world=dist.get_world_size(group), group=group, distributed=True)

    @property
    def coordinator(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on the coordinator (None elsewhere)."""
        if not self.distributed:
            return [obj]
        out: list[Any] | None = [None] * self.world if self.coordinator else None
        dist.gather_object(
            obj, out, dst=dist.get_global_rank(self.group, 0) if self.group else 0, group=self.group
        )
        return out

    def all_gather(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj: Any) -> Any:
        """The coordinator's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        src = dist.get_global_rank(self.group, 0) if self.group else 0
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]
