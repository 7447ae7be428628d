"""The Checkpointer on S3 when the server misbehaves (issue 44): throttling, 5xx and
reset connections injected by the fault proxy are retried and the steps commit whole; a
denied write and a full quota fail the save with one line naming the object, commit
nothing and leave the Checkpointer usable; a wrong credential is one line too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from async_stager import Checkpointer
from async_stager.errors import CheckpointError
from tests.store import s3proxy
from tests.store.s3proxy import FaultProxy, Rule

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """The store's requests run on its own loop whatever the caller's (uvloop reaches it
    as asyncio does: test_checkpointer_s3.py runs all three)."""
    return str(request.param)


@pytest.fixture(autouse=True)
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ASYNC_STAGER_SCRATCH", str(tmp_path / "scratch"))
    return tmp_path / "scratch"


def _state(v: float) -> dict[str, Any]:
    return {"w": torch.full((256, 256), v), "n": int(v)}


async def test_throttling_errors_and_resets_are_retried_and_the_steps_commit_whole(
    bucket: str, proxy: FaultProxy
) -> None:
    proxy.add(
        s3proxy.slow_down(method="PUT", path=r"\.distcp", times=2),
        s3proxy.internal_error(method="PUT", path=r"/\.metadata", times=1),
        Rule("reset", method="PUT", path=r"/COMMIT", times=1),
        s3proxy.slow_down(method="GET", path=r"list-type=2", times=1),
    )
    async with Checkpointer(f"s3://{bucket}/run", keep=2) as ckpt:
        await ckpt.save(_state(1.0), step=1)
        await ckpt.wait()
        proxy.add(Rule("cut", method="GET", path=r"\.distcp", times=1))  # a body cut half way
        state = _state(0.0)
        assert await ckpt.restore(state) == 1
        assert torch.equal(state["w"], _state(1.0)["w"])
    assert all(rule.hits == rule.times for rule in proxy.rules), [(r.path, r.hits) for r in proxy.rules]


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda: s3proxy.denied(method="PUT", path=r"\.distcp", times=100), "was denied (AccessDenied"),
        (lambda: s3proxy.quota(method="PUT", path=r"/COMMIT", times=100), "QuotaExceeded"),
    ],
    ids=["denied", "quota"],
)
async def test_a_refused_write_names_the_object_and_commits_nothing(
    bucket: str, proxy: FaultProxy, make: Any, reason: str
) -> None:
    url = f"s3://{bucket}/run"
    async with Checkpointer(url, keep=2) as ckpt:
        await ckpt.save(_state(1.0), step=1)
        await ckpt.wait()
        rule = make()
        proxy.add(rule)
        await ckpt.save(_state(2.0), step=2)
        with pytest.raises(CheckpointError) as info:
            await ckpt.wait()
        message = str(info.value)
        assert "\n" not in message and reason in message and "step 2" in message
        assert f"{url}/step-00000002." in message  # the object, by its URL
        assert rule.hits >= 1
        proxy.clear()
        assert ckpt.steps() == [1]
        await ckpt.save(_state(3.0), step=3)  # usable after it
        await ckpt.wait()
        assert ckpt.steps() == [1, 3]


async def test_a_wrong_credential_is_one_line(bucket: str, proxy: FaultProxy) -> None:
    from tests.store.conftest import ACCESS_KEY

    proxy.add(s3proxy.wrong_key(ACCESS_KEY, times=1000))
    async with Checkpointer(f"s3://{bucket}/run") as ckpt:
        await ckpt.save(_state(1.0), step=1)
        with pytest.raises(CheckpointError) as info:
            await ckpt.wait()
    message = str(info.value)
    assert "\n" not in message and "InvalidAccessKeyId" in message and "credentials" in message
