"""Shared pieces of the memory tier's tests: short socket bases, an agent in a child
process, memfd counting."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@contextmanager
def short_base() -> Iterator[str]:
    """A fresh directory with a short path (Unix socket paths are at most 107 bytes)."""
    base = tempfile.mkdtemp(prefix="ast-", dir="/tmp")
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def memfds(pid: int | str = "self") -> int:
    """Descriptors of process ``pid`` that are memfds."""
    n = 0
    folder = f"/proc/{pid}/fd"
    for name in os.listdir(folder):
        try:
            if os.readlink(os.path.join(folder, name)).startswith("/memfd:"):
                n += 1
        except OSError:
            pass
    return n


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


@contextmanager
def agent_process(job: str, base: str, *extra: str, timeout: float = 60.0) -> Iterator[subprocess.Popen[str]]:
    """``python -m async_stager agent`` in a child, ready (its line printed); stopped
    (SIGTERM, then SIGKILL) at the end if still running."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "async_stager", "agent", "--job", job, "--dir", base, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout
        line = proc.stdout.readline()
        if "listening" not in line:
            err = proc.stderr.read() if proc.stderr else ""
            raise AssertionError(f"the agent did not start: {line!r} {err}")
        assert time.monotonic() < deadline
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for f in (proc.stdout, proc.stderr):
            if f is not None:
                f.close()


def state(seed: int, n: int = 4) -> dict[str, object]:
    """A small state dict: tensors, a view, a nested list, a plain value."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(256, 64, generator=g)
    return {
        "w": base,
        "view": base[3:7],
        "layers": [torch.randn(n, 33, generator=g), torch.arange(17, dtype=torch.int64) + seed],
        "step": seed,
    }
