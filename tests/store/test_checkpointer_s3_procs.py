"""The S3 Checkpointer across processes (issue 44), against the real server: two ranks
writing one step (each rank's files uploaded by that rank, the commit record by the
coordinator after both), and SIGKILL mid-upload, mid-commit and mid-retention: every
committed step restores whole, nothing torn is visible, and the next Checkpointer goes
on (cleaning what the dead one left)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from async_stager import Checkpointer
from async_stager._checkpoint import store_place
from tests.store.ckpt_s3_child import state
from tests.store.conftest import admin_client
from tests.store.s3proxy import FaultProxy, Rule

pytestmark = [pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).resolve().parent / "ckpt_s3_child.py"


@pytest.fixture(autouse=True)
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ASYNC_STAGER_SCRATCH", str(tmp_path / "scratch"))
    return tmp_path / "scratch"


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    "scratches",
    [
        # Two nodes: each rank has a scratch folder of its own (no rank reads another's).
        pytest.param("per-rank", id="per-rank"),
        # One node: the ranks share one scratch folder.
        pytest.param("shared", id="shared", marks=pytest.mark.slow),
    ],
)
def test_two_ranks_write_one_step(
    bucket: str, moto_port: int, tmp_path: Path, scratches: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two ranks save steps 1..3 (keep=2), list, restore step 3 and step 2, each rank its
    own tensors: every rank's files uploaded by that rank, the record by the coordinator
    after both. With a scratch folder per rank (the nodes of a multi-node job) every rank
    hashes its own files for the manifest, and restores and verifies from the store."""
    from async_stager._cli.main import main

    url = f"s3://{bucket}/job"
    port = _free_port()
    folders = [tmp_path / (f"node{r}" if scratches == "per-rank" else "node") for r in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(CHILD), "ranks", url, str(r), "2", str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(_env(), ASYNC_STAGER_SCRATCH=str(folders[r])),
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0 and out.strip().endswith(b"OK"), err.decode()[-3000:]
    keys = [o["Key"] for o in admin_client(moto_port).list_objects_v2(Bucket=bucket)["Contents"]]
    step3 = sorted(k.split("/", 2)[2] for k in keys if k.startswith("job/step-00000003."))
    assert "__0_0.distcp" in step3 and "__1_0.distcp" in step3 and "COMMIT" in step3
    # Nothing of a save or a restore is left in any rank's scratch folder.
    left = [p.name for f in folders for p in f.glob("*/.*") if p.name.startswith((".tmp-", ".read-"))]
    assert left == [], left
    # The manifest the coordinator committed covers both ranks' files: verify checks them.
    assert main(["verify", url]) == 0, capsys.readouterr().out
    assert "step-00000003: ok" in capsys.readouterr().out


@pytest.mark.slow
def test_two_nodes_a_denied_upload_fails_the_step_on_both(
    bucket: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    """A scratch folder per rank; rank 1's upload of step 2 is denied: step 2 is
    committed on neither rank (the error names rank 1), step 3 is, and no rank leaves
    its copy of the failed save in its scratch folder."""
    url = f"s3://{bucket}/job"
    port = _free_port()
    proxy.add(
        Rule(
            "error", method="PUT", path=r"step-00000002\.[^/]+/__1_0\.distcp", status=403, code="AccessDenied"
        )
    )
    folders = [tmp_path / f"node{r}" for r in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(CHILD), "denied", url, str(r), "2", str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(_env(), ASYNC_STAGER_SCRATCH=str(folders[r])),
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0 and out.strip().endswith(b"OK"), err.decode()[-3000:]
    left = [p.name for f in folders for p in f.glob("*/.*") if p.name.startswith((".tmp-", ".read-"))]
    assert left == [], left


@pytest.fixture
def anyio_backend() -> str:
    """The kills are the child's; the parent's checks run on asyncio alone."""
    return "asyncio"


@pytest.mark.anyio
@pytest.mark.parametrize(
    "phase",
    [
        pytest.param("upload", marks=pytest.mark.slow),
        "record",
        pytest.param("committed", marks=pytest.mark.slow),
        pytest.param("retention", marks=pytest.mark.slow),
    ],
)
async def test_sigkill_leaves_every_committed_step_whole(
    bucket: str, moto_port: int, phase: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"s3://{bucket}/run"
    done = subprocess.run(
        [sys.executable, str(CHILD), "kill", url, phase], capture_output=True, timeout=240, env=_env()
    )
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-3000:]
    async with Checkpointer(url, keep=2) as ckpt:
        steps = ckpt.steps()
        # Step 4 is committed only if the kill came after its record.
        expected = {"upload": [2, 3], "record": [2, 3], "committed": [2, 3, 4], "retention": [3, 4]}[phase]
        assert steps == expected, steps
        for step in steps:
            got = state(0)
            assert await ckpt.restore(got, step=step, fallback=False) == step
            assert torch.equal(got["w0"], state(step)["w0"]) and got["step"] == step
        # The next Checkpointer goes on: its commits and retention over what was left.
        monkeypatch.setattr(store_place, "RETIRE_GRACE", 0.0)
        monkeypatch.setattr(store_place, "STALE_AFTER", 0.0)
        for step in (6, 7):
            await ckpt.save(state(step), step=step)
        await ckpt.wait()
        assert ckpt.steps() == [6, 7]
        await ckpt.save(state(8), step=8)  # deletes what 7's retention marked, marks 6
        await ckpt.wait()
    client = admin_client(moto_port)
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]
    prefixes = {k.split("/")[1].split(".")[0] for k in keys if k.startswith("run/step-")}
    # The dead writer's save and every older step are gone; 6 waits out its grace.
    assert prefixes == {"step-00000006", "step-00000007", "step-00000008"}, sorted(keys)
    assert next(k for k in keys if k.endswith("/RETIRED")).startswith("run/step-00000006.")
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
