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
step; every rank loads it from its agent, trusting the agent's verification of a
snapshot it sealed (``_tier.sealing``: no process can change it since), else verifying
every byte, and reads it straight into the state's tensors (``_tier.loading``); if any rank cannot
(agent gone, a checksum, a state that does not match), the next older common step is
tried, and then every rank restores from the folder. Never a step assembled from memory
on some ranks and disk on others, nor from two runs.
"""

from __future__ import annotations

import functools
import logging
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio

from async_stager._checkpoint.place import Place
from async_stager._checkpoint.ranks import Ranks
from async_stager._checkpoint.statefuls import apply_loaded, check_matches, resolve
from async_stager._core.aio.threads import run_in_thread
from async_stager._tier import replicator as _replicas
from async_stager.errors import InvalidOptionError, StagingError

if TYPE_CHECKING:
    from async_stager._share.handoff import AttachedStateDict
    from async_stager._tier.client import AgentClient
    from async_stager._tier.loading import Loaded
    from async_stager._tier.replicator import Replicator
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
    replicate: bool = False,
    replica_share: float = 0.1,
    replica_rate: float | None = None,
) -> tuple[MemoryTier | None, TierSchedule]:
    """The memory tier for ``agent`` (a job id, or a client), or None without one
    (then ``memory_every`` and ``persist_every`` must be left at 1). ``replicate``: each
    snapshot also to another node's agent (``_tier.replicator``), paced by
    ``replica_share`` and ``replica_rate``."""
    schedule = TierSchedule(memory_every, persist_every)
    if not isinstance(replicate, bool):
        raise InvalidOptionError(f"replicate must be True or False, got {replicate!r}")
    from async_stager._tier.replica import Replication

    pace = Replication(share=replica_share, rate=replica_rate)
    if agent is None:
        if schedule != TierSchedule() or replicate:
            raise InvalidOptionError(
                "memory_every, persist_every and replicate need agent=JOB (the memory tier's node agent: "
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
    agree, timeline, own = None, None, None
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
    if replicate and own is not None:
        tier.replicator = _replicator(tier, own, client, namespace, pace)
    elif replicate:
        _log.warning("replicate=True in a job of one process: there is no other node to replicate to")
    return tier, schedule


def _replicator(
    tier: MemoryTier, own: Ranks, client: AgentClient, namespace: str, pace: Any
) -> Replicator | None:
    """Where this rank's replicas go (``replica.ring`` over the ranks' nodes: a node is
    the agent a rank talks to, its host and socket path) and the tier's own gloo group
    the replicas travel on. A collective: every rank calls it (at construction)."""
    import datetime
    import socket

    import torch.distributed as dist

    from async_stager._tier.replica import ring
    from async_stager._tier.replicator import Replicator

    nodes = [tuple(n) for n in own.all_gather([socket.gethostname(), client.path])]
    peers = ring(nodes)
    if not peers:  # the same answer on every rank: none makes the group
        _log.warning("replicate=True but every rank talks to one agent (one node): nothing to replicate to")
        return None
    members = dist.get_process_group_ranks(own.group) if own.group is not None else None
    # Idle for as long as no snapshot comes: a dead peer is found by its closed socket.
    group = dist.new_group(
        ranks=members, backend="gloo", timeout=datetime.timedelta(days=30), use_local_synchronization=True
    )
    rank = own.rank
    replicator = Replicator(
        group,
        rank=rank,
        world=own.world,
        peer=peers.get(rank),
        sources=[r for r, p in sorted(peers.items()) if p == rank],
        namespace=namespace,
        agent_path=client.path,
        agent_timeout=client.timeout,
        options=pace,
        held=lambda step: step in tier.held_steps(),
        replicated_common=lambda: tier.replicated_step,
        update=tier.update_stats,
        stats=lambda: tier.stats,
    )
    tier.update_stats(replica_peer=peers.get(rank))
    return replicator


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
    tier: MemoryTier, ranks: Ranks, place: Place, state: dict[str, Any], step: int | None
) -> int | None:
    """Restore from the agents if every rank can (see the module doc); the step, or
    None (then restore from the folder). Every rank calls it. Cancellation: deferred
    while a collective runs; ``state`` is changed only once every rank verified."""
    tier.restarting()
    mine = await tier.complete_snapshots()
    rep = tier.replicator
    replicas = await _replicas.replica_snapshots(rep) if rep is not None else []
    disk = await run_in_thread(place.committed_steps, name="async-stager-restore")
    gathered: list[Any] = await run_in_thread(
        lambda: ranks.all_gather((mine, disk, replicas)), name="async-stager-restore"
    )
    own = [{(int(s), str(t)) for s, t in g[0]} for g in gathered]
    # (rank, step, timeline) -> the lowest rank whose node's agent holds its replica.
    holders: dict[tuple[int, int, str], int] = {}
    for h, g in enumerate(gathered):
        for src, s, t in g[2]:
            holders.setdefault((int(src), int(s), str(t)), h)
    # What each rank can get whole: its own agent's, or the replica on its peer's node.
    common = set.intersection(
        *(own[r] | {(s, t) for (src, s, t) in holders if src == r} for r in range(len(gathered)))
    )
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
        # Each rank's source: its own agent, else the holder of its replica.
        source = [
            r if (chosen, timeline) in own[r] else holders[(r, chosen, timeline)] for r in range(len(own))
        ]
        attached: AttachedStateDict | Loaded | None = None
        ok = False
        try:
            attached = await _obtain(tier, ranks.rank, source, chosen, timeline)
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
            from async_stager._tier.loading import Loaded, load_into

            # One copy, read from the arenas into the state's own tensors (a thread).
            read = functools.partial(load_into, attached, resolve(state))
            loaded = await run_in_thread(read, name="async-stager-restore")
            apply_loaded(state, loaded, chosen)
        finally:
            attached.close()
        tier.note_restored(chosen, attached.trusted if isinstance(attached, Loaded) else None)
        peer = source[ranks.rank] != ranks.rank
        tier.update_stats(restored_from_peer=peer)
        _log.info(
            "restored step %d from the memory tier%s", chosen, " (the peer node's replica)" if peer else ""
        )
        return chosen
    if candidates:
        _log.warning("no step is restorable from memory on every rank: restoring from the folder")
    return None


async def _obtain(
    tier: MemoryTier, me: int, source: list[int], step: int, timeline: str
) -> AttachedStateDict | Loaded:
    """This rank's snapshot of ``step`` from ``source[me]`` (itself: its agent; another
    rank: the replica its node holds, sent over the tier's group), while this rank
    sends the replicas it holds to the ranks whose source it is (never raised: the
    receivers' checks decide)."""
    rep = tier.replicator
    gives = [r for r, src in enumerate(source) if src == me and r != me]
    got: AttachedStateDict | Loaded | None = None
    failed: BaseException | None = None
    async with anyio.create_task_group() as tg:
        if rep is not None:
            for dst in gives:
                tg.start_soon(_replicas.give, rep, dst, step, timeline)  # never raises
        try:
            if source[me] == me:
                got = await tier.load(step, timeline)
            else:
                assert rep is not None
                got = await _replicas.take(rep, source[me], step)
        except Exception as exc:  # noqa: BLE001 - raised once the gives ended (not as a group)
            failed = exc
    if failed is not None:
        raise failed
    assert got is not None
    return got
