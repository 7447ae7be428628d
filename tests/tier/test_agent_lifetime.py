"""The agent's command line and its lifetime (issue 41, section 1; issue 42).

Every bad option is one usage line and exit status 2, never a traceback; ``--max-bytes``
takes sizes as ``check --bytes`` does. An agent does not outlive its job: ``--parent``
(it exits once that process has), ``--idle-exit`` (seconds with no trainer connected),
and ``examples/memory_tier.py`` stops its agent however the launcher is stopped
(SIGTERM, as a scheduler stops a job, or SIGKILL). Its INFO log is a summary, not a
line per snapshot.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from async_stager._cli.main import main as cli_main
from async_stager._tier.agent import Agent
from async_stager._tier.client import AgentClient
from async_stager._tier.service import ParentProcess
from async_stager._tier.tier import MemoryTier
from tests.tier.helpers_tier import ROOT, agent_process, child_env, short_base, state

pytestmark = [pytest.mark.timeout(120)]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--job", ""], "--job"),
        (["--job", " "], "--job"),
        (["--job", "x", "--keep", "0"], "--keep"),
        (["--job", "x", "--keep", "-1"], "--keep"),
        (["--job", "x", "--keep", "two"], "--keep"),
        (["--job", "x", "--max-bytes", "0"], "--max-bytes"),
        (["--job", "x", "--max-bytes", "-5"], "--max-bytes"),
        (["--job", "x", "--max-bytes", "lots"], "--max-bytes"),
        (["--job", "x", "--parent", "0"], "--parent"),
        (["--job", "x", "--idle-exit", "0"], "--idle-exit"),
        (["--job", "x", "--idle-exit", "nan"], "--idle-exit"),
        (["--job", "x", "--max-bytes", str(1 << 62)], "MemAvailable"),
    ],
)
def test_bad_options_are_one_line_and_exit_2(
    args: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["agent", *args]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and says in err, err
    assert len([line for line in err.splitlines() if "error" in line or "agent:" in line]) == 1, err


def test_parent_that_is_not_running(capsys: pytest.CaptureFixture[str]) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    with short_base() as base:
        assert cli_main(["agent", "--job", "x", "--dir", base, "--parent", str(gone.pid)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"--parent {gone.pid}: no such process" in err, err


def _gone(pid: int, start: int, seconds: float) -> bool:
    """Process ``pid`` (started at ``start``) has exited within ``seconds``."""
    deadline = time.monotonic() + seconds
    while ParentProcess(pid, start).alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not ParentProcess(pid, start).alive()


IDLE = ["--max-bytes", "64MiB", "--idle-exit", "0.5"]


def test_sizes_and_idle_exit() -> None:
    with short_base() as base:
        proc = subprocess.run(
            [sys.executable, "-m", "async_stager", "agent", "--job", "idle", "--dir", base, *IDLE],
            capture_output=True,
            text=True,
            env=child_env(),
            timeout=60,
        )
    assert proc.returncode == 0, proc.stderr
    assert "at most 67108864 bytes" in proc.stdout, proc.stdout
    assert "idle 0.5 s with no trainer connected" in proc.stderr, proc.stderr


def test_idle_exit_waits_while_a_trainer_is_connected() -> None:
    async def run(base: str) -> None:
        async with AgentClient("idle", base=base, timeout=30) as client:
            await client.status()  # connected: the agent is not idle
            await anyio.sleep(1.5)
            assert agent.poll() is None
        # The connection closed: idle from now on.
        with anyio.fail_after(60):
            while agent.poll() is None:
                await anyio.sleep(0.05)

    with short_base() as base, agent_process("idle", base, "--idle-exit", "0.5") as agent:
        anyio.run(run, base)
        assert agent.returncode == 0


def test_parent_exit_stops_the_agent() -> None:
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        with short_base() as base, agent_process("child", base, "--parent", str(parent.pid)) as agent:
            start = ParentProcess.of(agent.pid).start
            time.sleep(1.0)
            assert agent.poll() is None
            parent.kill()
            parent.wait()
            assert _gone(agent.pid, start, 30)
            assert agent.wait(10) == 0
            assert not os.path.exists(os.path.join(base, f"async_stager-{os.getuid()}", "agent-child.sock"))
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def _job_processes(job: str) -> list[int]:
    """Processes whose command line names ``job`` (the agent and the ranks)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if job.encode() in cmd and _running(int(name)):
            found.append(int(name))
    return found


def _running(pid: int) -> bool:
    try:
        return ParentProcess.of(pid).alive()
    except Exception:  # noqa: BLE001 - gone meanwhile
        return False


@pytest.mark.timeout(600)
# The example's agent and torchrun with its ranks: CI's second call (the agent leaving
# with its parent or when idle: the tests above, without torchrun).
@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_example_never_leaves_its_agent_running(tmp_path: Path, how: signal.Signals) -> None:
    """``examples/memory_tier.py`` stopped mid-run (SIGTERM, as a scheduler stops a job;
    SIGKILL): its agent (and its ranks) are gone soon after."""
    launcher = subprocess.Popen(
        [sys.executable, str(ROOT + "/examples/memory_tier.py"), "--out", str(tmp_path), "--steps", "400"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=child_env(),
    )
    try:
        assert launcher.stdout is not None
        line = launcher.stdout.readline()
        assert "listening" in line, line
        job = line.split(" job ")[1].split()[0]
        agent_pid = int(line.rsplit("pid ", 1)[1])
        start = ParentProcess.of(agent_pid).start
        time.sleep(2.0)  # torchrun and its ranks start
        launcher.send_signal(how)
        launcher.wait(60)
        assert _gone(agent_pid, start, 60), "the agent outlived its launcher"
        deadline = time.monotonic() + 60
        while _job_processes(job) and time.monotonic() < deadline:
            time.sleep(0.1)
        if how == signal.SIGTERM:  # (SIGKILL: torchrun's ranks are not this test's subject)
            assert not _job_processes(job)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        if launcher.stdout is not None:
            launcher.stdout.close()


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_info_log_is_a_summary_not_a_line_per_snapshot(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, "async_stager.agent")
    with short_base() as base:
        agent = Agent("quiet", max_bytes=1 << 28, base=base)
        async with anyio.create_task_group() as tg:
            await tg.start(agent.serve)
            tier = MemoryTier(AgentClient("quiet", base=base, timeout=30))
            tier.open(tg)
            for step in range(1, 9):
                assert await tier.save(state(step), step)
            await tier.wait()
            assert tier.stats.saved == 8
            await tier.aclose()
            await agent.stop()
    records = [r for r in caplog.records if r.name == "async_stager.agent" and "holding rank" in r.message]
    assert len(records) == 8 and all(r.levelno == logging.DEBUG for r in records)
    info = [r for r in caplog.records if r.name == "async_stager.agent" and r.levelno >= logging.INFO]
    assert sum("accepted" in r.message for r in info) == 1, [r.message for r in info]
