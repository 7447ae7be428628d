"""Every example in examples/ runs on the CPU with small sizes and does what it says: each
one ends by loading back what it saved (``torch.load``, ``dcp.load`` or
``Checkpointer.restore``, into fresh objects) and comparing the whole state bit for bit
with the trained one, and prints a line that says so; these tests assert that line, and
that a restore that loses part of the state makes the example fail."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

# Hang guards, not speed checks: each example starts Python (and torch) at least once and
# took up to 35 s beside a loaded suite on 2 cores; the inner subprocess timeouts fire
# first, with the output.
pytestmark = pytest.mark.timeout(300)

#: What every example verifies after its restore (AdamW's state names, sorted).
OPTIMIZER = "optimizer (exp_avg, exp_avg_sq, step, param_groups)"


def restored(step: int, *, scheduler: bool = False) -> str:
    """The line an example prints once its restore of ``step`` compared bit-exact."""
    if scheduler:
        return f"restored step {step}: model, {OPTIMIZER}, LR scheduler and step counter bit-exact"
    return f"restored step {step}: model, {OPTIMIZER} and step counter bit-exact"


def run_example(name: str, *args: str, timeout: float = 240) -> str:
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
        "fsdp_training.py",  # under torchrun: tests/docs/test_fsdp_example.py
        "node_budget.py",  # under torchrun: test_node_budget_example below
        "http_service.py",  # tests/docs/test_service_example.py
        "memory_tier.py",  # its own agent and torchrun: test_memory_tier_example below
    }
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


# The asyncio example in the default run, its trio twin in CI's second call.
@pytest.mark.parametrize(
    "name", ["asyncio_training.py", pytest.param("trio_training.py", marks=pytest.mark.slow)]
)
def test_training_examples(name: str, tmp_path: Path) -> None:
    out = run_example(name, "--steps", "30", "--every", "10", "--width", "16", "--out", str(tmp_path))
    assert "trained 30 steps" in out
    assert restored(30) in out.splitlines(), out
    saved = sorted(p.name for p in tmp_path.glob("step*.pt"))
    assert saved and "step30.pt" in saved
    last = torch.load(tmp_path / "step30.pt")
    assert last["step"] == 30 and float(last["optim"]["state"][0]["step"]) == 30.0


def test_dcp_async_save_example(tmp_path: Path) -> None:
    out = run_example("dcp_async_save.py", "--steps", "2", "--width", "32", "--out", str(tmp_path))
    assert restored(2) in out.splitlines(), out
    assert (tmp_path / "step2" / ".metadata").exists()


def test_budgeted_checkpoint_example(tmp_path: Path) -> None:
    out = run_example("budgeted_checkpoint.py", "--out", str(tmp_path), "--width", "256", "--budget-mib", "1")
    assert restored(6) in out.splitlines(), out
    peak = float(out.split("(peak ")[1].split(" MiB")[0])
    assert peak <= 1.0, out


@pytest.mark.slow  # torchrun, 2 ranks: CI's second call
def test_node_budget_example(tmp_path: Path) -> None:
    """Under torchrun, 2 ranks sharing one node budget smaller than their states: every
    save says its path, and every rank restores bit-exact."""
    import socket

    with socket.socket() as sock:  # a free port (torchrun's port 0 hangs the static rendezvous)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-W", "error", "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--master-port", str(port), str(EXAMPLES / "node_budget.py"), "--out", str(tmp_path)]
    cmd += ["--node-budget-mib", "8", "--width", "512"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    with subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as p:
        try:
            out, err = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # torchrun's agent and every rank
            out, err = p.communicate()
            raise AssertionError(f"torchrun timed out:\n{out}{err}") from None
    assert p.returncode == 0, out + err
    lines = out.splitlines()
    for rank in (0, 1):
        assert f"rank {rank}: restored step 6 bit-exact" in lines, out
        assert any(line.startswith(f"rank {rank}: step 6 ") for line in lines), out


def test_writer_process_example(tmp_path: Path) -> None:
    out = run_example("writer_process.py", "--steps", "2", "--width", "32", "--out", str(tmp_path))
    assert restored(2) in out.splitlines(), out
    assert (tmp_path / "step2.pt").exists()


# Run in the example's process before it starts: a restore that silently drops the
# optimizer's state (the defect issue 22 fixed in the Checkpointer's DCP format).
_DROP_OPTIMIZER_STATE = """
import runpy, sys, torch
load = torch.optim.Optimizer.load_state_dict
def dropping(self, state_dict):
    return load(self, {**state_dict, "state": {}})
torch.optim.Optimizer.load_state_dict = dropping
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_example_fails_when_restore_drops_optimizer_state(tmp_path: Path) -> None:
    """The check is not vacuous: the budgeted example (Checkpointer, DCP format) exits
    non-zero naming the optimizer's state when the restore loses it."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [
        sys.executable,
        "-W",
        "error",
        "-c",
        _DROP_OPTIMIZER_STATE,
        str(EXAMPLES / "budgeted_checkpoint.py"),
    ]
    cmd += ["--steps", "2", "--every", "1", "--width", "64", "--layers", "1", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0, proc.stdout
    assert "state.optim.state: keys missing" in proc.stderr, proc.stderr
    assert "bit-exact" not in proc.stdout


def orchestrate(out: Path) -> tuple[str, str]:
    """Run examples/orchestrator.py until its first periodic checkpoint, SIGTERM it and
    return (what it printed before the signal, after it); asserts exit status 0."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-W", "error", str(EXAMPLES / "orchestrator.py")]
    cmd += ["--out", str(out), "--interval", "0.1", "--deadline", "20", "--width", "16"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:  # wait until a periodic checkpoint was written
            lines.append(line)
            if line.startswith("saved step"):
                break
        proc.send_signal(signal.SIGTERM)
        rest, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, f"{''.join(lines)}{rest}\n{err}"
    return "".join(lines), rest


def final_step(rest: str) -> int:
    final = [ln for ln in rest.splitlines() if ln.startswith("final step")]
    assert final, rest
    return int(final[0].split()[2])


@pytest.mark.slow  # two runs of the orchestrator, each stopped by SIGTERM: CI's second call
@pytest.mark.timeout(600)  # two runs of the orchestrator
def test_orchestrator_final_checkpoint_on_sigterm_then_resume(tmp_path: Path) -> None:
    _, rest = orchestrate(tmp_path)
    step = final_step(rest)
    assert restored(step, scheduler=True) in rest.splitlines(), rest
    assert (tmp_path / "latest").read_text().strip() == f"step-{step:08d}"
    ckpt = torch.load(tmp_path / f"step-{step:08d}" / "state.pt")
    assert ckpt["step"] == step and step > 0
    assert ckpt["sched"]["last_epoch"] == step
    assert not list(tmp_path.glob(".tmp-*"))

    # A restart resumes from that final step, trains on and verifies its own final one.
    before, rest = orchestrate(tmp_path)
    assert f" at step {step}\n" in before, before
    again = final_step(rest)
    assert again > step
    assert restored(again, scheduler=True) in rest.splitlines(), rest
    assert (tmp_path / "latest").read_text().strip() == f"step-{again:08d}"


@pytest.mark.slow  # an agent and two torchrun attempts of 2 ranks: CI's second call
@pytest.mark.timeout(600)  # two torchrun attempts of 2 ranks: 85 s beside a loaded suite
def test_memory_tier_example(tmp_path: Path) -> None:
    """The node agent, then torchrun with 2 ranks: rank 1 SIGKILLs itself at step 7,
    torchrun restarts both, both resume from the agent's memory at step 7, and the
    resumed run ends bit-exact with an uninterrupted one."""
    out = run_example("memory_tier.py", "--out", str(tmp_path), "--steps", "9", "--kill-at", "7")
    lines = out.splitlines()
    for rank in (0, 1):
        assert f"rank {rank} attempt 1: resumed from step 7 (memory)" in lines, out
        assert any(
            line.startswith(f"rank {rank}: restored step 9: ") and "matches an uninterrupted" in line
            for line in lines
        ), out
