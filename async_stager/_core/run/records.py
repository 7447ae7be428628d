"""What a stage hands between its halves: the snapshot point taken on the caller's
thread at the call (``Captures``), the worker's result and what is still in flight
(``StageRecord``), and a job cancelled before its copies were enqueued (``Cancelled``).
Below the engine and the jobs, which both use them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from async_stager._core.checksum.digest import Checksums
from async_stager._core.copy.device import Completion
from async_stager._core.memory.buffer_sets import BufferSet
from async_stager._core.memory.lease import Lease
from async_stager._core.plan.layout import Plan
from async_stager._core.walk.objects import GeneratorStates
from async_stager._core.walk.tree import Interrupt

__all__ = ["Cancelled", "Captures", "StageRecord"]


class Cancelled(Interrupt):
    """Internal: the job was cancelled before its copies were enqueued."""


class Captures(dict[torch.device, Any]):
    """What ``Engine.capture`` takes at the call: per device, the copier's capture
    (the snapshot point on the caller's stream); ``generators``: generator states taken
    at the call (``generator_states``), which the walk rebuilds them from."""

    __slots__ = ("generators",)

    def __init__(self, points: dict[torch.device, Any], generators: GeneratorStates) -> None:
        super().__init__(points)
        self.generators = generators


@dataclass(eq=False)
class StageRecord:
    """The worker's half of a stage: the result and what is still in flight."""

    #: The staged structure; whoever hands it on sets this to None, so the stager
    #: itself never keeps a result reachable (which would hold its buffer set).
    result: Any
    #: The set the result lives in; None for a stage that copied no tensor (it took no
    #: set: nothing of its result is host memory of the stager).
    bufset: BufferSet[Plan] | None
    completions: list[Completion]
    #: The hold on ``bufset`` when the stage was leased (released exactly once).
    lease: Lease[Any] | None
    tensors: int
    storages: int
    nbytes: int
    hits: int
    misses: int
    fast_path: bool
    worker_seconds: float
    devices: list[torch.device]
    #: The digests the copy threads computed (a stage asked for checksums), else None.
    checksums: Checksums | None = None
