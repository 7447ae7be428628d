"""One rank of a 2-rank gloo job SIGKILLed at points in staging, writing and
committing, then the job restarted (at 2 ranks, and at 1: DCP reshards): every restart
restores the newest committed checkpoint, which verifies (``fallback=False``), and its
state is bit-exact with the state at that step. The survivor of a kill must end on its
own (a collective with the dead rank times out); the whole process group is killed in
any case. A short chain runs by default; the long one (13 points) is a stress run.
See crash_child_dist.py for the kill points."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from async_stager._cli.main import main as cli_main

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).resolve().parent / "crash_child_dist.py"

#: (kill point, rank killed, world size of the run).
SHORT = [("write_item:2", 1, 2), ("rename:2", 0, 2), ("lease:3", 0, 2)]
LONG = [
    ("lease:2", 1, 2),
    ("write_item:1", 0, 2),
    ("write_item:5", 1, 2),
    ("fsync:3", 0, 2),
    ("fsync:4", 1, 2),
    ("gather:2", 1, 2),
    ("gather:3", 0, 2),
    ("broadcast:2", 1, 2),
    ("rename:1", 0, 2),
    ("replace:1", 0, 2),
    ("rmtree:1", 0, 2),
    ("lease:4", 0, 1),
    ("write_item:3", 1, 2),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def run_job(directory: Path, spec: str, kill_rank: int, world: int) -> list[tuple[int, str]]:
    """Start ``world`` ranks, each in its own session; wait for all (killing every
    group left after the deadline). Returns each rank's (return code, stdout)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    port = str(_free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(CHILD), str(directory), str(r), str(world), port, spec, str(kill_rank)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for r in range(world)
    ]
    deadline = time.monotonic() + 120
    out: list[tuple[int, str]] = []
    try:
        for p in procs:
            try:
                stdout, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                stdout, _ = p.communicate()
                raise AssertionError(f"{spec}: a rank hung\n{stdout}") from None
            out.append((p.returncode, stdout))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return out


def chain(tmp_path: Path, points: list[tuple[str, int, int]]) -> None:
    directory = tmp_path / "ckpt"
    kills = 0
    restored: list[int] = []
    for spec, kill_rank, world in [*points, ("none", 0, 2), ("none", 0, 1)]:
        ranks = run_job(directory, spec, kill_rank, world)
        steps = set()
        for _rc, stdout in ranks:
            first = next((ln for ln in stdout.splitlines() if ln.startswith("restored ")), None)
            assert first is not None, f"{spec}: a rank did not restore\n{stdout}"
            _, step, ok = first.split()
            assert ok == "OK", f"{spec}: restored step {step} is not bit-exact\n{stdout}"
            steps.add(step)
        assert len(steps) == 1, f"{spec}: ranks restored different steps {steps}"
        step = steps.pop()
        if step != "None":
            assert not restored or int(step) >= restored[-1], f"{spec}: went back to {step}"
            restored.append(int(step))
        rcs = [rc for rc, _ in ranks]
        if spec == "none":
            assert rcs == [0] * world, ranks
        else:
            if rcs[kill_rank] == -signal.SIGKILL:
                kills += 1
            # The survivor ended on its own: done before the kill came to a collective,
            # or failed on its dead peer; never hung (run_job would have raised).
            for r, (rc, stdout) in enumerate(ranks):
                if r != kill_rank:
                    assert rc == 0 or "done" not in stdout, (spec, r, rc, stdout)
        if directory.exists() and any(p.name.startswith("step-") for p in directory.iterdir()):
            assert cli_main(["verify", str(directory), "--newest"]) == 0, f"after {spec}"
    assert kills >= len(points) - 1, f"only {kills} of {len(points)} kill points were reached"
    assert restored and restored[-1] >= 5


@pytest.mark.slow  # five 2-rank jobs: CI's second call
@pytest.mark.timeout(600)  # a hang guard over five jobs of up to 120 s each
def test_one_rank_killed_in_each_phase_short(tmp_path: Path) -> None:
    chain(tmp_path, SHORT)


@pytest.mark.stress
@pytest.mark.timeout(1800)  # fifteen jobs
def test_one_rank_killed_at_thirteen_points(tmp_path: Path) -> None:
    chain(tmp_path, LONG)
