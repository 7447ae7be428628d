"""examples/fsdp_training.py under torchrun (gloo, CPU): rank 0 is SIGKILLed right after a
save was staged; the job resumes from the newest committed step, bit-exact (the full
state's CRC equals the one printed when that step was saved), at another world size.
The stress run adds a 2-rank resume that trains on (bit-exact with the first run's
later saves) and a 4-rank resume."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "fsdp_training.py"


def torchrun(nproc: int, out: Path, *args: str, killed: bool = False) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    with socket.socket() as sock:  # a free port (torchrun's port 0 hangs the static rendezvous)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd += ["--master-port", str(port), str(EXAMPLE), "--out", str(out), "--every", "2", "--digests", *args]
    # Its own session: on a timeout the whole group goes (torchrun's agent and every
    # rank), so no rank is left waiting on a dead peer after the test.
    with subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    ) as p:
        try:
            stdout, stderr = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            stdout, stderr = p.communicate()
            raise AssertionError(f"torchrun timed out:\n{stdout}{stderr}") from None
    proc = subprocess.CompletedProcess(cmd, p.returncode, stdout, stderr)
    if killed:
        assert proc.returncode != 0 and "SIGKILL" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    else:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def digests(out: str, kind: str) -> dict[int, str]:
    return {int(s): d for s, d in re.findall(rf"digest {kind} (\d+): (\w+)", out)}


def resumed_step(out: str) -> int | None:
    m = re.search(r"resumed from step (\w+)", out)
    assert m, out
    return None if m.group(1) == "None" else int(m.group(1))


@pytest.mark.slow  # two torchruns: CI's second call
@pytest.mark.timeout(600)  # hang guards: two torchruns, each up to 240 s
def test_fsdp_kill_then_resume_at_one_rank(tmp_path: Path) -> None:
    first = torchrun(2, tmp_path, "--steps", "6", "--kill-at", "6", killed=True)
    saved = digests(first, "at save")
    assert set(saved) == {2, 4, 6}
    after = torchrun(1, tmp_path, "--steps", "8")
    step = resumed_step(after)
    assert step in (4, 6)  # 6 if its commit beat the kill
    assert digests(after, "after resume")[step] == saved[step]
    line = "restored step 8: model, optimizer (exp_avg, exp_avg_sq, step, param_groups) and step counter bit-exact"
    assert line in after.splitlines(), after


@pytest.mark.stress
@pytest.mark.timeout(1200)
def test_fsdp_resume_same_world_trains_on_bit_exact_then_four_ranks(tmp_path: Path) -> None:
    reference = digests(torchrun(2, tmp_path / "ref", "--steps", "10"), "at save")
    first = torchrun(2, tmp_path / "run", "--steps", "10", "--kill-at", "6", killed=True)
    assert digests(first, "at save") == {k: v for k, v in reference.items() if k <= 6}
    again = torchrun(2, tmp_path / "run", "--steps", "10")
    step = resumed_step(again)
    assert step in (4, 6) and digests(again, "after resume")[step] == reference[step]
    assert {k: v for k, v in digests(again, "at save").items()} == {
        k: v for k, v in reference.items() if k > step
    }
    four = torchrun(4, tmp_path / "run", "--steps", "10")
    assert resumed_step(four) == 10 and digests(four, "after resume")[10] == reference[10]


@pytest.mark.stress
@pytest.mark.timeout(600)
def test_fsdp_rank_one_killed_then_resume(tmp_path: Path) -> None:
    first = torchrun(2, tmp_path, "--steps", "6", "--kill-at", "4", "--kill-rank", "1", killed=True)
    saved = digests(first, "at save")
    after = torchrun(2, tmp_path, "--steps", "6")
    step = resumed_step(after)
    assert step in (2, 4) and digests(after, "after resume")[step] == saved[step]
