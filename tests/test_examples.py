"""Every example in examples/ runs on the CPU with small sizes and does what it says."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

pytestmark = pytest.mark.timeout(60)


def run_example(name: str, *args: str, timeout: float = 45) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-W", "error", str(EXAMPLES / name), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_every_example_is_tested() -> None:
    tested = {
        "asyncio_training.py",
        "trio_training.py",
        "orchestrator.py",
        "dcp_async_save.py",
        "writer_process.py",
        "budgeted_checkpoint.py",
        "fsdp_training.py",  # under torchrun: tests/test_fsdp_example.py
    }
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


@pytest.mark.parametrize("name", ["asyncio_training.py", "trio_training.py"])
def test_training_examples(name: str, tmp_path: Path) -> None:
    out = run_example(name, "--steps", "30", "--every", "10", "--width", "16", "--out", str(tmp_path))
    assert "trained 30 steps" in out
    saved = sorted(p.name for p in tmp_path.glob("step*.pt"))
    assert saved and "step30.pt" in saved
    last = torch.load(tmp_path / "step30.pt")
    assert last["step"] == 30 and float(last["optim"]["state"][0]["step"]) == 30.0


def test_dcp_async_save_example(tmp_path: Path) -> None:
    out = run_example("dcp_async_save.py", "--steps", "2", "--width", "32", "--out", str(tmp_path))
    assert "loaded step 2: bit-exact" in out
    assert (tmp_path / "step2" / ".metadata").exists()


def test_budgeted_checkpoint_example(tmp_path: Path) -> None:
    out = run_example("budgeted_checkpoint.py", "--out", str(tmp_path), "--width", "256", "--budget-mib", "1")
    assert "restored step 6: bit-exact" in out
    peak = float(out.split("(peak ")[1].split(" MiB")[0])
    assert peak <= 1.0, out


def test_writer_process_example(tmp_path: Path) -> None:
    out = run_example("writer_process.py", "--steps", "2", "--width", "32", "--out", str(tmp_path))
    assert "bit-exact" in out and (tmp_path / "step2.pt").exists()


def test_orchestrator_final_checkpoint_on_sigterm(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-W", "error", str(EXAMPLES / "orchestrator.py")]
    cmd += ["--out", str(tmp_path), "--interval", "0.1", "--deadline", "20", "--width", "16"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:  # wait until a periodic checkpoint was written
            lines.append(line)
            if line.startswith("saved step"):
                break
        proc.send_signal(signal.SIGTERM)
        rest, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, f"{''.join(lines)}{rest}\n{err}"
    final = [ln for ln in rest.splitlines() if ln.startswith("final step")]
    assert final, rest
    step = int(final[0].split()[2])
    assert (tmp_path / "latest").read_text().strip() == f"step-{step:08d}"
    ckpt = torch.load(tmp_path / f"step-{step:08d}" / "state.pt")
    assert ckpt["step"] == step and step > 0
    assert not list(tmp_path.glob(".tmp-*"))
