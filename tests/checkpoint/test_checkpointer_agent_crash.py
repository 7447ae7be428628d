"""Random SIGKILLs of a trainer saving to the memory agent (issue 38).

The trainer (``agent_crash_child.py``) saves a snapshot to the agent every step and to
its folder every 5th; it is SIGKILLed at a random moment (mid-stage, mid-commit,
mid-write), then restarted: it restores (from memory when every byte verifies, else
the folder), checks the state is bit-exact what was saved at that step, and goes on.
Each restart loses at most one step: a ``"wait"`` save returns only after the previous
snapshot was committed. A short chain by default; a long one as a stress run.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.tier.helpers_tier import agent_process, child_env, short_base

CHILD = Path(__file__).resolve().parent / "agent_crash_child.py"


def _run_until_killed(directory: Path, base: str, delay: float) -> tuple[int | None, int]:
    """Start the trainer, let it save for ``delay`` seconds after its restore, SIGKILL
    it. Returns (the step it restored, the last step whose save returned)."""
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), str(directory), "crash", base],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(child_env(), OMP_NUM_THREADS="1"),
    )
    restored: int | None = None
    last = 0
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("RESTORED"), (line, proc.stderr.read() if proc.stderr else "")
        word = line.split()[1]
        restored = None if word == "None" else int(word)
        last = restored or 0
        os.set_blocking(proc.stdout.fileno(), False)
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        assert proc.returncode == -signal.SIGKILL, proc.stderr.read() if proc.stderr else ""
        for out in (proc.stdout.read() or "").splitlines():
            if out.startswith("SAVED"):
                last = int(out.split()[1])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for f in (proc.stdout, proc.stderr):
            if f is not None:
                f.close()
    return restored, last


def _chain(tmp_path: Path, kills: int, seed: int) -> None:
    rng = random.Random(seed)
    with short_base() as base, agent_process("crash", base):
        last = 0
        for _ in range(kills):
            restored, saved = _run_until_killed(tmp_path, base, rng.uniform(0.05, 1.0))
            # (The child checked the restored state bit-exact against that step.)
            if last:
                assert restored is not None and restored >= last - 1, (restored, last)
            last = saved
        restored, _ = _run_until_killed(tmp_path, base, 0.0)
        if last:
            assert restored is not None and restored >= last - 1, (restored, last)


@pytest.mark.slow  # an agent and four trainers killed: CI's second call
@pytest.mark.timeout(240)
def test_random_sigkills_restore_bit_exact(tmp_path: Path) -> None:
    _chain(tmp_path, 3, seed=38)


@pytest.mark.stress
@pytest.mark.timeout(1800)
def test_random_sigkills_restore_bit_exact_long(tmp_path: Path) -> None:
    _chain(tmp_path, 25, seed=380)
