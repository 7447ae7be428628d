"""The node agent in this process: protocol, completeness, bounds, peers, memory.

Every test runs an ``Agent`` on this event loop (asyncio, uvloop, trio) and talks to
it through ``AgentClient`` over its real Unix socket, handing real memfd arenas of a
``Stager(share_memory=True)`` by SCM_RIGHTS. Only the kernel's answer to "which uid is
the peer" is replaced, in the one test of another user.
"""

from __future__ import annotations

import gc
import os
import stat
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
import torch
from helpers import assert_same

from async_stager import Stager, export_shared
from async_stager._core.memory.host_limits import CgroupLimit, HostLimits
from async_stager._share.handoff import attach_shared
from async_stager._tier import wire
from async_stager._tier.agent import Agent
from async_stager._tier.client import AgentClient
from async_stager._tier.regions import PIECE_BYTES, ArenaMaps, digests_of, regions_of
from async_stager._tier.service import memory_limits
from async_stager.errors import (
    AgentError,
    AgentRefusedError,
    AgentTimeoutError,
    AgentUnavailableError,
    HostLimitError,
)
from tests.tier.helpers_tier import memfds, short_base, state

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


class Served:
    """An agent serving on this loop, a client, a shared-memory stager."""

    def __init__(self, agent: Agent, client: AgentClient, stager: Stager, base: str) -> None:
        self.agent, self.client, self.stager, self.base = agent, client, stager, base
        self.maps = ArenaMaps()
        self.last: dict[int, int] = {}

    async def snapshot(
        self,
        sd: Any,
        step: int,
        *,
        rank: int = 0,
        commit: bool = True,
        lie: bool = False,
        protect: bool = True,
    ) -> Any:
        """BEGIN (protecting the rank's last committed step, as a trainer holding its
        lease does), stage, then (``commit``) hash and COMMIT; returns the lease."""
        kept = [self.last[rank]] if protect and rank in self.last else []
        await self.client.begin(rank, step, 1, session="t", protect=kept)
        lease = await self.stager.lease(sd)
        if commit:
            handle = export_shared(lease.state_dict, self.stager)
            regions = regions_of(handle.refs)
            digests = digests_of(
                self.maps, [a.fd for a in handle.arenas], [a.nbytes for a in handle.arenas], regions
            )
            if lie:
                digests[0][0] ^= 1
            await self.client.commit(rank, step, 1, handle, digests, PIECE_BYTES)
            self.last[rank] = step
        return lease


@asynccontextmanager
async def _served(base: str, **kw: Any) -> AsyncIterator[Served]:
    agent = Agent("job-a", max_bytes=kw.pop("max_bytes", 256 << 20), base=base, **kw)
    async with anyio.create_task_group() as tg:
        await tg.start(agent.serve)
        async with (
            AgentClient("job-a", base=base, timeout=10) as client,
            Stager(share_memory=True, max_buffer_sets=3) as stager,
        ):
            s = Served(agent, client, stager, base)
            try:
                yield s
            finally:
                s.maps.close()
        await agent.stop()


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    with short_base() as base:
        async with _served(base) as s:
            yield s


async def test_snapshot_round_trip(served: Served) -> None:
    sd = state(1)
    lease = await served.snapshot(sd, 1)
    infos = await served.client.snapshots(0)
    assert [(i.step, i.complete, i.world) for i in infos] == [(1, True, 1)]
    assert infos[0].bytes > 0 and infos[0].tensors >= 4
    lease.release()  # the agent's descriptors keep the memory
    fetched = await served.client.fetch(0, 1)
    try:
        attached = attach_shared(fetched.handle)
    finally:
        fetched.close()
    with attached:
        assert_same(attached.state_dict, sd)
        # A view stays a view of the same storage.
        out = attached.state_dict
        assert out["view"].untyped_storage().data_ptr() == out["w"].untyped_storage().data_ptr()
    status = await served.client.status()
    assert status.held_bytes == infos[0].bytes and status.pid == os.getpid() and status.job == "job-a"


async def test_begun_snapshot_never_complete(served: Served) -> None:
    """A snapshot begun and never committed (the trainer died mid-stage) is listed as
    incomplete, never handed out; the previous complete one is."""
    old = await served.snapshot(state(1), 1)
    torn = await served.snapshot(state(2), 2, commit=False)
    infos = await served.client.snapshots(0)
    assert [(i.step, i.complete) for i in infos] == [(1, True), (2, False)]
    with pytest.raises(AgentRefusedError) as err:
        await served.client.fetch(0, 2)
    assert err.value.reason == "unknown"
    fetched = await served.client.fetch(0, 1)
    with attach_shared(fetched.handle) as attached:
        assert_same(attached.state_dict, state(1))
    fetched.close()
    old.release()
    torn.release()


async def test_commit_needs_begin_and_matching_checksums(served: Served) -> None:
    with pytest.raises(AgentRefusedError) as err:
        await served.snapshot(state(4), 4, lie=True)
    assert err.value.reason == "checksum" and "do not match" in str(err.value)
    # Every refusal left nothing held; the connection is usable.
    assert served.agent.held_bytes == 0
    st = await served.client.status()
    assert st.snapshots == ()
    # A COMMIT without its BEGIN is refused.
    lease = await served.stager.lease(state(5))
    handle = export_shared(lease.state_dict, served.stager)
    regions = regions_of(handle.refs)
    digests = digests_of(
        served.maps, [a.fd for a in handle.arenas], [a.nbytes for a in handle.arenas], regions
    )
    with pytest.raises(AgentRefusedError, match="not begun"):
        await served.client.commit(0, 5, 1, handle, digests, PIECE_BYTES)
    lease.release()


async def test_snapshot_refused_first_before_the_checksum(served: Served) -> None:
    """(The lie above was caught by content; a truthful one right after is accepted.)"""
    lease = await served.snapshot(state(6), 6)
    assert [i.step for i in await served.client.snapshots(0)] == [6]
    lease.release()


async def test_keeps_the_newest_per_rank_and_drops_unprotected() -> None:
    with short_base() as base:
        async with _served(base, keep=2) as s:
            for i in (1, 2, 3):
                (await s.snapshot(state(i), i)).release()
            # A commit makes the agent forget the committing session's older snapshots
            # (the trainer releases their buffers once it is answered).
            assert [i.step for i in await s.client.snapshots(0)] == [3]
            # A BEGIN protecting nothing forgets this session's complete ones.
            (await s.snapshot(state(4), 4, protect=False)).release()
            assert [i.step for i in await s.client.snapshots(0)] == [4]
            # Another rank is held apart; a protected step stays through a BEGIN.
            other = await s.snapshot(state(10), 10, rank=1)
            await s.client.begin(1, 11, 1, session="t", protect=[10])
            assert [(i.step, i.complete) for i in await s.client.snapshots(1)] == [(10, True), (11, False)]
            # A snapshot of another session (a trainer that died) is kept for restore.
            await s.client.begin(0, 5, 1, session="new", protect=[])
            assert [(i.step, i.complete) for i in await s.client.snapshots(0)] == [(4, True), (5, False)]
            other.release()


async def test_memory_bound_refuses() -> None:
    with short_base() as base:
        async with _served(base, max_bytes=4096) as s:
            with pytest.raises(AgentRefusedError) as err:
                await s.snapshot(state(1), 1)
            assert err.value.reason == "memory" and "--max-bytes" in str(err.value)
            assert s.agent.held_bytes == 0
            assert (await s.client.snapshots(0)) == []


async def test_two_jobs_no_cross_talk() -> None:
    with short_base() as base:
        a = Agent("job-a", max_bytes=1 << 28, base=base)
        b = Agent("job-b", max_bytes=1 << 28, base=base)
        assert a.path != b.path
        async with anyio.create_task_group() as tg:
            await tg.start(a.serve)
            await tg.start(b.serve)
            async with (
                AgentClient("job-a", base=base) as ca,
                AgentClient("job-b", base=base) as cb,
                Stager(share_memory=True) as stager,
            ):
                await ca.begin(0, 1, 1)
                lease = await stager.lease(state(1))
                handle = export_shared(lease.state_dict, stager)
                maps = ArenaMaps()
                regions = regions_of(handle.refs)
                digests = digests_of(
                    maps, [x.fd for x in handle.arenas], [x.nbytes for x in handle.arenas], regions
                )
                maps.close()
                await ca.commit(0, 1, 1, handle, digests, PIECE_BYTES)
                lease.release()
                assert [i.step for i in await ca.snapshots()] == [1]
                assert await cb.snapshots() == []
                assert (await cb.hello()).job == "job-b"
                # A client of job-a at job-b's socket is refused by name.
                async with AgentClient("job-a", path=b.path) as wrong:
                    with pytest.raises(AgentRefusedError, match="job-b"):
                        await wrong.hello()
            await a.stop()
            await b.stop()


async def test_other_user_refused() -> None:
    """The peer check refuses another uid: the kernel's answer is the one thing
    replaced (an unprivileged test cannot connect as another user)."""
    with short_base() as base:
        agent = Agent("job-a", max_bytes=1 << 20, base=base, peer_uid=lambda stream: os.getuid() + 1)
        async with anyio.create_task_group() as tg:
            await tg.start(agent.serve)
            async with AgentClient("job-a", base=base) as c:
                with pytest.raises(AgentRefusedError) as err:
                    await c.status()
                assert err.value.reason == "peer" and "uid" in str(err.value)
            await agent.stop()


def test_peer_decision_and_real_credentials() -> None:
    wire.check_peer(os.getuid(), os.getuid())
    with pytest.raises(AgentRefusedError):
        wire.check_peer(os.getuid() + 1, os.getuid())
    with pytest.raises(AgentRefusedError):
        wire.check_peer(0, 1000)


async def test_socket_and_directory_modes() -> None:
    with short_base() as base:
        async with _served(base) as s:
            st = os.stat(s.agent.path)
            assert stat.S_ISSOCK(st.st_mode) and st.st_mode & 0o777 == 0o600
            assert os.stat(os.path.dirname(s.agent.path)).st_mode & 0o777 == 0o700
            # A second agent for the same job refuses to take the socket.
            with pytest.raises(AgentError, match="already serves"):
                await Agent("job-a", max_bytes=1 << 20, base=base).serve()
        assert not os.path.exists(os.path.join(base, f"async_stager-{os.getuid()}", "agent-job-a.sock"))
        os.chmod(os.path.join(base, f"async_stager-{os.getuid()}"), 0o755)
        with pytest.raises(AgentError, match="mode 0700"):
            wire.socket_path("job-a", base)


def test_socket_path_of_odd_job_ids() -> None:
    with short_base() as base:
        a = wire.socket_path("run/1:2", base)
        b = wire.socket_path("run_1_2", base)
        assert a != b and len(a) <= 107
        long = wire.socket_path("x" * 500, base)
        assert len(long) <= 107 and long != wire.socket_path("x" * 499, base)


async def test_no_agent_and_silent_agent_are_bounded() -> None:
    with short_base() as base:
        async with AgentClient("nobody", base=base, timeout=2) as c:
            with pytest.raises(AgentUnavailableError, match="no agent"):
                await c.status()
        # A listener that accepts and never answers: the call ends at its bound.
        path = wire.socket_path("mute", base)
        listener = await anyio.create_unix_listener(path)
        async with listener, AgentClient(path=path, timeout=0.3) as c:
            t0 = anyio.current_time()
            with pytest.raises(AgentTimeoutError) as err:
                await c.status()
            assert err.value.seconds == pytest.approx(0.3)
            assert anyio.current_time() - t0 < 10  # a hang guard, not a speed check


async def test_memory_returned_when_the_agent_exits() -> None:
    """The agent's duplicates of the arenas' descriptors and its mappings all go at
    its close: the process's memfd count returns to what the stager alone holds."""
    with short_base() as base:
        agent = Agent("job-a", max_bytes=1 << 28, base=base)
        async with anyio.create_task_group() as tg:
            await tg.start(agent.serve)
            async with AgentClient("job-a", base=base) as c, Stager(share_memory=True) as stager:
                sd = {"x": torch.randn(1 << 18)}
                await c.begin(0, 1, 1)
                lease = await stager.lease(sd)
                gc.collect()  # earlier tests' arenas, unreachable, close their memfds now
                before = memfds()
                handle = export_shared(lease.state_dict, stager)
                maps = ArenaMaps()
                regions = regions_of(handle.refs)
                digests = digests_of(
                    maps, [x.fd for x in handle.arenas], [x.nbytes for x in handle.arenas], regions
                )
                maps.close()
                await c.commit(0, 1, 1, handle, digests, PIECE_BYTES)
                assert memfds() == before + len(handle.arenas)  # the agent's duplicates
                lease.release()
                await agent.stop()
                while not agent.closed:
                    await anyio.sleep(0.01)
                gc.collect()
                assert memfds() == before
                assert agent.held_bytes == 0


def test_memory_limits_from_the_node() -> None:
    lim = HostLimits(
        mem_available=8 << 30, cgroup=CgroupLimit(2, "/x", 6 << 30, 2 << 30), nofile=1024, open_fds=10
    )
    chosen = memory_limits(None, lim)
    assert chosen.max_bytes == 2 << 30  # half of the tightest (the cgroup's 4 GiB headroom)
    assert any("cgroup" in line for line in chosen.lines())
    assert memory_limits(3 << 30, lim).max_bytes == 3 << 30
    with pytest.raises(HostLimitError) as err:
        memory_limits(5 << 30, lim)
    assert err.value.resource == "memory cgroup headroom"
    with pytest.raises(HostLimitError):
        memory_limits(1 << 20, HostLimits(mem_available=8 << 30, memfd=False))
    with pytest.raises(HostLimitError) as err:
        memory_limits(1 << 20, HostLimits(mem_available=8 << 30, nofile=70, open_fds=0))
    assert err.value.unit == "descriptors"


def test_check_reports_the_agent() -> None:
    import io

    from async_stager._cli.check import agent_report

    lim = HostLimits(mem_available=8 << 30, nofile=1024, open_fds=10)
    out = io.StringIO()
    assert agent_report(1 << 30, 1, out, lim)  # 3 x 1 GiB x 1 rank <= 4 GiB, the default bound
    assert "agent memory bound: 4.00 GiB" in out.getvalue() and "fits" in out.getvalue()
    assert "needs 3 x 1.00 GiB x 1 rank(s) = 3.00 GiB" in out.getvalue()
    out = io.StringIO()
    assert not agent_report(1 << 30, 2, out, lim)
    assert "does not fit" in out.getvalue()
    out = io.StringIO()
    assert not agent_report(1, 1, out, HostLimits(mem_available=8 << 30, memfd=False))
    assert "cannot run" in out.getvalue()


async def test_garbage_never_stops_the_agent(served: Served) -> None:
    """Another protocol, a bad body, a truncated message, an unknown kind: each
    connection is refused or closed; the agent goes on serving."""
    import struct

    bad_json = wire.HEADER.pack(wire.MAGIC, wire.VERSION, int(wire.Kind.LIST), 0, 3, 0) + b"{x]"
    unknown = wire.HEADER.pack(wire.MAGIC, wire.VERSION, 99, 0, 0, 0)
    for payload in (
        b"GET / HTTP/1.0\r\n\r\n" + b"x" * 40,
        bad_json,
        unknown,
        b"ASTA\x01",
        struct.pack("!4s", b"ASTA"),
    ):
        stream = await anyio.connect_unix(served.agent.path)
        async with stream:
            await stream.send(payload)
            if len(payload) >= wire.HEADER.size:
                answer = await wire.receive(stream)
                assert answer is not None and answer.kind == wire.Kind.ERROR, payload
    assert (await served.client.status()).job == "job-a"
