"""Per-stage statistics, a frozen record handed to users and to the benchmark."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["METRIC_PREFIX", "StageStats"]

#: The default prefix of the metric names in the stage log records
#: (``<prefix>.stage_seconds``, ``.bytes``, ``.cache_hits``).
METRIC_PREFIX = "async_stager"


@dataclass(frozen=True)
class StageStats:
    """What one stage did.

    Sizes are bytes, times are seconds. ``seconds`` runs from the call to the result;
    ``worker_seconds`` is the part spent in the worker thread (walk, cache, enqueue and,
    on the CPU, the copies); ``wait_seconds`` is the part spent polling the completion
    event from the event loop. ``fast_path``: the last plan was reused as it was (the
    same tensors, or new ones of its layout that took its memory over), no new plan
    made; its storages then count as cache hits. ``buffer_set``: the index of the
    buffer set the result lives in; -1 for a stage that copied no tensor (it takes no
    set, so it never waits for one).
    """

    tensors: int
    storages: int
    bytes: int
    cache_hits: int
    cache_misses: int
    fast_path: bool
    buffer_set: int
    host_bytes: int
    seconds: float
    worker_seconds: float
    wait_seconds: float
    polls: int

    @property
    def bytes_per_second(self) -> float:
        """Staged bytes over wall seconds (0.0 when nothing took measurable time)."""
        return self.bytes / self.seconds if self.seconds > 0 else 0.0
