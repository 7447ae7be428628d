"""A Checkpointer's directory given as a URL (issue 44's first item): ``file://`` names
a local folder, ``s3://`` an object store (tests/store/test_checkpointer_s3.py); every
other scheme is refused at construction, naming the URL and the supported ones, instead
of being written into a relative folder named after the scheme (``gs:``) that dies with
the machine."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from async_stager import Checkpointer
from async_stager.errors import InvalidOptionError


@pytest.mark.parametrize(
    "url",
    [
        "gs://bucket/run",
        "GS://bucket/run",
        "az://container/run",
        "hdfs://nn/run",
        "http://x/y",
    ],
)
def test_a_url_of_another_scheme_is_refused_and_no_folder_is_made(
    url: str, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidOptionError) as info:
        Checkpointer(url)
    message = str(info.value)
    assert url in message and "s3://bucket/prefix" in message and "file:///path" in message
    assert list(tmp_path.iterdir()) == []  # no "gs:" folder in the working directory


def test_an_s3_url_is_an_object_store_not_a_folder(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ASYNC_STAGER_SCRATCH", str(tmp_path / "scratch"))
    ckpt = Checkpointer("s3://bucket/run/")
    assert ckpt.options.url == "s3://bucket/run"
    assert ckpt.options.directory.parent == tmp_path / "scratch"  # the saves' scratch folder
    assert list(tmp_path.iterdir()) == []  # nothing made at construction, no "s3:" folder
    with pytest.raises(InvalidOptionError, match="s3://bucket/prefix"):
        Checkpointer("s3:///run")


def test_a_file_url_to_a_foreign_host_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidOptionError, match="file:// URL must name a local path"):
        Checkpointer("file://otherhost/some/where")


@pytest.mark.anyio
async def test_a_file_url_names_the_local_folder(tmp_path: Path) -> None:
    folder = tmp_path / "a run"  # a space, given quoted in the URL
    url = "file://" + str(folder).replace(" ", "%20")
    state = {"w": torch.arange(6.0)}
    async with Checkpointer(url, keep=2) as ckpt:
        await ckpt.save(state, step=1)
        await ckpt.wait()
    assert Checkpointer(url).options.directory == folder
    assert 1 in Checkpointer(os.fspath(folder)).steps()
    target = {"w": torch.zeros(6)}
    async with Checkpointer(folder) as ckpt:
        assert await ckpt.restore(target) == 1
    assert torch.equal(target["w"], state["w"])


def test_verify_refuses_a_url_in_one_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "async_stager", "verify", "gs://bucket/run"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 2
    assert "gs://bucket/run" in done.stderr and "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == []
