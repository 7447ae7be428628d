"""One rank's replication: its snapshots sent to its peer, its sources' replicas held.

Sending (``Replicator.offer``, a task on the loop, the transfer in a thread of its own):
once the rank's own agent holds a snapshot complete, the newest one offered is sent to
the peer (``replica.ring``), paced (``replica.Pacer``), while the tier keeps its
buffers (``pinned``: no stage writes into them); a newer snapshot offered meanwhile
waits, and only the newest waiting is sent next. Nothing here runs before the local
snapshot is complete, and a save never waits for it: the tier keeps buffer sets apart
for the snapshot being sent and the newest step every rank has replicated.

Receiving (a daemon thread per source rank, blocking in gloo, never waiting for the
loop): each replica is received into memfds of this process and handed to this
node's agent under the source rank in ``replica_namespace`` (the agent re-hashes it
against the source's digests), then answered (``Ack``). Of a source's replicas the
agent keeps the newest two and the newest step every rank has replicated (the job's
``replicated`` step: what a lost node restores from); older ones are forgotten.

Failures: a peer that is gone (gloo raises) ends replication for this run, with one
warning; the peer's agent away, its memory bound reached or a replica refused are
answered and counted (``MemoryStats``), and the next snapshot is tried again.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import anyio

from async_stager._core.aio.threads import run_in_thread
from async_stager._share.handoff import AttachedStateDict, SharedArenaRef, SharedHandle, attach_shared
from async_stager._tier.client import AgentClient, Fetched, verify_fetched
from async_stager._tier.regions import PIECE_BYTES
from async_stager._tier.replica import (
    BYE,
    RESTORE_TAG,
    Ack,
    Incoming,
    Outgoing,
    Pacer,
    Replication,
    receive_snapshot,
    recv_ack,
    replica_namespace,
    send_ack,
    send_bye,
    send_nothing,
    send_snapshot,
)
from async_stager._tier.stats import TierProgress
from async_stager.errors import AgentError, AgentRefusedError, IntegrityError

__all__ = ["Replicator", "give", "replica_snapshots", "take"]

_log = logging.getLogger("async_stager.checkpoint")


def _tuples(x: Any) -> Any:
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


def _handle(got: Incoming) -> SharedHandle:
    """A handle on a received snapshot's memfds (this process's)."""
    body = got.body
    pid = os.getpid()
    arenas = []
    for fd, n in zip(got.fds, body["arenas"]):
        st = os.fstat(fd)
        arenas.append(SharedArenaRef(pid=pid, fd=fd, nbytes=int(n), dev=st.st_dev, ino=st.st_ino))
    return SharedHandle(
        arenas=tuple(arenas),
        payload=got.payload,
        refs=tuple(_tuples(r) for r in body["refs"]),
        tensors=int(body.get("tensors", 0)),
        nbytes=int(body.get("nbytes", 0)),
    )


class Replicator:
    """Rank ``rank``'s replication on ``group`` (a gloo group of the tier's own):
    ``peer`` holds its replicas (None: no other node), ``sources`` are the ranks whose
    replicas this rank hands to its agent (``agent_path``, ``agent_timeout``).
    ``held(step)``: the tier still holds that snapshot; ``replicated_common()``: the
    newest step every rank has replicated (None: none yet); ``update(**stats)``: the
    tier's stats changed (on the loop)."""

    def __init__(
        self,
        group: Any,
        *,
        rank: int,
        world: int,
        peer: int | None,
        sources: list[int],
        namespace: str,
        agent_path: str,
        agent_timeout: float,
        options: Replication,
        held: Callable[[int], bool],
        replicated_common: Callable[[], int | None],
        update: Callable[..., None],
        stats: Callable[[], Any],
    ) -> None:
        self.group = group
        self.rank = rank
        self.world = world
        self.peer = peer
        self.sources = sources
        self.namespace = namespace
        self.agent_path = agent_path
        self.agent_timeout = agent_timeout
        self.options = options
        self._held = held
        self._replicated_common = replicated_common
        self._update = update
        self._stats = stats
        self.session = f"{os.getpid()}-replicas"
        #: The step being sent (the tier keeps its buffers), and since when.
        self.pinned: int | None = None
        #: The step every rank replicates now (the tier decides it from the ranks'
        #: exchanges), and the newest this rank finished sending (verified or not).
        self.target: int | None = None
        self.done: int | None = None
        self._since = 0.0
        self._bytes = 0
        #: Steps of this rank its peer verified (newest last, a few).
        self.verified: list[int] = []
        self._offer: tuple[int, Outgoing] | None = None
        #: What to send of each complete snapshot the tier holds.
        self._outgoing: dict[int, Outgoing] = {}
        self._wake: anyio.Event | None = None
        self._stopping = threading.Event()
        self._broken = False
        self._warned_memory = False
        self._task_done: anyio.Event | None = None
        self._threads: list[threading.Thread] = []

    #: Buffer sets the tier keeps apart: the step being sent, and the newest step every
    #: rank has replicated (kept locally), so that a save never waits for replication.
    EXTRA_SETS = 2

    def pins(self, replicated: int | None) -> set[int]:
        """The steps the tier must keep: the one being sent, the one every rank is
        replicating (until the ranks agree every replica of it is verified, or a newer
        one is decided: a rank that finished early must still hold it then) and
        ``replicated``."""
        return {s for s in (self.pinned, self.target, replicated) if s is not None}

    @property
    def on(self) -> bool:
        """This rank sends replicas (a peer, and the link to it not broken)."""
        return self.peer is not None and not self._broken

    # -- the loop's side ---------------------------------------------------------------

    def keep(
        self, step: int, timeline: str, handle: SharedHandle, digests: list[list[int]], held: list[int]
    ) -> None:
        """The rank's agent holds ``step`` complete (``handle``: its arenas, this
        process's; ``digests``: its regions'): what to send if it is chosen, kept while
        the tier holds it (``held``: the steps it holds)."""
        body = {
            "step": step, "timeline": timeline, "world": self.world, "rank": self.rank,
            "arenas": [a.nbytes for a in handle.arenas], "refs": [list(r) for r in handle.refs],
            "digests": digests, "piece_bytes": PIECE_BYTES, "tensors": handle.tensors, "nbytes": handle.nbytes,
        }  # fmt: skip
        self._outgoing = {s: o for s, o in self._outgoing.items() if s in held}
        self._outgoing[step] = Outgoing(body, handle.payload, [a.fd for a in handle.arenas])

    def report(self, held: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """What this rank tells the others at an exchange (from the exchanges' thread):
        its ``held`` steps its peer verified, and the newest step it finished sending."""
        return tuple(s for s in held if s in self.verified), (-1 if self.done is None else self.done,)

    def decide(self, common: int | None, reports: list[Any]) -> None:
        """After an exchange (on the loop): every rank replicates the same steps, so that
        a step replicated by every rank exists. Once every rank reported the previous one
        done (sent, verified or not), the newest common step is the next. A function of
        the exchanges' answers alone, applied in order: every rank decides the same at
        the same exchange."""
        if common is None or not reports:
            return
        target = -1 if self.target is None else self.target
        if {int(e[0]) if e else -1 for e in reports} != {target} or common <= target:
            return
        self.target = common
        out = self._outgoing.get(common)
        if out is None:
            self.done = common  # not held here any more (a failure): the round goes on
        else:
            self.offer(common, out)

    def open(self, tg: anyio.abc.TaskGroup) -> None:
        """Start the receivers (threads) and the sender (a task of ``tg``)."""
        for src in self.sources:
            t = threading.Thread(
                target=self._receive, args=(src,), name=f"async-stager-replicas-from-{src}", daemon=True
            )
            t.start()
            self._threads.append(t)
        if self.peer is not None:
            self._wake = anyio.Event()
            self._task_done = anyio.Event()
            tg.start_soon(self._sender)

    def offer(self, step: int, out: Outgoing) -> None:
        """Send ``step`` (complete in the rank's agent, kept by the tier from now until
        ``done``) once the link is free (replacing one offered and not yet sent)."""
        if not self.on or self._wake is None:
            self.done = step
            return
        self.pinned, self._since = step, time.monotonic()
        self._offer = (step, out)
        self._wake.set()

    def in_flight(self) -> list[TierProgress]:
        """The replica being sent, as ``"memory-replicating"``."""
        if self.pinned is None:
            return []
        return [TierProgress(self.pinned, "memory-replicating", time.monotonic() - self._since, None)]

    @property
    def sending_bytes(self) -> int:
        return self._bytes

    def stop_sending(self) -> None:
        """No more replicas (the Checkpointer closes): the sender task ends once the one
        on the wire, if any, is sent (unpaced)."""
        self._stopping.set()
        if self._wake is not None:
            self._wake.set()

    async def aclose(self, grace: float = 10.0) -> None:
        """Stop sending (a replica being sent is finished, unpaced), tell the peer no
        more come, and wait up to ``grace`` seconds for the sources to say the same.
        Cancellation: shielded."""
        with anyio.CancelScope(shield=True):
            self.stop_sending()
            if self._task_done is not None:
                await self._task_done.wait()
            if self.on and self.peer is not None:
                peer = self.peer
                with anyio.move_on_after(grace):
                    try:
                        await run_in_thread(
                            lambda: send_bye(self.group, peer),
                            name="async-stager-replicas-bye",
                            daemon=True,
                            abandon_on_cancel=True,
                        )
                    except Exception as exc:  # noqa: BLE001 - the peer is gone: nothing to tell
                        _log.debug("replication: no goodbye to rank %d: %s", peer, exc)
            threads = self._threads

            def join() -> None:
                end = time.monotonic() + grace
                for t in threads:
                    t.join(max(0.0, end - time.monotonic()))

            await run_in_thread(join, name="async-stager-replicas-join", daemon=True, abandon_on_cancel=True)

    async def _sender(self) -> None:
        assert self._wake is not None and self._task_done is not None
        try:
            while not self._stopping.is_set():
                await self._wake.wait()
                self._wake = anyio.Event()
                offer, self._offer = self._offer, None
                if offer is None or self._stopping.is_set():
                    continue
                step, out = offer
                try:
                    if self._held(step):
                        await self._send(step, out)
                finally:
                    self.pinned, self.done = None, step
        finally:
            self._task_done.set()

    async def _send(self, step: int, out: Outgoing) -> None:
        peer = self.peer
        assert peer is not None
        self._since, self._bytes = time.monotonic(), int(out.body.get("nbytes", 0))
        pacer = Pacer(self.options, self._stopping)
        t0 = time.monotonic()

        def transfer() -> tuple[bool, Ack]:
            whole = send_snapshot(
                self.group, peer, out, options=self.options, pacer=pacer, abandon=lambda: not self._held(step)
            )
            got, ack = recv_ack(self.group, peer)
            if got != step:
                raise RuntimeError(f"rank {peer} answered step {got} for step {step}")
            return whole, ack

        try:
            whole, ack = await run_in_thread(transfer, name="async-stager-replicate", daemon=True)
        except Exception as exc:  # noqa: BLE001 - the peer is gone: replication ends for this run
            self._broken = True
            self._update(replica_failures=self._stats().replica_failures + 1)
            warnings.warn(
                f"replication of step {step} to rank {peer} failed ({exc}); memory snapshots are no longer "
                "replicated in this run (a lost node restores from disk)",
                RuntimeWarning,
                stacklevel=2,
            )
            _log.warning("replication to rank %d broke at step %d: %s", peer, step, exc)
            return
        seconds = time.monotonic() - t0
        s = self._stats()
        if ack is Ack.HELD and whole:
            self.verified = [s for s in self.verified if self._held(s)] + [step]
            rate = pacer.sent / pacer.busy if pacer.busy > 0 else 0.0
            self._update(
                replicated=s.replicated + 1,
                replica_step=step,
                replica_seconds=seconds,
                replica_link_bytes_per_second=rate,
            )
        elif ack is Ack.MEMORY:
            self._update(replica_skipped=s.replica_skipped + 1)
            text = (
                f"replication of step {step} skipped: the agent of rank {peer} has reached its memory bound "
                "(--max-bytes); give it more, or keep fewer snapshots"
            )
            _log.warning("%s", text)
            if not self._warned_memory:
                self._warned_memory = True
                warnings.warn(text, RuntimeWarning, stacklevel=2)
        else:
            self._update(replica_failures=s.replica_failures + 1)
            _log.warning("replication of step %d to rank %d not held: %s", step, peer, ack.name)

    # -- a source's replicas (a thread per source) ---------------------------------------

    def _receive(self, src: int) -> None:
        kept: list[int] = []
        while True:
            try:
                got = receive_snapshot(self.group, src)
            except Exception as exc:  # noqa: BLE001 - the source is gone
                if not self._stopping.is_set():
                    _log.warning("replication: the replicas of rank %d stopped coming: %s", src, exc)
                return
            if got == BYE or not isinstance(got, Incoming):
                return
            step = int(got.body["step"])
            try:
                ack, kept = self._hold(src, got, kept)
            except Exception as exc:  # noqa: BLE001 - never leave the sender waiting
                _log.warning("replication: the replica of rank %d step %d failed here: %s", src, step, exc)
                ack = Ack.REFUSED
            finally:
                got.close()
            try:
                send_ack(self.group, src, step, ack)
            except Exception as exc:  # noqa: BLE001 - the source is gone
                _log.warning("replication: cannot answer rank %d: %s", src, exc)
                return

    def _hold(self, src: int, got: Incoming, kept: list[int]) -> tuple[Ack, list[int]]:
        """Hand a received replica to this node's agent (it verifies every region)."""
        body = got.body
        step = int(body["step"])
        common = self._replicated_common()
        before = [s for s in kept[-1:]] + ([common] if common is not None and common in kept else [])
        keep = sorted(set(before))

        async def commit() -> None:
            handle = _handle(got)
            ns = replica_namespace(self.namespace)
            async with AgentClient(path=self.agent_path, timeout=self.agent_timeout) as client:
                await client.begin(
                    src, step, self.world, session=self.session, protect=keep, ns=ns,
                    timeline=str(body.get("timeline", "")),
                )  # fmt: skip
                await client.commit(
                    src, step, self.world, handle, body["digests"], int(body["piece_bytes"]),
                    session=self.session, protect=[*keep, step], ns=ns,
                )  # fmt: skip

        try:
            anyio.run(commit)
        except AgentRefusedError as exc:
            _log.warning("replication: this node's agent did not take rank %d step %d: %s", src, step, exc)
            return (Ack.MEMORY if exc.reason == "memory" else Ack.REFUSED), keep
        except AgentError as exc:
            _log.warning("replication: no agent for the replica of rank %d step %d: %s", src, step, exc)
            return Ack.NO_AGENT, keep
        return Ack.HELD, [*keep, step]


# -- a restore after a lost node -------------------------------------------------------


async def replica_snapshots(rep: Replicator) -> list[tuple[int, int, str]]:
    """(source rank, step, timeline) of the replicas this node's agent holds complete
    for ``rep``'s namespace and world size; [] if the agent is away (logged)."""
    try:
        async with AgentClient(path=rep.agent_path, timeout=rep.agent_timeout) as client:
            infos = await client.snapshots(ns=replica_namespace(rep.namespace))
    except AgentError as exc:
        _log.warning("replication: cannot list this node's replicas (%s)", exc)
        return []
    return [(i.rank, i.step, i.timeline) for i in infos if i.complete and i.world == rep.world]


async def give(rep: Replicator, dst: int, step: int, timeline: str) -> None:
    """Send rank ``dst`` its replica of ``step`` (of ``timeline``) from this node's
    agent, unpaced (a restore waits for it); if it cannot be read, say so (``dst`` must
    not wait). Never raises (logged: ``dst``'s verification decides)."""
    fetched: Fetched | None = None
    out: Outgoing | None = None
    try:
        async with AgentClient(path=rep.agent_path, timeout=rep.agent_timeout) as client:
            fetched = await client.fetch(dst, step, ns=replica_namespace(rep.namespace), timeline=timeline)
        h = fetched.handle
        body = {
            "step": step, "timeline": timeline, "world": fetched.world, "rank": dst,
            "arenas": [a.nbytes for a in h.arenas], "refs": [list(r) for r in h.refs],
            "digests": [list(d) for d in fetched.digests], "piece_bytes": fetched.piece_bytes,
            "tensors": h.tensors, "nbytes": h.nbytes,
        }  # fmt: skip
        out = Outgoing(body, h.payload, list(fetched.fds))
    except Exception as exc:  # noqa: BLE001 - dst then restores from disk with every rank
        _log.warning("replication: cannot read the replica of rank %d step %d here: %s", dst, step, exc)

    def send() -> None:
        if out is None:
            send_nothing(rep.group, dst)
        else:
            send_snapshot(rep.group, dst, out, options=Replication(share=1.0), tag=RESTORE_TAG)

    try:
        await run_in_thread(send, name="async-stager-replica-give", daemon=True)
    except Exception as exc:  # noqa: BLE001 - dst is gone: the ranks' check says so
        _log.warning("replication: cannot send rank %d its replica of step %d: %s", dst, step, exc)
    finally:
        if fetched is not None:
            fetched.close()


async def take(rep: Replicator, src: int, step: int) -> AttachedStateDict:
    """This rank's snapshot of ``step`` from rank ``src`` (its node holds the replica),
    received into memfds of this process, verified against its digests and attached.
    Raises IntegrityError if ``src`` had none or a region does not match."""
    got = await run_in_thread(
        lambda: receive_snapshot(rep.group, src, tag=RESTORE_TAG),
        name="async-stager-replica-take",
        daemon=True,
    )
    if not isinstance(got, Incoming):
        raise IntegrityError(f"rank {src} could not read this rank's replica of step {step}", step=step)
    try:
        body = got.body
        if int(body["step"]) != step or int(body["rank"]) != rep.rank:
            raise IntegrityError(
                f"rank {src} sent rank {body['rank']} step {body['step']} for rank {rep.rank} step {step}",
                step=step,
            )
        handle = _handle(got)
        fetched = Fetched(
            handle, tuple(got.fds), tuple(tuple(int(x) for x in d) for d in body["digests"]),
            int(body["piece_bytes"]), rep.rank, step, int(body["world"]),
        )  # fmt: skip
        await run_in_thread(lambda: verify_fetched(fetched), name="async-stager-replica-verify")
        return attach_shared(handle)
    finally:
        got.close()  # the mapping keeps the memory
