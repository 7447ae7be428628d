"""SIGKILL at points in every phase of a checkpoint (staging, writing, committing), then
restart: each restart restores the newest committed checkpoint, which verifies
(``fallback=False`` in the child) and is bit-exact with an uninterrupted run at that
step. A short chain runs by default; the long one (two formats, 30 kill points) is a
stress run. See crash_child.py for the kill points."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import crash_child

from async_stager._cli.main import main as cli_main

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).resolve().parent / "crash_child.py"

SHORT = ["lease:3", "write_item:7", "fsync:9", "rename:2"]
LONG = [
    *("lease:2", "lease:5"),
    *(f"write_item:{k}" for k in (1, 4, 9, 15)),
    *(f"digest:{k}" for k in (1, 6, 11)),
    *(f"fsync:{k}" for k in (1, 3, 5, 8, 12, 17)),
    *(f"rename:{k}" for k in (1, 2, 3, 4, 6)),
    *(f"replace:{k}" for k in (1, 2)),
    *(f"rmtree:{k}" for k in (1, 2, 3)),
]
TORCH_LONG = [
    "lease:3",
    "torch_save:2",
    "digest:3",
    "fsync:2",
    "fsync:4",
    "rename:1",
    "rename:3",
    "replace:1",
]


def run_child(directory: Path, fmt: str, spec: str, run: int = 8) -> tuple[int, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", CRASH_CHILD_RUN=str(run))
    proc = subprocess.run(
        [sys.executable, str(CHILD), str(directory), fmt, spec],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode in (0, -9), f"{spec}: rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.returncode, proc.stdout


def chain(tmp_path: Path, fmt: str, points: list[str], run: int = 8) -> None:
    ref = crash_child.reference()
    directory = tmp_path / "ckpt"
    kills = 0
    restored_steps = []
    for spec in [*points, "none"]:
        rc, out = run_child(directory, fmt, spec, run)
        first = out.splitlines()[0].split()
        assert first[0] == "restored", out
        if first[1] != "None":
            step, dig = int(first[1]), int(first[2])
            assert dig == ref[step], f"before {spec}: step {step} restored, not bit-exact"
            restored_steps.append(step)
        if rc == -9:
            kills += 1
            if any(p.name.startswith("step-") for p in directory.iterdir()):
                assert cli_main(["verify", str(directory), "--newest"]) == 0, f"after {spec}"
        else:
            assert "done" in out
    assert kills >= len(points) - 1, f"only {kills} of {len(points)} kill points were reached"
    assert restored_steps, "no restart found a checkpoint"


# Five processes: CI's second call. The default run kills a saving child at random
# points (test_checkpointer_model.py's crash machine).
@pytest.mark.slow
@pytest.mark.timeout(600)  # a hang guard, not a speed check (see CONTRIBUTING.md, "Tests")
def test_kill_at_points_in_each_phase_short(tmp_path: Path) -> None:
    chain(tmp_path, "dcp", SHORT)


#: Kill points of an incremental chain: its links, its writes, its commit and retention.
INCREMENTAL_SHORT = ["link:2", "rmtree:1"]
INCREMENTAL_LONG = [
    *(f"link:{k}" for k in (1, 2, 3)),
    *(f"write_item:{k}" for k in (2, 5, 9)),
    *(f"fsync:{k}" for k in (2, 6, 11)),
    *(f"rename:{k}" for k in (1, 2, 3, 5)),
    *(f"replace:{k}" for k in (1, 2)),
    *(f"rmtree:{k}" for k in (1, 2, 3)),
]


@pytest.mark.timeout(600)  # a hang guard, not a speed check (see CONTRIBUTING.md, "Tests")
def test_kill_an_incremental_save_at_its_links_and_its_retention(tmp_path: Path) -> None:
    """Incremental saves (a frozen tensor referenced): killed while it links the
    previous commit's data and while retention deletes a step whose data a kept step
    still links; each restart restores a whole step, the frozen tensor bit-exact."""
    chain(tmp_path, crash_child.INCREMENTAL, INCREMENTAL_SHORT, run=4)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kill_an_incremental_save_at_points_in_each_phase(tmp_path: Path) -> None:
    chain(tmp_path, crash_child.INCREMENTAL, INCREMENTAL_LONG)


@pytest.mark.stress
@pytest.mark.timeout(900)
def test_kill_at_thirty_points_dcp(tmp_path: Path) -> None:
    chain(tmp_path, "dcp", LONG)


@pytest.mark.stress
@pytest.mark.timeout(600)
def test_kill_at_points_torch_format(tmp_path: Path) -> None:
    chain(tmp_path, "torch", TORCH_LONG)
