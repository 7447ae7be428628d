"""The Checkpointer on an object store (issue 44): ``Checkpointer("s3://bucket/run")``
against the real S3-protocol server (moto, through the fault proxy), on asyncio,
uvloop and trio: saves in both formats, keep-K, ``latest``, restore of the newest step
that verifies with fallback past a damaged one, a step saved again, the budget."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from async_stager import Checkpointer
from async_stager._checkpoint import store_place
from async_stager.errors import CheckpointError, IntegrityError, InvalidOptionError
from tests.store.conftest import admin_client
from tests.store.s3proxy import FaultProxy, Rule

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The saves' local scratch folder, per test."""
    monkeypatch.setenv("ASYNC_STAGER_SCRATCH", str(tmp_path / "scratch"))
    return tmp_path / "scratch"


def _state(v: float) -> dict[str, Any]:
    return {"w": torch.full((64, 64), v), "b": torch.arange(10, dtype=torch.bfloat16) + v, "n": int(v)}


def _keys(port: int, bucket: str, prefix: str = "run/") -> list[str]:
    client = admin_client(port)
    out = client.list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for o in out.get("Contents", []))


@pytest.mark.parametrize("fmt", ["dcp", "torch"])
async def test_save_keep_latest_restore(bucket: str, moto_port: int, scratch: Path, fmt: str) -> None:
    url = f"s3://{bucket}/run"
    async with Checkpointer(url, keep=2, format=fmt) as ckpt:  # type: ignore[arg-type]
        for step in (1, 2, 3):
            await ckpt.save(_state(float(step)), step=step)
        await ckpt.wait()
        assert ckpt.steps() == [2, 3]
        assert ckpt.last is not None and ckpt.last.path.startswith(f"s3://{bucket}/run/step-00000003.")
        state = _state(0.0)
        assert await ckpt.restore(state) == 3
        assert torch.equal(state["w"], torch.full((64, 64), 3.0)) and state["n"] == 3
    keys = _keys(moto_port, bucket)
    assert "run/latest" in keys
    commits = [k for k in keys if k.endswith("/COMMIT")]
    assert [k.split("/")[1][:13] for k in commits] == ["step-00000002", "step-00000003"]
    client = admin_client(moto_port)
    assert client.get_object(Bucket=bucket, Key="run/latest")["Body"].read() == b"step-00000003\n"
    # A new Checkpointer (another process would do the same) lists and restores them.
    async with Checkpointer(url, format=fmt) as again:  # type: ignore[arg-type]
        assert again.steps() == [2, 3]
        state = _state(0.0)
        assert await again.restore(state, step=2) == 2 and state["n"] == 2
    assert not any(p.name.startswith((".tmp-", ".read-")) for p in scratch.rglob("*"))
    # Closed: the store's connections and its I/O thread are gone.
    assert not [t.name for t in threading.enumerate() if t.name.startswith("async-stager-store")]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # (the loop: test_save_keep_latest_restore)
async def test_restore_falls_back_past_a_damaged_step(bucket: str, moto_port: int, scratch: Path) -> None:
    url = f"s3://{bucket}/run"
    async with Checkpointer(url, keep=3) as ckpt:
        for step in (1, 2):
            await ckpt.save(_state(float(step)), step=step)
        await ckpt.wait()
    client = admin_client(moto_port)
    data = [
        k for k in _keys(moto_port, bucket) if k.startswith("run/step-00000002.") and k.endswith(".distcp")
    ]
    body = bytearray(client.get_object(Bucket=bucket, Key=data[0])["Body"].read())
    body[len(body) // 2] ^= 0xFF
    client.put_object(Bucket=bucket, Key=data[0], Body=bytes(body))
    async with Checkpointer(url) as ckpt:
        state = _state(0.0)
        assert await ckpt.restore(state) == 1  # step 2 does not verify
        assert state["n"] == 1
        with pytest.raises(IntegrityError):
            await ckpt.restore(_state(0.0), step=2, fallback=False)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # (the loop: test_save_keep_latest_restore)
async def test_a_step_saved_again_replaces_it_and_old_objects_go_after_the_grace(
    bucket: str, moto_port: int, scratch: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"s3://{bucket}/run"
    async with Checkpointer(url, keep=1) as ckpt:
        await ckpt.save(_state(1.0), step=5)
        await ckpt.save(_state(2.0), step=5)
        await ckpt.wait()
        assert ckpt.steps() == [5]
        state = _state(0.0)
        assert await ckpt.restore(state) == 5 and state["n"] == 2
        prefixes = {k.split("/")[1] for k in _keys(moto_port, bucket) if k.startswith("run/step-")}
        assert len(prefixes) == 2  # the replaced save stays readable for the grace period
        monkeypatch.setattr(store_place, "RETIRE_GRACE", 0.0)
        await ckpt.save(_state(3.0), step=6)
        await ckpt.wait()
        assert ckpt.steps() == [6]
    prefixes = {k.split("/")[1] for k in _keys(moto_port, bucket) if k.startswith("run/step-")}
    assert len(prefixes) == 2 and all(p.startswith(("step-00000005", "step-00000006")) for p in prefixes)
    # step 5's newest save was retired by this commit (kept for the grace, 0 s now, and
    # deleted by the next); its replaced save is gone
    retired = [k for k in _keys(moto_port, bucket) if k.endswith("/RETIRED")]
    assert len(retired) == 1 and retired[0].split("/")[1].startswith("step-00000005")


def test_other_schemes_are_refused_naming_the_supported_ones(tmp_path: Path) -> None:
    for url in ("gs://bucket/run", "az://c/run", "abfs://c/run", "hdfs://nn/run"):
        with pytest.raises(InvalidOptionError) as info:
            Checkpointer(url)
        assert url in str(info.value) and "s3://bucket/prefix" in str(info.value)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_host_budget_bounds_the_uploads(bucket: str, proxy: FaultProxy, scratch: Path) -> None:
    """With ``host_budget_bytes``, an upload holds at most that many bytes of parts
    (12 MiB: parts of 6 MiB, two in flight), whatever the step's size (24 MiB here)."""
    proxy.add(Rule("delay", method="PUT", path=r"partNumber=", delay=0.2, times=100))
    state = {"a": torch.randn(3 << 20), "b": torch.randn(3 << 20)}
    async with Checkpointer(f"s3://{bucket}/run", host_budget_bytes=12 << 20) as ckpt:
        await ckpt.save(state, step=1)
        await ckpt.wait()
        assert 1 <= proxy.max_in_flight["PUT-part"] <= 2
        got = {"a": torch.zeros(3 << 20), "b": torch.zeros(3 << 20)}
        assert await ckpt.restore(got) == 1 and torch.equal(got["a"], state["a"])


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_restore_that_loses_its_step_to_retention_takes_the_next_newest(
    bucket: str, moto_port: int, scratch: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No reader holds on a store: another process's retention may delete the step a
    restore listed (past the grace period) before it is read. The restore then lists
    again and loads the newest commit there is, never a torn state."""
    url = f"s3://{bucket}/run"
    async with Checkpointer(url, keep=3) as ckpt:
        for step in (1, 2):
            await ckpt.save(_state(float(step)), step=step)
        await ckpt.wait()
    download = store_place.StorePlace._download
    gone: list[str] = []

    def retired_meanwhile(self: Any, store: Any, save: Any, folder: Path) -> None:
        if not gone:  # the first candidate's objects go, its record first
            client = admin_client(moto_port)
            keys = [k for k in _keys(moto_port, bucket) if k.startswith(f"run/{save.prefix}/")]
            for key in sorted(keys, key=lambda k: not k.endswith("/COMMIT")):
                client.delete_object(Bucket=bucket, Key=key)
            gone.append(save.prefix)
        download(self, store, save, folder)

    monkeypatch.setattr(store_place.StorePlace, "_download", retired_meanwhile)
    async with Checkpointer(url) as ckpt:
        state = _state(0.0)
        assert await ckpt.restore(state) == 1
        assert torch.equal(state["w"], _state(1.0)["w"]) and gone and gone[0].startswith("step-00000002.")


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_object_deleted_from_a_committed_step_is_damage_named_not_a_gone_step(
    bucket: str, moto_port: int, scratch: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A data object deleted by hand (or lost) while its step's record stays: restore
    falls back to the newest whole step naming the object (it restored nothing before,
    taking the step as retired and listing it again), and verify fails it."""
    from async_stager._cli.main import main

    url = f"s3://{bucket}/run"
    async with Checkpointer(url, keep=3) as ckpt:
        for step in (1, 2):
            await ckpt.save(_state(float(step)), step=step)
        await ckpt.wait()
        lost = next(
            k for k in _keys(moto_port, bucket) if k.startswith("run/step-00000002.") and "distcp" in k
        )
        admin_client(moto_port).delete_object(Bucket=bucket, Key=lost)
        state = _state(0.0)
        assert await ckpt.restore(state) == 1 and state["n"] == 1
        with pytest.raises(IntegrityError, match=lost) as info:
            await ckpt.restore(_state(0.0), step=2, fallback=False)
        assert info.value.step == 2
    assert main(["verify", url]) == 1
    out = capsys.readouterr().out
    assert f"step-00000002: FAILED: s3://{bucket}/{lost}" in out and "step-00000001: ok" in out


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_restore_from_an_empty_prefix_says_it_holds_nothing(
    bucket: str, scratch: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Not "this Checkpointer created it" nor "it could not be created": a store makes no folder.
    url = f"s3://{bucket}/typo"
    with caplog.at_level(logging.WARNING, logger="async_stager"):
        async with Checkpointer(url) as ckpt:
            assert await ckpt.restore(_state(0.0)) is None
    said = [r.getMessage() for r in caplog.records if "nothing to restore" in r.getMessage()]
    assert said == [
        f"restore: nothing to restore: {url} holds no object; training starts from scratch "
        "(a typo in the URL?)"
    ], said


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_restore_error_names_the_objects_not_the_local_copy(bucket: str, scratch: Path) -> None:
    url = f"s3://{bucket}/run"
    async with Checkpointer(url) as ckpt:
        await ckpt.save(_state(1.0), step=1)
        await ckpt.wait()
        with pytest.raises(CheckpointError) as info:
            await ckpt.restore({"other": torch.zeros(3)})
    assert f"{url}/step-00000001." in str(info.value) and ".read-" not in str(info.value)


def test_verify_reads_a_store(
    bucket: str, moto_port: int, scratch: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m async_stager verify s3://...``: each committed step downloaded and
    checked, newest first; a damaged one FAILED (exit status 1)."""
    import anyio

    from async_stager._cli.main import main

    url = f"s3://{bucket}/run"

    async def save() -> None:
        async with Checkpointer(url, keep=3) as ckpt:
            for step in (1, 2):
                await ckpt.save(_state(float(step)), step=step)
            await ckpt.wait()

    anyio.run(save)
    assert main(["verify", url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["step-00000002", "step-00000001"] and "ok" in lines[0]
    client = admin_client(moto_port)
    key = next(
        k for k in _keys(moto_port, bucket) if k.startswith("run/step-00000001.") and k.endswith(".distcp")
    )
    body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[-100] ^= 1
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    assert main(["verify", url]) == 1
    out = capsys.readouterr().out
    assert "step-00000001: FAILED" in out and "step-00000002: ok" in out
    assert main(["verify", f"s3://{bucket}/empty"]) == 2
