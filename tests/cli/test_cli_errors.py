"""The command line on hostile input (issue 36, section 3): ``demo --checkpoint`` given
a file says so in one line and exits 2 before the demo runs; a checkpoint the demo
cannot write (a full disk) is one line, exit 1; ``verify`` fails a step whose COMMIT
record is damaged, emptied or missing (restore would skip it for an older step)."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
import torch

from async_stager import Checkpointer
from async_stager._cli import main as cli

pytestmark = pytest.mark.timeout(180)

STEPS = (1, 2, 3)
NEWEST = "step-00000003"


def _make(root: Path, fmt: str) -> None:
    async def save() -> None:
        async with Checkpointer(root, keep=len(STEPS), format=fmt) as ckpt:  # type: ignore[arg-type]
            for step in STEPS:
                await ckpt.save({"w": torch.arange(100.0) + step, "step": step}, step=step)
            await ckpt.wait()

    anyio.run(save)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for fmt in ("dcp", "torch"):
        root = tmp_path_factory.mktemp(f"saved-{fmt}")
        _make(root, fmt)
        out[fmt] = root
    return out


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str], list[str]]:
    capsys.readouterr()
    status = cli.main(list(argv))
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err, captured.out + captured.err
    return status, captured.out.splitlines(), captured.err.splitlines()


def _step_changed(commit: Path) -> None:
    doc = json.loads(commit.read_text())
    doc["step"] = 2
    commit.write_text(json.dumps(doc))


DAMAGE: dict[str, Callable[[Path], object]] = {
    "step changed": _step_changed,
    "emptied": lambda p: p.write_text(""),
    "removed": lambda p: p.unlink(),
    "one byte changed": lambda p: p.write_bytes(p.read_bytes().replace(b'"seq":2', b'"seq":7', 1)),
}


@pytest.mark.parametrize("fmt", ["dcp", "torch"])
@pytest.mark.parametrize("how", list(DAMAGE))
def test_verify_fails_a_damaged_commit_record_of_the_newest_step(
    saved: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], fmt: str, how: str
) -> None:
    root = tmp_path / "ck"
    shutil.copytree(saved[fmt], root)
    DAMAGE[how](root / NEWEST / "COMMIT")
    status, lines, _ = run(capsys, "verify", str(root))
    assert status == 1, lines
    assert lines[0].startswith(f"{NEWEST}: FAILED: ") and "COMMIT" in lines[0], lines
    assert [ln.split(":")[0] for ln in lines[1:]] == ["step-00000002", "step-00000001"]
    assert all(": ok (" in ln for ln in lines[1:]), lines
    # --newest: the newest committed step is 2 now, and the damaged 3 above it is named.
    status, lines, _ = run(capsys, "verify", "--newest", str(root))
    assert status == 1 and lines[0].startswith(f"{NEWEST}: FAILED: ") and len(lines) == 2, lines


def test_verify_still_passes_intact_folders(
    saved: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    status, lines, _ = run(capsys, "verify", str(saved["dcp"]))
    assert status == 0 and len(lines) == 3 and all(": ok (" in ln for ln in lines), lines


def test_demo_checkpoint_into_a_file_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    t0 = time.monotonic()
    status, out, err = run(capsys, "demo", "--scale", "0.01", "--checkpoint", str(afile))
    assert status == 2 and out == [], out  # refused before the demo ran
    assert len(err) == 1 and str(afile) in err[0] and "not a folder" in err[0], err
    assert time.monotonic() - t0 < 60  # a hang guard, the refusal is at once
    status, out, err = run(capsys, "demo", "--scale", "0.01", "--checkpoint", "")
    assert status == 2 and len(err) == 1, err


def test_demo_checkpoint_on_a_full_disk_is_one_line_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.full_disk import full_disk

    folder = tmp_path / "ck"
    folder.mkdir()
    full_disk(monkeypatch, folder)
    status, _, err = run(capsys, "demo", "--scale", "0.01", "--checkpoint", str(folder))
    assert status == 1, err
    [line] = [ln for ln in err if ln.startswith("async-stager: error:")]
    assert "disk is full" in line and "No space left" in line, line
