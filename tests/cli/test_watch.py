"""The CLI shows a save's progress where a person watches (issue 24): ``demo
--checkpoint DIR`` prints the in-flight view while the saves run, and ``watch`` redraws
one line on a terminal and prints a line per phase elsewhere."""

from __future__ import annotations

import io
import itertools
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from async_stager import Checkpointer
from async_stager._checkpoint.progress import SaveProgress
from async_stager._cli.main import main
from async_stager._cli.watch import status_line, watch


def test_status_line_names_each_save() -> None:
    assert status_line([]) == "no save in flight"
    line = status_line(
        [
            SaveProgress(3, "writing", 1.25, 0.1, 3 * 2**20, 4.0),
            SaveProgress(4, "queued", 0.5, 0.1),
        ]
    )
    assert line == "step 3: writing 1.2 s, 3.0 MiB, ~4 s left; step 4: queued 0.5 s"


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.anyio
@pytest.mark.parametrize("tty", [False, True])
async def test_watch_prints_the_phases_of_a_save(tmp_path: Path, tty: bool, anyio_backend: Any) -> None:
    out: io.StringIO = _Tty() if tty else io.StringIO()
    async with Checkpointer(tmp_path, format="torch") as ckpt, anyio.create_task_group() as tg:
        tg.start_soon(watch, ckpt, out, 0.001)
        await anyio.sleep(0.01)
        await ckpt.save({"w": torch.ones(1 << 16)}, step=1)
        await ckpt.wait()
        await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    text = out.getvalue()
    assert "no save in flight" in text
    if tty:
        assert "\r\x1b[K" in text and text.endswith("\n")
    else:
        lines = text.splitlines()
        assert all(a != b for a, b in itertools.pairwise(lines))  # a line per change, not per tick


def test_demo_checkpoint_commits_and_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--scale", "0.01", "--device", "cpu", "--checkpoint", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    out = " ".join(captured.out.split())  # the lines wrap at the demo's width
    assert "checkpoint step 3 committed" in out and "kept steps [2, 3]" in out
    assert "step 1:" in captured.err  # the progress, on stderr
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-")) == [
        "step-00000002",
        "step-00000003",
    ]
