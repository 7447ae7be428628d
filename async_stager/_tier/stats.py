"""What the memory tier reports: its counts (``MemoryStats``, public as
``Checkpointer.memory``) and the snapshot in flight (``TierProgress``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MemoryStats", "TierProgress"]


@dataclass(frozen=True)
class MemoryStats:
    """The memory tier's counts and its newest snapshot, seconds and bytes.

    ``saved``: snapshots the agent accepted; ``skipped``: saves dropped by
    ``"skip"`` (the previous snapshot was still committing) or while the agent was
    away; ``refused``: snapshots the agent did not accept; ``failures``: times the
    agent was found gone or too slow. ``last_step``, ``stage_seconds`` (what the newest
    save blocked its caller for: BEGIN and stage), ``commit_seconds`` (its hashing and
    the agent's verification, in the background), ``bytes`` (its tensor bytes);
    ``available``: the tier is on (False after a failure, until its retry);
    ``restored``: the step the last ``Checkpointer.restore`` took from memory (None: none
    did); ``restored_from_peer``: it came from the replica on another node's agent;
    ``restored_sealed``: whether that restore trusted the agent's verification after
    sealing the snapshot (True: not read again, one copy into the state) or verified
    every byte itself (False).

    Replication (``replicate=True``): ``replica_peer`` (the rank whose node's agent
    holds this rank's replicas; None: none), ``replicated`` (snapshots the peer's agent
    verified and holds), ``replica_step`` (the newest of them), ``replica_skipped``
    (not held because the peer's agent reached its memory bound), ``replica_failures``
    (the peer's agent away or refusing, or the peer gone), ``replica_seconds`` (the
    newest replica's transfer, paced, until verified) and
    ``replica_link_bytes_per_second`` (its bytes over the seconds spent sending them:
    the link's measured rate, before pacing)."""

    saved: int = 0
    skipped: int = 0
    refused: int = 0
    failures: int = 0
    last_step: int | None = None
    stage_seconds: float = 0.0
    commit_seconds: float = 0.0
    bytes: int = 0
    available: bool = True
    restored: int | None = None
    restored_from_peer: bool = False
    replica_peer: int | None = None
    replicated: int = 0
    replica_step: int | None = None
    replica_skipped: int = 0
    replica_failures: int = 0
    replica_seconds: float = 0.0
    replica_link_bytes_per_second: float = 0.0
    restored_sealed: bool | None = None


@dataclass(frozen=True)
class TierProgress:
    """A memory snapshot in flight: its step, phase (``"memory-staging"``,
    ``"memory-committing"`` or ``"memory-replicating"``: sent to the peer node), seconds since its save was called, and the stage's
    seconds (None while staging)."""

    step: int
    phase: str
    seconds: float
    staged_seconds: float | None
