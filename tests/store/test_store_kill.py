"""SIGKILL a writer mid-upload: no object is visible (an unfinished multipart upload,
or a folder's hidden upload file, is not an object), and a later ``list_uploads`` /
``abort_uploads`` finds and frees what it left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from async_stager._store.store import open_store
from tests.store.s3proxy import FaultProxy, Rule

pytestmark = [pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).resolve().parent / "kill_child.py"


def _kill_mid_upload(url: str, key: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), url, key, "40", "s3" if url.startswith("s3://") else "folder"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the child's own timeout: the test's hang guard
        assert line == b"PART\n", (line, proc.stderr.read() if proc.stderr else b"")
        proc.send_signal(signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(60)
        for f in (proc.stdout, proc.stderr):
            if f is not None:
                f.close()
    assert proc.returncode == -signal.SIGKILL


def test_sigkill_mid_upload_leaves_no_object_and_cleanup_frees_the_parts(
    store_url: str, fault_proxy: FaultProxy
) -> None:
    # S3: the parts after the first two wait at the server until the kill.
    fault_proxy.add(Rule("delay", method="PUT", path=r"partNumber=([3-9]|\d\d)\b", delay=60.0, times=20))
    store = open_store(store_url).blocking
    try:
        store.put("ckpt/step-1/data", b"committed before")
        _kill_mid_upload(store_url, "ckpt/step-2/data")
        fault_proxy.clear()
        # Nothing torn is visible: only the earlier object.
        assert [o.key for o in store.list_objects("ckpt/")] == ["ckpt/step-1/data"]
        assert store.head("ckpt/step-2/data") is None
        # What the writer left is found, and freed.
        stale = store.list_uploads("ckpt/")
        assert [u.key for u in stale] == ["ckpt/step-2/data"]
        assert store.abort_uploads(stale) == 1
        assert store.list_uploads("ckpt/") == []
        assert store.abort_uploads(stale) == 0  # twice: nothing left to abort
        assert store.get("ckpt/step-1/data") == b"committed before"
    finally:
        store.close()
