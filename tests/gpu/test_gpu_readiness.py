"""scripts/gpu_check.sh cannot rot: its dry run on the CPU, as CI runs it.

Every step runs: pytest with its JUnit counting, the bench with its summary row, and
steps 3-11 on the simulated device (``GPU_CHECK_DEVICE=sim``: the same logic as on a
GPU), the table and JSON under $OUT; with trio, uvloop, pytest-asyncio, hypothesis and
matplotlib made unimportable, as on the GPU machine.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"

# A hang guard, not a speed check: the dry run starts several Python processes and took
# 105 s beside a loaded suite on 2 cores (49 s quiet), 319 s at a load average of 10-18
# once every step ran on the simulated device; GPU_CHECK_SLACK=4 stretches its steps.
pytestmark = pytest.mark.timeout(900)


@pytest.mark.slow  # a dozen Python processes (each step its own): CI's second call
@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash")
def test_gpu_check_dry_run(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "OUT": str(tmp_path),
        "PYTHON": sys.executable,
        "GPU_CHECK_DEVICE": "sim",
        # Hang guards for a loaded CI machine: each step starts Python and torch.
        "GPU_CHECK_SLACK": "4",
        "GPU_CHECK_SCALE": "0.0005",
        "GPU_CHECK_RUNS": "1",
        "GPU_CHECK_TESTS": "tests/gpu/test_cuda.py",
        "GPU_CHECK_WORKLOADS": "fresh",
        "GPU_CHECK_BENCH_ARGS": "--no-all-threads",
        "GPU_CHECK_BLOCK": "trio uvloop pytest_asyncio hypothesis matplotlib",
    }
    proc = subprocess.run(
        ["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=840, check=False
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    summary = json.loads((tmp_path / "summary.json").read_text())
    rows = {r["step"]: r for r in summary["rows"]}
    assert summary["failed"] is False
    assert rows["pytest (cuda + ordering)"]["result"] == "ok"
    assert "0 CUDA tests ran" in rows["pytest (cuda + ordering)"]["detail"]
    bench = next(r for name, r in rows.items() if name.startswith("bench (cpu"))
    assert bench["result"] == "ok" and "lag p99" in bench["detail"], bench
    steps = [
        r
        for name, r in rows.items()
        if name not in ("requirements", "pytest (cuda + ordering)") and not name.startswith("bench")
    ]
    assert len(steps) == 9 and all(r["result"] == "ok" for r in steps), steps
    # The simulated device's modes: CPU leaves through the host copier, pooled streams
    # kept by parallel budgeted saves.
    assert "CPU leaf by the host copier True" in rows["side-stream snapshot"]["detail"]
    assert "no stream drawn again" in rows["budgeted pipeline"]["detail"]
    assert rows["requirements"]["result"] == "ok", rows["requirements"]
    # At most 8 files come back from a device run: the table, one JSON, the logs in one
    # archive.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs.tar.gz", "summary.json", "summary.txt"]
    assert summary["finished"] is True
    with tarfile.open(tmp_path / "logs.tar.gz") as tar:
        logs = {m.name.removeprefix("./"): m for m in tar.getmembers() if m.isfile()}
        env_txt = tar.extractfile(logs["env.txt"]).read().decode()  # type: ignore[union-attr]
    for blocked in ("trio", "uvloop", "pytest_asyncio", "hypothesis", "matplotlib"):
        assert f"module {blocked}: no" in env_txt
    assert "module sniffio" not in env_txt
    for name in (
        "pytest.txt",
        "pytest.xml",
        "cuda_tests.txt",
        "bench_cpu.txt",
        "bench_cpu.json",
        "checks.txt",
    ):
        assert name in logs, (name, sorted(logs))
    # One table, last in the output; the same table in summary.txt.
    assert out.count("step                         result") == 1
    assert "overall: ok" in (tmp_path / "summary.txt").read_text()


def test_gpu_check_header_total_matches_its_bounds() -> None:
    text = SCRIPT.read_text()
    stated = int(re.search(r"the bounds add up to (\d+) s", text).group(1))  # type: ignore[union-attr]
    bounds = [int(v) for v in re.findall(r"^B_[A-Z]+=(\d+)$", text, re.M)]
    bounds += [int(v) for v in re.findall(r'^    "[^"|]+\|(\d+)\|\w+"$', text, re.M)]
    assert len(bounds) == 4 + 9, bounds
    assert sum(bounds) == stated <= 300, (sum(bounds), stated)
    # Each step's bound in the header's list is the one the script runs with.
    header = text.split("set -uo pipefail")[0]
    listed = [
        int(m.group(1))
        for line in header.splitlines()
        if "add up to" not in line and (m := re.search(r" (\d+) s$", line))
    ]
    assert sorted(listed) == sorted(bounds), (listed, bounds)


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash")
def test_gpu_check_installs_what_is_missing_from_the_extras(tmp_path: Path) -> None:
    # A machine with only torch: every requirement of the package and the gpu-check
    # extra whose module is missing is handed to pip, from the carried wheels/ folder.
    log = tmp_path / "pip_args.txt"
    fake_pip = tmp_path / "pip"
    fake_pip.write_text(f'#!/usr/bin/env bash\necho "$@" >> {log}\n')
    fake_pip.chmod(0o755)
    env = {
        **os.environ,
        "OUT": str(tmp_path / "out"),
        "PYTHON": sys.executable,
        "GPU_CHECK_PIP": str(fake_pip),
        "GPU_CHECK_ONLY": "requirements",
        "GPU_CHECK_BLOCK": "xxhash pytest_timeout",
    }
    proc = subprocess.run(
        ["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=100, check=False
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr  # still missing: the fake pip installs nothing
    args = log.read_text().split()
    assert args[0] == "install" and "xxhash>=3.0" in args and "pytest-timeout>=2.3" in args, args
    assert "numpy>=1.24" not in args and not any(a.startswith("torch") for a in args), args
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    (req,) = summary["rows"]
    assert req["step"] == "requirements" and "still missing xxhash>=3.0 pytest-timeout>=2.3" in req["detail"]


def test_dcp_writer_for_host_data_never_syncs_a_stream(tmp_path: Path) -> None:
    # DCP's default loader synchronizes the current CUDA stream every
    # per_thread_copy_ahead bytes; 0 selects the serial loader, which needs none.
    from torch.distributed.checkpoint import FileSystemWriter

    from async_stager._dcp.blocking import host_writer

    w = host_writer(None, tmp_path / "ckpt")
    assert isinstance(w, FileSystemWriter) and w.per_thread_copy_ahead == 0
    mine = FileSystemWriter(tmp_path / "other")
    assert host_writer(mine, tmp_path / "ckpt") is mine  # the caller's own is kept
    assert host_writer(None, "s3://bucket/ckpt") is None  # left to DCP
    assert host_writer(None, None) is None
