"""A submitted stage, from the worker's job to the result's owner, and its log records.

A ``StageJob`` is one ``Stager.stage``/``lease`` call: the worker's future, the
cancel event the worker checks, and who owns the result. Exactly one party ends up
owning a finished stage's result: the awaiting coroutine (``take``), or, when that
coroutine was cancelled or dropped first, the job's done-callback, which drops the
result and releases its lease (``abandon``/``done``). Nobody else may keep it: a result
kept reachable holds its buffer set.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any

from async_stager._core.run.engine import Engine
from async_stager._core.run.records import StageRecord
from async_stager._core.stats import METRIC_PREFIX, StageStats

__all__ = ["StageJob", "drop", "drop_result", "job_done", "log_stage_done", "log_stage_end", "logged_run"]

_log = logging.getLogger("async_stager.stage")


class StageJob:
    """One submitted stage. Whoever ends up owning its result must hand it on or drop
    it (releasing its lease, if any): the awaiting coroutine, or, if that was cancelled
    first, the job's done-callback.
    An abandoned job is kept in ``pending`` (owned by the stager) until its future is
    done, so the callback (which holds only a weak reference) still finds it."""

    __slots__ = ("__weakref__", "cancel", "engine", "future", "lock", "pending", "state", "t0")

    def __init__(self, engine: Engine, pending: set[StageJob]) -> None:
        self.engine = engine
        self.pending = pending
        self.cancel = threading.Event()
        self.lock = threading.Lock()
        self.state = "pending"  # -> "taken" | "abandoned" -> "released"
        self.t0 = time.perf_counter()
        self.future: Any = None

    def take(self) -> None:
        with self.lock:
            self.state = "taken"

    def abandon(self) -> None:
        """The waiter went away (cancelled): stop the job, or undo its lease."""
        self.cancel.set()
        with self.lock:
            if self.state != "pending":
                return
            fut = self.future
            if fut is not None and not fut.done():
                self.state = "abandoned"
                self.pending.add(self)
                return
            # Done already: release here, and make sure done() (which may be running
            # right now, callbacks run after the future is marked done) does not.
            self.state = "released"
        drop_result(fut)

    def done(self, fut: Any) -> None:
        with self.lock:
            if self.state != "abandoned":
                return
            self.state = "released"
            self.pending.discard(self)
        drop_result(fut)


def job_done(ref: weakref.ref[StageJob], fut: Any) -> None:
    job = ref()
    if job is not None:
        job.done(fut)


def drop_result(fut: Any) -> None:
    """Nobody will take this finished stage's result: let it go (its buffer set is
    then free for reuse) and release its lease, if any."""
    if fut.cancelled() or fut.exception() is not None:
        return
    drop(fut.result())


def drop(staged: StageRecord) -> None:
    staged.result = None
    if staged.lease is not None:
        staged.lease.release()


def logged_run(engine: Engine, sd: Any, captures: dict[Any, Any], **kwargs: Any) -> StageRecord:
    """The worker's job: the engine's walk-and-enqueue, with its start logged."""
    _log.info("stage started")
    return engine.run(sd, captures, **kwargs)


def log_stage_done(what: str, seconds: float, nbytes: int, hits: int, prefix: str = METRIC_PREFIX) -> None:
    """The INFO record at the end of a stage (``what``: "stage", "stage 3"): its latency
    (seconds), bytes and cache hits, as metrics named under ``prefix``, in the message
    and in the record's ``metrics`` attribute."""
    metrics = {
        f"{prefix}.stage_seconds": seconds,
        f"{prefix}.bytes": nbytes,
        f"{prefix}.cache_hits": hits,
    }
    _log.info(
        "%s done in %.6f s: %d bytes, %d cache hits (%s)",
        what,
        seconds,
        nbytes,
        hits,
        " ".join(f"{k}={v}" for k, v in metrics.items()),
        extra={"metrics": metrics},
    )


def log_stage_end(stats: StageStats) -> None:
    """A Stager's stage-end records: INFO (see ``log_stage_done``), DEBUG details."""
    log_stage_done("stage", stats.seconds, stats.bytes, stats.cache_hits)
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug("stage details: %r", stats)
