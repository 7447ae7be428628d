"""The memory tier keeps its promise for the job (issue 41, section 1).

A 2-rank gloo job (``job_kill_child.py``) snapshots every step to the node agent and
writes nothing to disk; it is SIGKILLed at random moments: one rank (the other then
fails or is killed), every rank at once, or one rank in the middle of a memory commit.
Each restart restores on both ranks the same step, from memory, bit-exact with a run
of the same steps never interrupted (the child checks), and loses at most one step
against the newest step whose ``save()`` had returned on every rank. Two schedules: in
``lockstep`` the ranks all-reduce every step (data-parallel training); in ``drift``
rank 1 is slower and nothing ties the ranks, so rank 0 runs ahead as far as the tier
lets it. A short chain runs by default; many seeds are a stress run.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.tier.helpers_tier import agent_process, child_env, short_base

CHILD = Path(__file__).resolve().parent / "job_kill_child.py"
WORLD = 2
#: Seconds a rank may take to start and restore (a hang guard: torch's import and the
#: gloo rendezvous on a loaded machine).
START = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Rank:
    proc: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None

    def read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.strip())

    def restored(self) -> tuple[int | None, str] | None:
        for line in self.lines:
            if line.startswith("RESTORED"):
                _, step, where = line.split()
                return (None if step == "None" else int(step)), where
        return None

    def saved(self) -> list[int]:
        return [int(line.split()[1]) for line in self.lines if line.startswith("SAVED")]


def _kill(rank: Rank) -> None:
    if rank.proc.poll() is None:
        try:
            os.killpg(rank.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _round(directory: Path, base: str, rng: random.Random, how: str, mode: str) -> list[Rank]:
    """Start the job, let it restore, kill it as ``how`` says; every rank dead on return."""
    port = str(_free_port())
    victim = rng.randrange(WORLD)
    kill_after = rng.randint(1, 8) if how == "mid-commit" else 0
    ranks = []
    env = dict(child_env(), OMP_NUM_THREADS="1")
    for i in range(WORLD):
        args = [str(directory), "kill", base, str(i), str(WORLD), port, mode]
        args.append(str(kill_after if i == victim else 0))
        proc = subprocess.Popen(
            [sys.executable, str(CHILD), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
            start_new_session=True,
        )
        rank = Rank(proc)
        rank.reader = threading.Thread(target=rank.read, daemon=True)
        rank.reader.start()
        ranks.append(rank)
    try:
        deadline = time.monotonic() + START
        while not all(r.restored() for r in ranks):
            dead = [r for r in ranks if r.proc.poll() is not None and not r.restored()]
            assert not dead and time.monotonic() < deadline, (
                f"a rank did not restore: {[r.lines for r in ranks]}"
            )
            time.sleep(0.01)
        if how == "one":
            time.sleep(rng.uniform(0.0, 0.8))
            _kill(ranks[victim])
        elif how == "every":
            time.sleep(rng.uniform(0.0, 0.8))
            for r in ranks:
                _kill(r)
        elif how == "mid-commit":
            ranks[victim].proc.wait(START)
        # The survivors fail on their own (a collective with the dead rank) or are killed.
        end = time.monotonic() + 2.0
        while any(r.proc.poll() is None for r in ranks) and time.monotonic() < end:
            time.sleep(0.02)
    finally:
        for r in ranks:
            _kill(r)
            r.proc.wait(30)
            assert r.reader is not None
            r.reader.join(30)
            assert r.proc.stdout is not None
            r.proc.stdout.close()
    for r in ranks:
        assert not any(line.startswith("MISMATCH") for line in r.lines), r.lines
    return ranks


def chain(directory: Path, seed: int, rounds: list[tuple[str, str]]) -> list[str]:
    """Run ``rounds`` (how to kill, schedule) one after the other on one agent, then a
    last restart; checks every restart (see the module doc). Returns a line per round."""
    rng = random.Random(seed)
    report = []
    newest: int | None = None  # the newest step whose save had returned on every rank
    with short_base() as base, agent_process("kill", base, "--max-bytes", "1GiB"):
        for how, mode in [*rounds, ("none", "lockstep")]:
            ranks = _round(directory, base, rng, how, mode)
            restored = [r.restored() for r in ranks]
            steps = {got[0] for got in restored if got is not None}
            assert len(steps) == 1, f"the ranks restored different steps: {restored}"
            step = steps.pop()
            if newest is not None and newest > 1:  # (losing step 1 of 1 is losing one step)
                assert step is not None and step >= newest - 1, (
                    f"seed {seed}: restored {restored} after every rank had saved step {newest}"
                )
                assert all(got is not None and got[1] == "memory" for got in restored), restored
            last = [max([step or 0, *r.saved()]) for r in ranks]
            report.append(f"{how}/{mode}: restored {step}, then saved up to {last}")
            newest = min(last)
    return report


@pytest.mark.slow  # four 2-rank jobs beside an agent: CI's second call
@pytest.mark.timeout(300)
def test_kills_of_one_rank_every_rank_and_mid_commit(tmp_path: Path) -> None:
    chain(tmp_path, 41, [("one", "lockstep"), ("every", "drift"), ("mid-commit", "drift")])


@pytest.mark.stress
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("seed", range(32))
def test_kills_many_seeds(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    rounds = [
        (rng.choice(["one", "every", "mid-commit"]), rng.choice(["lockstep", "drift"])) for _ in range(4)
    ]
    for line in chain(tmp_path, seed, rounds):
        print(f"seed {seed}: {line}")
