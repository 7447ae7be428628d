"""The agent as its own process (``python -m async_stager agent``), and its faults.

A trainer SIGKILLed mid-snapshot: its torn snapshot never restores, the previous one
does, bit-exact. The agent SIGKILLed: the trainer's memory saves turn off with one
warning (typed errors underneath), and a restarted agent starts empty and is used
again. The agent's exit returns the memory: its memfds are counted while it runs, and
the node's shared memory falls by what it held once it is gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import anyio
import pytest
from helpers import assert_same

from async_stager._tier.client import AgentClient
from async_stager._tier.tier import MemoryTier
from async_stager.errors import AgentUnavailableError
from tests.tier.helpers_tier import agent_process, child_env, memfds, short_base
from tests.tier.tier_child import state_of

pytestmark = [pytest.mark.timeout(240)]

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tier_child.py")


def _shmem() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    return 0


def _kill_trainer_mid_snapshot(job: str, base: str, steps: int, mib: int) -> None:
    proc = subprocess.Popen(
        [sys.executable, CHILD, job, base, str(steps), str(mib)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if line.strip() != "STAGED":
            proc.kill()
            print(proc.stderr.read() if proc.stderr else "")  # shown in full on failure
        assert line.strip() == "STAGED", line
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for f in (proc.stdout, proc.stderr):
            if f is not None:
                f.close()


def test_trainer_sigkill_mid_snapshot_restores_the_previous_one() -> None:
    with short_base() as base, agent_process("crash", base) as agent:
        _kill_trainer_mid_snapshot("crash", base, 3, 4)
        # The agent still holds the memory: only it holds the memfds now.
        assert memfds(agent.pid) >= 1

        async def restore() -> None:
            tier = MemoryTier(AgentClient("crash", base=base))
            infos = await tier.client.snapshots(0)
            assert [(i.step, i.complete) for i in infos] == [(3, True), (4, False)]
            assert await tier.complete_steps() == [3]
            attached = await tier.load(3)
            # Its trainer is gone: the agent sealed its memory and verified it after
            # the seal, and this restore trusts that check (issue 45 s2).
            assert attached.trusted
            with attached:
                assert_same(attached.state_dict, state_of(3, 4))
            await tier.aclose()

        anyio.run(restore)
        assert agent.poll() is None


def test_agent_sigkill_then_restart() -> None:
    with short_base() as base:

        async def run() -> None:
            async with anyio.create_task_group() as tg:
                tier = MemoryTier(AgentClient("k", base=base, timeout=60), retry_seconds=0.0)  # a hang guard
                tier.open(tg)
                with agent_process("k", base) as agent:
                    assert await tier.save(state_of(1, 1), 1)
                    while tier.in_flight():
                        await anyio.sleep(0.01)
                    assert tier.stats.saved == 1
                    agent.send_signal(signal.SIGKILL)
                    agent.wait(30)
                # Staged (the save costs the stage only); its commit finds no agent.
                with pytest.warns(RuntimeWarning, match="memory checkpoints are off"):
                    assert await tier.save(state_of(2, 1), 2)
                    while tier.in_flight():
                        await anyio.sleep(0.01)
                assert tier.stats.failures == 1 and not tier.stats.available
                with pytest.raises(AgentUnavailableError):
                    await tier.client.status()
                # A restarted agent (its socket left behind by the dead one is replaced)
                # starts empty and is used again.
                with agent_process("k", base):
                    assert await tier.complete_steps() == []
                    assert await tier.save(state_of(3, 1), 3)
                    while tier.in_flight():
                        await anyio.sleep(0.01)
                    assert await tier.complete_steps() == [3]
                    assert tier.stats.saved == 2 and tier.stats.available
                    attached = await tier.load(3)
                    with attached:
                        assert_same(attached.state_dict, state_of(3, 1))
                    await tier.aclose()

        anyio.run(run)


def test_agent_exit_returns_the_memory() -> None:
    mib = 48
    with short_base() as base:
        with agent_process("mem", base, "--max-bytes", str(1 << 30)) as agent:
            _kill_trainer_mid_snapshot("mem", base, 1, mib)
            held = anyio.run(_held, "mem", base)
            assert held >= mib << 20
            # Only the agent holds them now: its memfds are the snapshot's arenas.
            assert memfds(agent.pid) >= 1
            before = _shmem()
            agent.send_signal(signal.SIGTERM)
            assert agent.wait(30) == 0
        deadline = time.monotonic() + 10
        while _shmem() > before - held // 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        # Other processes on the machine move Shmem too: half of it is a safe margin.
        assert _shmem() <= before - held // 2
        assert not os.path.exists(os.path.join(base, f"async_stager-{os.getuid()}", "agent-mem.sock"))


async def _held(job: str, base: str) -> int:
    async with AgentClient(job, base=base) as c:
        return (await c.status()).held_bytes


def test_command_line_refuses_a_bound_past_the_node(capsys: pytest.CaptureFixture[str]) -> None:
    from async_stager._cli.main import main

    assert main(["agent", "--job", "x", "--max-bytes", str(1 << 62)]) == 2
    assert "MemAvailable" in capsys.readouterr().err
