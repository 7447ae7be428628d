"""Issue 22, the defects the model-based test and the hostile probe found after the
first round: each a regression test through the public API that failed before its fix.

- a save cancelled after its stage replaced the queued one ("coalesce") lost both;
  concurrent stages finishing out of call order left two queued (see also the replays
  in test_checkpointer_model.py);
- a failed DCP write kept its staged copy held for ever (DCP's planner outlives the
  failed call), so later saves stalled for a buffer set;
- a flipped byte of DCP's per-tensor zip framing, or of the manifest where it still
  parses, restored silently;
- a close with several failed writes pending raised only the first;
- a dict key DCP cannot restore as itself (bool, None, float, tuple) came back as a
  string; a tensor restored into a target of another dtype was converted silently;
- a folder whose ``.lock`` or ``latest`` is a folder, or a path that is a file, raised
  a raw OSError (and a ``latest`` folder made a committed step report "not committed").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from async_stager import Checkpointer, CheckpointError, IntegrityError

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


class _FailsWhenWritten:
    """The staged copy of a ``_Fails``: pickling it (the write) fails as a full disk
    would."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise OSError(28, "No space left on device (injected)")


class _Fails:
    """A value that stages (its copy is a ``_FailsWhenWritten``) but does not write."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (_FailsWhenWritten, ())


async def test_failed_dcp_writes_do_not_keep_buffer_sets_held(tmp_path: Path) -> None:
    """Three failed DCP writes in a row, then a good save: each stages at once (before
    the fix the second or third stage waited 60 s for a buffer set, then raised)."""
    async with Checkpointer(tmp_path, format="dcp") as ckpt:
        for i in range(3):
            with anyio.fail_after(10):
                await ckpt.save({"w": torch.full((1024,), float(i)), "bad": _Fails()}, step=i)
                with pytest.raises(CheckpointError, match="No space left"):
                    await ckpt.wait()
        with anyio.fail_after(10):
            await ckpt.save({"w": torch.ones(1024)}, step=9)
            await ckpt.wait()
        assert ckpt.steps() == [9]


async def test_close_raises_every_pending_failure_at_once(tmp_path: Path) -> None:
    """Two writes fail and nothing comes after the close: the close raises one
    CheckpointError naming both steps (each failure is raised, none lost)."""
    with pytest.raises(CheckpointError) as info:
        async with Checkpointer(tmp_path, format="dcp", max_in_flight=2) as ckpt:
            await ckpt.save({"w": torch.ones(4), "bad": _Fails()}, step=1)
            await ckpt.save({"w": torch.ones(4), "bad": _Fails()}, step=2)
    assert "steps [1, 2]" in str(info.value), info.value
    assert [f.step for f in info.value.failures] == [1, 2]  # type: ignore[attr-defined]


def _distcp(folder: Path) -> Path:
    (path,) = sorted(folder.glob("*.distcp"))
    return path


async def test_a_flipped_byte_of_dcp_zip_framing_is_caught(tmp_path: Path) -> None:
    """Byte 10 of the data file (a tensor item's zip local header time field, which no
    reader checks, so the values load intact): restore must refuse that step and fall
    back to the older one."""
    async with Checkpointer(tmp_path, format="dcp", keep=2) as ckpt:
        await ckpt.save({"w": torch.full((64,), 1.0)}, step=1)
        await ckpt.save({"w": torch.full((64,), 2.0)}, step=2)
        await ckpt.wait()
        path = _distcp(tmp_path / "step-00000002")
        data = bytearray(path.read_bytes())
        assert data[:4] == b"PK\x03\x04"  # the first item's zip header starts the file
        data[10] ^= 0x4C
        path.write_bytes(bytes(data))
        with pytest.raises(IntegrityError, match=r"__0_0\.distcp"):
            await ckpt.restore({"w": torch.zeros(64)}, step=2)
        out = {"w": torch.zeros(64)}
        assert await ckpt.restore(out) == 1 and torch.equal(out["w"], torch.full((64,), 1.0))


@pytest.mark.parametrize("fmt", ["dcp", "torch"])
async def test_a_manifest_change_that_still_parses_is_caught(tmp_path: Path, fmt: Any) -> None:
    """A digit of the manifest changed so that it is still valid JSON (here: the name a
    value is filed under): the COMMIT record's digest of the manifest refuses it."""
    async with Checkpointer(tmp_path, format=fmt, keep=2) as ckpt:
        await ckpt.save({"w": torch.ones(8), "n": 7}, step=1)
        await ckpt.save({"w": torch.ones(8), "n": 8}, step=2)
        await ckpt.wait()
        manifest = tmp_path / "step-00000002" / "checksums.json"
        doc = json.loads(manifest.read_text())
        doc["step"] = 3  # a field no entry check reads
        manifest.write_text(json.dumps(doc, sort_keys=True))
        with pytest.raises(IntegrityError, match="not the manifest committed"):
            await ckpt.restore({"w": torch.zeros(8), "n": 0}, step=2)
        assert await ckpt.restore({"w": torch.zeros(8), "n": 0}) == 1


async def test_a_damaged_commit_record_that_still_parses_is_not_listed(tmp_path: Path) -> None:
    """The COMMIT record's sequence number changed (valid JSON still): its own check
    fails, so the step is not listed (it would otherwise move in commit order)."""
    async with Checkpointer(tmp_path, keep=3) as ckpt:
        for s in (1, 2):
            await ckpt.save({"w": torch.full((4,), float(s))}, step=s)
        await ckpt.wait()
    record = tmp_path / "step-00000001" / "COMMIT"
    doc = json.loads(record.read_text())
    doc["seq"] = 99
    record.write_text(json.dumps(doc))
    async with Checkpointer(tmp_path, keep=3) as ckpt:
        assert ckpt.steps() == [2]


@pytest.mark.parametrize("key", [True, None, 2.5, (1, 2)], ids=["bool", "None", "float", "tuple"])
async def test_dict_keys_dcp_cannot_restore_are_refused(tmp_path: Path, key: Any) -> None:
    """DCP stores dict keys as their str(): a bool/None/float/tuple key would come
    back as a string into a target lacking it. The save is refused at the call, naming
    the key's path; str and int keys restore as themselves."""
    async with Checkpointer(tmp_path, format="dcp") as ckpt:
        with pytest.raises(CheckpointError, match=r"\['m'\]\[.*cannot be saved in the dcp format"):
            ckpt.save({"m": {key: torch.ones(2)}}, step=1).close()
        await ckpt.save({"m": {3: torch.ones(2), "x": torch.zeros(1)}}, step=2)
        await ckpt.wait()
        target: dict[str, Any] = {"m": {}}
        assert await ckpt.restore(target) == 2
        assert list(target["m"]) == [3, "x"]


@pytest.mark.parametrize("fmt", ["dcp", "torch"])
async def test_restore_into_another_dtype_is_refused(tmp_path: Path, fmt: Any) -> None:
    """A float16 tensor saved, a float32 target: refused with both dtypes named (DCP
    and copy_ would convert silently), and the target untouched."""
    async with Checkpointer(tmp_path, format=fmt) as ckpt:
        await ckpt.save({"w": torch.full((4,), 1.5, dtype=torch.float16)}, step=1)
        await ckpt.wait()
        target = {"w": torch.zeros(4)}
        with pytest.raises(CheckpointError, match=r"torch.float32 in the state, torch.float16"):
            await ckpt.restore(target, fallback=False)
        assert torch.equal(target["w"], torch.zeros(4))


@pytest.mark.parametrize("odd", [".lock", "latest", "file"])
async def test_an_unusable_folder_is_a_clear_error_at_open(tmp_path: Path, odd: str) -> None:
    """``.lock`` or ``latest`` a folder, or the path a file: a CheckpointError that says
    what is in the way, at the open (not a raw OSError, not a commit that reports
    failure after its step was committed)."""
    root = tmp_path / "ckpt"
    if odd == "file":
        root.write_text("not a folder")
    else:
        (root / odd).mkdir(parents=True)
    with pytest.raises(CheckpointError, match="cannot hold checkpoints") as info:
        async with Checkpointer(root):
            pass
    assert (odd if odd != "file" else "is a file") in str(info.value)


def test_checksum_is_spelled_checksums_and_the_old_spelling_warns(tmp_path: Path) -> None:
    """One spelling per feature (issue 23): ``checksums=``, as ``Stager.stage``;
    ``checksum=`` still works, with a DeprecationWarning."""
    assert Checkpointer(tmp_path, checksums=False).options.checksums is False
    with pytest.warns(DeprecationWarning, match="checksums="):
        ckpt = Checkpointer(tmp_path, checksum=False)
    assert ckpt.options.checksums is False
