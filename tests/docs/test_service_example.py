"""examples/http_service.py: the service recipe's program, run as a user would.

``--self-test`` makes the example its own HTTP client: two saves asked for over HTTP
(one answered when taken, one when committed), the progress read as JSON while the
model trains in a thread, then SIGTERM to itself, a final checkpoint and a bit-exact
restore. A second test drives a running service from outside, with real requests, and
checks the handlers answer while the model trains and a write is in flight.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
EXAMPLE = ROOT / "examples" / "http_service.py"

pytestmark = pytest.mark.timeout(120)


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT))


def test_self_test_passes(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-W", "error", str(EXAMPLE), "--self-test", "--out", str(tmp_path)],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "save taken at step" in proc.stdout
    assert "restored step" in proc.stdout and "bit-exact" in proc.stdout, proc.stdout


def _request(port: int, method: str, path: str) -> dict[str, object]:
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200"), data
    result: dict[str, object] = json.loads(body)
    return result


def test_a_running_service_answers_from_outside(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-W", "error", str(EXAMPLE), "--out", str(tmp_path), "--width", "256"],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("listening on 127.0.0.1:"), line + proc.stderr.read() if proc.stderr else line
        port = int(line.rsplit(":", 1)[1])
        taken = _request(port, "POST", "/save")
        assert isinstance(taken["step"], int) and taken["step"] >= 1
        committed = _request(port, "POST", "/save?wait=1")
        stats = committed["committed"]
        assert isinstance(stats, dict) and stats["step"] == committed["step"]
        progress = _request(port, "GET", "/progress")
        assert isinstance(progress["status"], str) and isinstance(progress["in_flight"], list)
        last = progress["last"]
        assert isinstance(last, dict) and isinstance(last["step"], int) and last["step"] >= committed["step"]  # type: ignore[operator]
        steps = _request(port, "GET", "/steps")["steps"]
        assert isinstance(steps, list) and committed["step"] in steps
        with socket.create_connection(("127.0.0.1", port), timeout=60) as s:  # a garbled request
            s.sendall(b"nonsense\r\n\r\n")
            assert s.recv(100).startswith(b"HTTP/1.1 400")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out + err
    assert "committed" in out, out
    time.sleep(0)  # nothing else: the service exited by itself after the final checkpoint
