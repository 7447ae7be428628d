"""scripts/gpu_check.sh cannot rot: its dry run on the CPU, as CI runs it.

Every step runs: pytest with its JUnit counting, the bench with its summary row, and
steps 3-11 on the simulated device (``GPU_CHECK_DEVICE=sim``: the same logic as on a
GPU), the table and JSON under $OUT; with trio, uvloop, pytest-asyncio, hypothesis and
matplotlib made unimportable, as on the GPU machine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"

# A hang guard, not a speed check: the dry run starts several Python processes and took
# 105 s beside a loaded suite on 2 cores (49 s quiet), 319 s at a load average of 10-18
# once every step ran on the simulated device; GPU_CHECK_SLACK=4 stretches its steps.
pytestmark = pytest.mark.timeout(900)


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
        r for name, r in rows.items() if name != "pytest (cuda + ordering)" and not name.startswith("bench")
    ]
    assert len(steps) == 9 and all(r["result"] == "ok" for r in steps), steps
    env_txt = (tmp_path / "env.txt").read_text()
    for blocked in ("trio", "uvloop", "pytest_asyncio", "hypothesis", "matplotlib"):
        assert f"module {blocked}: no" in env_txt
    assert "module sniffio" not in env_txt
    for name in ("pytest.txt", "pytest.xml", "bench_cpu.txt", "bench_cpu.json", "summary.txt"):
        assert (tmp_path / name).is_file(), name
    # One table, last in the output.
    assert out.count("step                         result") == 1


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
