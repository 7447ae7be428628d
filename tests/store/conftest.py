"""A real S3-protocol server for the store tests: moto's server mode (``moto[server]``,
in the ``test`` extra), started by the tests themselves on a free loopback port, once
per test process (each pytest-xdist worker has its own), with the fault proxy
(s3proxy.py) in front of it. CI starts it the same way: nothing to run beforehand.

Each test gets its own bucket, and the standard AWS environment variables point the
client at the proxy (``AWS_ENDPOINT_URL``, test credentials, no config files, no
instance metadata), as a user's environment would point it at their store.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.store.s3proxy import FaultProxy

ACCESS_KEY = "AKIASTORETESTS000001"
SECRET_KEY = "store-tests-secret"
#: Seconds the server may take to start (a loaded machine imports moto slowly).
START_TIMEOUT = 90.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_moto(log: Path) -> tuple[subprocess.Popen[bytes], int]:
    for _ in range(3):
        port = _free_port()
        out = open(log, "ab")  # noqa: SIM115 - the server's for its whole life
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        out.close()
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return proc, port
            except OSError:
                time.sleep(0.1)
        proc.kill()
        proc.wait()
    raise RuntimeError(f"moto's S3 server did not start; its output: {log}")


@pytest.fixture(scope="session")
def moto_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    pytest.importorskip("aiobotocore", reason="the s3 extra: pip install -e '.[test]'")
    pytest.importorskip("moto.server", reason="moto[server]: pip install -e '.[test]'")
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    proc, port = _start_moto(log)
    try:
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def fault_proxy(moto_port: int) -> Iterator[FaultProxy]:
    proxy = FaultProxy(moto_port).start()
    try:
        yield proxy
    finally:
        proxy.stop()


@pytest.fixture
def proxy(fault_proxy: FaultProxy) -> Iterator[FaultProxy]:
    """The fault proxy, with no rule at the start and none left after the test."""
    fault_proxy.clear()
    yield fault_proxy
    fault_proxy.clear()


@pytest.fixture
def s3_env(proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FaultProxy:
    """The standard AWS variables, as a user sets them, pointing at the proxy."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return proxy


_ADMIN: list[Any] = []


def admin_client(port: int):  # type: ignore[no-untyped-def]
    """A plain botocore client straight to moto (not through the proxy): set-up and
    checks that no fault may touch."""
    import botocore.session

    if not _ADMIN:
        _ADMIN.append(botocore.session.get_session())
    return _ADMIN[0].create_client(
        "s3",
        endpoint_url=f"http://127.0.0.1:{port}",
        region_name="us-east-1",
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
    )


@pytest.fixture
def bucket(moto_port: int, s3_env: FaultProxy) -> Iterator[str]:
    """A new bucket; emptied (objects and unfinished uploads) and removed after."""
    name = f"t-{uuid.uuid4().hex[:20]}"
    client = admin_client(moto_port)
    client.create_bucket(Bucket=name)
    yield name
    for up in client.list_multipart_uploads(Bucket=name).get("Uploads", []):
        client.abort_multipart_upload(Bucket=name, Key=up["Key"], UploadId=up["UploadId"])
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
        for item in page.get("Contents", []):
            client.delete_object(Bucket=name, Key=item["Key"])
    client.delete_bucket(Bucket=name)
    client.close()


@pytest.fixture(params=["s3", "folder"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Each test of the Store interface runs on both backends: the real S3 server (an
    s3:// URL, through the fault proxy) and a folder (a file:// URL)."""
    if request.param == "s3":
        name = request.getfixturevalue("bucket")
        return f"s3://{name}/run"
    return (tmp_path / "store").as_uri()
