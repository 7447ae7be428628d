"""What docs/migration.md says about ``dcp.async_save`` is true (torch 2.13, thread mode).

With a stager whose ``stage()`` returns a Future (async_stager's ``DefaultStager`` with
the default config), DCP's ``async_save`` returns an ``AsyncSaveResponse`` as soon as
the stage is submitted: the sources may be modified in place only once its
``staging_completion`` (or the stage's Future, or ``stager.synchronize_staging()``) is
done. With a synchronous stager, ``stage()`` has copied everything before
``async_save`` returns its upload Future.

The stage is made slow deterministically: the state dict's first entry is a ``Gate``
whose ``__reduce_ex__`` (called by the stage's walk, in the stager's worker) blocks on a
``threading.Event``; its tensors are copied after it.
"""

from __future__ import annotations

import re
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import bits
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from async_stager import CheckpointStagerConfig, DefaultStager

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.timeout(60),
    # dcp.async_save/load(no_dist=True) warn that they assume one process: we asked for that.
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]


class Gate:
    """Staged as the int 0, once ``opened`` is set: the stage's walk blocks here."""

    def __init__(self, opened: threading.Event) -> None:
        self.opened = opened
        self.reached = threading.Event()

    def __reduce_ex__(self, protocol: Any) -> Any:
        self.reached.set()
        assert self.opened.wait(30), "the gate was never opened"
        return (int, (0,))


def make_sd(gate: Gate) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    # The gate comes first: the walk reaches it before the tensors are copied.
    return {"gate": gate, "w": torch.randn(256, generator=g), "b": torch.randn(16, generator=g), "step": 3}


def load(path: Path) -> dict[str, Any]:
    fresh: dict[str, Any] = {"gate": -1, "w": torch.zeros(256), "b": torch.zeros(16), "step": -1}
    dcp.load(fresh, checkpoint_id=str(path), no_dist=True)
    return fresh


def modify_in_place(sd: dict[str, Any]) -> None:
    """What ``optimizer.step()`` does to the parameters."""
    sd["w"].add_(1.0)
    sd["b"].mul_(-2.0)


def test_the_doc_waits_on_staging_completion() -> None:
    """The migration page's example waits where this file's tests show it must."""
    text = (ROOT / "docs" / "migration.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.DOTALL) if "async_save(" in b]
    assert blocks, "migration.md has no example of dcp.async_save"
    code = blocks[0]
    assert "response.staging_completion.result()" in code
    assert code.index("staging_completion.result()") < code.index("add_(")
    assert "calls `stage()`, then `synchronize_staging()` after starting the upload" not in text


@pytest.mark.parametrize("wait", ["staging_completion", "stage_future", "synchronize_staging"])
def test_waiting_as_documented_keeps_the_checkpoint_whole(
    wait: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened = threading.Event()
    gate = Gate(opened)
    sd = make_sd(gate)
    expected = {k: sd[k].clone() for k in ("w", "b")}
    stage_futures: list[Future[Any]] = []
    # Opened from another thread a little later: the stage is still running when
    # async_save returns, so not waiting would tear (see the test below).
    timer = threading.Timer(0.2, opened.set)
    with DefaultStager(CheckpointStagerConfig()) as stager:
        real_stage = stager.stage

        def spy(state_dict: Any, *args: Any) -> Any:
            fut = real_stage(state_dict, *args)
            assert isinstance(fut, Future)
            stage_futures.append(fut)
            return fut

        monkeypatch.setattr(stager, "stage", spy)
        timer.start()
        try:
            response = dcp.async_save(sd, checkpoint_id=str(tmp_path), async_stager=stager, no_dist=True)
            assert isinstance(response, AsyncSaveResponse)
            assert not response.staging_completion.done()  # async_save did not wait
            if wait == "staging_completion":
                response.staging_completion.result(timeout=30)
            elif wait == "stage_future":
                stage_futures[0].result(timeout=30)
            else:
                stager.synchronize_staging()
            modify_in_place(sd)  # as optimizer.step() would
            response.upload_completion.result(timeout=30)
        finally:
            opened.set()
            timer.join()
    loaded = load(tmp_path)
    for k, v in expected.items():
        assert torch.equal(bits(loaded[k]), bits(v)), f"{k}: the checkpoint holds modified values"
    assert loaded["gate"] == 0 and loaded["step"] == 3


def test_a_synchronous_stager_has_staged_when_async_save_returns(tmp_path: Path) -> None:
    opened = threading.Event()
    sd = make_sd(Gate(opened))
    expected = {k: sd[k].clone() for k in ("w", "b")}
    timer = threading.Timer(0.2, opened.set)
    timer.start()
    try:
        with DefaultStager(CheckpointStagerConfig(use_async_staging=False)) as stager:
            upload = dcp.async_save(sd, checkpoint_id=str(tmp_path), async_stager=stager, no_dist=True)
            # A plain Future of the upload: stage() ran in this thread, inside async_save.
            assert isinstance(upload, Future) and opened.is_set()
            modify_in_place(sd)
            upload.result(timeout=30)
    finally:
        opened.set()
        timer.join()
    loaded = load(tmp_path)
    for k, v in expected.items():
        assert torch.equal(bits(loaded[k]), bits(v)), k


def test_not_waiting_tears_the_checkpoint(tmp_path: Path) -> None:
    """Modify the sources right after async_save returns, while the stage is held at
    the gate (deterministically): the checkpoint holds the modified values."""
    opened = threading.Event()
    gate = Gate(opened)
    sd = make_sd(gate)
    before = {k: sd[k].clone() for k in ("w", "b")}
    with DefaultStager(CheckpointStagerConfig()) as stager:
        try:
            response = dcp.async_save(sd, checkpoint_id=str(tmp_path), async_stager=stager, no_dist=True)
            assert isinstance(response, AsyncSaveResponse)
            assert gate.reached.wait(30)  # the stage is running, held at the gate
            assert not response.staging_completion.done()
            modify_in_place(sd)  # no wait: a training step right after async_save
        finally:
            opened.set()
        response.upload_completion.result(timeout=30)
    loaded = load(tmp_path)
    for k in ("w", "b"):
        assert torch.equal(bits(loaded[k]), bits(sd[k])), f"{k}: expected the torn (modified) value"
        assert not torch.equal(loaded[k], before[k])
