"""The Checkpointer's memory tier (``agent=``): which saves go where, restore from memory.

With ``Checkpointer(dir, agent=JOB, memory_every=M, persist_every=P)`` a save of a
step that is a multiple of ``M`` is a memory snapshot handed to the node agent (the
memory route, ``routes/memory``, through ``_tier.MemoryTier``: it costs the caller the
stage only), a multiple of ``P`` is also written to the folder as without an agent,
and any other step is not saved (``TierSchedule``; ``routes.Schedule`` plans the ways
of a step from it). Without an agent every save goes to the folder, as always.

Where the ranks meet: with several ranks the tier gets a gloo group of its own (made
at construction, a collective like the Checkpointer's own group) for its exchanges of
what each rank holds (``_tier.retention``: no rank lets go of a step before every rank
holds a newer one), and the ranks agree on the run's timeline there.

Restore takes the newest step (of one run: step and timeline) that every rank holds
complete in memory, at this world size, unless the folder's newest commit is a later
step; every rank loads it from its agent and verifies every byte; if any rank cannot
(agent gone, a checksum, a state that does not match), the next older common step is
tried, and then every rank restores from the folder. Never a step assembled from memory
on some ranks and disk on others, nor from two runs.
"""

from __future__ import annotations

import functools
import logging
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from async_stager._checkpoint import commit as _commit
from async_stager._checkpoint.ranks import Ranks
from async_stager._checkpoint.statefuls import apply_loaded, check_matches, resolve
from async_stager._core.aio.threads import run_in_thread
from async_stager.errors import InvalidOptionError, StagingError

if TYPE_CHECKING:
    from async_stager._share.handoff import AttachedStateDict
    from async_stager._tier.client import AgentClient
    from async_stager._tier.tier import MemoryTier

__all__ = ["TierSchedule", "make_tier", "restore"]

_log = logging.getLogger("async_stager.checkpoint")


@dataclass(frozen=True)
class TierSchedule:
    """Steps that are memory snapshots (multiples of ``memory_every``) and steps also
    written to the folder (multiples of ``persist_every``)."""

    memory_every: int = 1
    persist_every: int = 1

    def __post_init__(self) -> None:
        for name in ("memory_every", "persist_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidOptionError(f"{name} must be an int >= 1 (steps), got {v!r}")

    def route(self, step: int) -> tuple[bool, bool]:
        """(to memory, to the folder) for ``step``."""
        return step % self.memory_every == 0, step % self.persist_every == 0


def make_tier(
    agent: str | AgentClient | None,
    *,
    memory_every: int,
    persist_every: int,
    policy: str,
    ranks: Ranks,
    agent_timeout: float,
    keep: int = 2,
    namespace: str = "",
) -> tuple[MemoryTier | None, TierSchedule]:
    """The memory tier for ``agent`` (a job id, or a client), or None without one
    (then ``memory_every`` and ``persist_every`` must be left at 1)."""
    schedule = TierSchedule(memory_every, persist_every)
    if agent is None:
        if schedule != TierSchedule():
            raise InvalidOptionError(
                "memory_every and persist_every need agent=JOB (the memory tier's node agent: "
                "`python -m async_stager agent --job JOB`)"
            )
        return None, schedule
    from async_stager._tier.client import AgentClient
    from async_stager._tier.tier import MemoryTier

    if policy not in ("wait", "skip"):
        raise InvalidOptionError(
            f"a Checkpointer with an agent takes policy 'wait' or 'skip', got {policy!r}"
        )
    client = AgentClient(agent, timeout=agent_timeout) if isinstance(agent, str) else agent
    if not isinstance(client, AgentClient):
        raise InvalidOptionError(
            f"agent must be a job id (str) or an AgentClient, got {type(agent).__name__}"
        )
    agree, timeline = None, None
    if ranks.distributed:
        own = _own_group(ranks)
        agree = own.all_gather
        timeline = str(own.broadcast(uuid.uuid4().hex[:12]))
    tier = MemoryTier(
        client,
        rank=ranks.rank,
        world=ranks.world,
        policy="wait" if policy == "wait" else "skip",
        keep=keep,
        namespace=namespace,
        agree=agree,
        timeline=timeline,
    )
    return tier, schedule


def _own_group(ranks: Ranks) -> Ranks:
    """A gloo group over the same ranks, for the tier's exchanges alone: they run in
    a thread whenever a snapshot ends, and collectives of two threads on one group
    would interleave differently on each rank (the Checkpointer's writes use its own).
    A collective: every rank calls it (at construction)."""
    import torch.distributed as dist

    members = dist.get_process_group_ranks(ranks.group) if ranks.group is not None else None
    whole = members is None or len(members) == dist.get_world_size()
    # A group of part of the job is made by its members alone.
    group = dist.new_group(ranks=members, backend="gloo", use_local_synchronization=not whole)
    return Ranks(rank=ranks.rank, world=ranks.world, group=group, distributed=True)


async def restore(
    tier: MemoryTier, ranks: Ranks, root: Path, state: dict[str, Any], step: int | None
) -> int | None:
    """Restore from the agents if every rank can (see the module doc); the step, or
    None (then restore from the folder). Every rank calls it. Cancellation: deferred
    while a collective runs; ``state`` is changed only once every rank verified."""
    tier.restarting()
    mine = await tier.complete_snapshots()
    disk = await run_in_thread(lambda: _commit.committed_steps(root), name="async-stager-restore")
    gathered: list[Any] = await run_in_thread(
        lambda: ranks.all_gather((mine, disk)), name="async-stager-restore"
    )
    common = {(int(s), str(t)) for s, t in gathered[0][0]}
    for held, _ in gathered[1:]:
        common &= {(int(s), str(t)) for s, t in held}
    newest_disk = gathered[0][1][-1] if gathered[0][1] else None
    # Newest first (the same order on every rank: they all saw the same lists).
    candidates = sorted(
        (
            c
            for c in common
            if (c[0] == step if step is not None else newest_disk is None or c[0] >= newest_disk)
        ),
        reverse=True,
    )
    for chosen, timeline in candidates:
        attached: AttachedStateDict | None = None
        ok = False
        try:
            attached = await tier.load(chosen, timeline)
            check_matches(resolve(state), attached.state_dict, chosen)
            ok = True
        except (StagingError, OSError) as exc:  # AgentError, IntegrityError, a mapping that failed
            # Never raised on one rank alone: the others would wait in the all-gather below.
            _log.warning("memory snapshot of step %d cannot be restored here: %s", chosen, exc)
        oks: list[Any] = await run_in_thread(
            functools.partial(ranks.all_gather, ok), name="async-stager-restore"
        )
        if not all(oks):
            if attached is not None:
                attached.close()
            _log.warning("step %d is not restorable from memory on every rank", chosen)
            continue
        assert attached is not None
        try:
            apply_loaded(state, attached.state_dict, chosen)
        finally:
            attached.close()
        tier.note_restored(chosen)
        _log.info("restored step %d from the memory tier", chosen)
        return chosen
    if candidates:
        _log.warning("no step is restorable from memory on every rank: restoring from the folder")
    return None
