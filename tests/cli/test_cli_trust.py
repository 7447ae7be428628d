"""The command line tells the truth: ``verify`` reports a damaged checkpoint as a failed
step with a one-line reason (never a traceback) and goes on to the older steps; its
help names the digests it checks; ``demo`` does what it prints (the second stage reuses
the first's host memory) within 100 columns; ``check`` suggests a budgeted save
(``host_budget_bytes=N``, a concrete N) where a staged copy does not fit; the other
commands refuse bad flags as usage errors and keep their lines within 100 columns."""

from __future__ import annotations

import io
import json
import re
import shutil
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import torch.distributed.checkpoint as dcp

import async_stager.dcp
from async_stager import Checkpointer, HostLimitError, IntegrityError, Stager
from async_stager._checkpoint import integrity as _integrity
from async_stager._cli import main as cli
from async_stager._cli.check import add_check_parser, run_check
from async_stager._cli.process import format_rows
from async_stager._cli.workloads import describe_transformer
from async_stager._core.memory import preflight as _preflight
from async_stager._core.memory.host_limits import CgroupLimit, HostLimits

pytestmark = pytest.mark.timeout(60)

GIB = 1 << 30
STEPS = (1, 2, 3)
NEWEST = "step-00000003"


def _state(step: int) -> dict[str, Any]:
    return {"model": {"w": torch.arange(1000.0) + step, "b": torch.ones(10) * step}, "step": step}


def _make(root: Path, fmt: str) -> None:
    async def save() -> None:
        async with Checkpointer(root, keep=len(STEPS), format=fmt) as ckpt:  # type: ignore[arg-type]
            for step in STEPS:
                await ckpt.save(_state(step), step=step)
            await ckpt.wait()

    anyio.run(save)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One Checkpointer directory per format, three committed steps each (copied per test)."""
    out = {}
    for fmt in ("dcp", "torch"):
        root = tmp_path_factory.mktemp(f"saved-{fmt}")
        _make(root, fmt)
        out[fmt] = root
    return out


def _copy(saved: dict[str, Path], fmt: str, tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    shutil.copytree(saved[fmt], root)
    return root


def _verify(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str], str]:
    capsys.readouterr()
    status = cli.main(["verify", *argv])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err, captured.out + captured.err
    return status, captured.out.splitlines(), captured.err


def _newest_failed(lines: list[str], *words: str) -> None:
    """The newest step failed (one line, naming ``words``), the two older verify."""
    assert len(lines) == 3, lines
    assert lines[0].startswith(f"{NEWEST}: FAILED: "), lines
    for word in words:
        assert word in lines[0], lines[0]
    assert lines[1].startswith("step-00000002: ok") and lines[2].startswith("step-00000001: ok"), lines


def _data_file(step_folder: Path) -> Path:
    (data,) = sorted(step_folder.glob("*.distcp"))
    return data


# -- verify: damaged DCP data -----------------------------------------------------------


@pytest.mark.parametrize(
    ("damage", "word"),
    [
        (lambda p: p.write_bytes(p.read_bytes()[:100]), "truncated"),
        (lambda p: p.write_bytes(b""), "truncated"),
        (lambda p: p.unlink(), "missing"),
    ],
    ids=["truncated", "zero-length", "missing"],
)
def test_verify_damaged_dcp_data_file_fails_that_step_and_checks_the_older(
    saved: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    damage: Callable[[Path], None],
    word: str,
) -> None:
    root = _copy(saved, "dcp", tmp_path)
    data = _data_file(root / NEWEST)
    damage(data)
    status, lines, _ = _verify(capsys, str(root))
    assert status == 1
    _newest_failed(lines, data.name, word)


def _garble_tensor(step_folder: Path, fqn: str = "model.w") -> None:
    """Overwrite the stored bytes of one tensor (same file size): the size check passes,
    DCP's reader fails on them (each tensor is a torch.save archive of its own)."""
    metadata = dcp.FileSystemReader(str(step_folder)).read_metadata()
    (info,) = [v for k, v in metadata.storage_data.items() if k.fqn == fqn]
    data = step_folder / info.relative_path
    raw = bytearray(data.read_bytes())
    raw[info.offset : info.offset + info.length] = b"X" * info.length
    data.write_bytes(bytes(raw))


@pytest.mark.parametrize("wrapped", [False, True], ids=["raw-CheckpointException", "as-IntegrityError"])
def test_verify_dcp_read_failure_is_one_line_whatever_verify_dcp_raises(
    saved: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    wrapped: bool,
) -> None:
    """DCP raises CheckpointException (a BaseException whose text is a traceback per
    rank); ``_integrity.verify_dcp`` may pass it on or wrap it in an IntegrityError
    whose message embeds it: either way, one line that says what failed."""
    from torch.distributed.checkpoint.api import CheckpointException

    root = _copy(saved, "dcp", tmp_path)
    _garble_tensor(root / NEWEST)
    if wrapped:
        real = _integrity.verify_dcp

        def verify_dcp(folder: Path, step: int | None, **kw: Any) -> int:
            try:
                return real(folder, step, **kw)
            except CheckpointException as exc:
                raise IntegrityError(f"{folder}: cannot read tensors ({exc})", step=step) from exc

        monkeypatch.setattr(_integrity, "verify_dcp", verify_dcp)
    status, lines, _ = _verify(capsys, str(root))
    assert status == 1
    _newest_failed(lines)
    assert "RANK" not in lines[0] and "CheckpointException ranks" not in lines[0], lines[0]


@pytest.mark.parametrize("wrapped", [False, True], ids=["raw-CheckpointException", "as-IntegrityError"])
def test_verify_lets_an_interrupt_inside_dcp_stop_the_command(
    saved: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wrapped: bool
) -> None:
    """DCP's loader wraps even KeyboardInterrupt in a CheckpointException: Ctrl-C must
    stop verify, not count as a damaged step (whether or not verify_dcp wraps it)."""
    from torch.distributed.checkpoint.api import CheckpointException

    root = _copy(saved, "dcp", tmp_path)

    def interrupted(folder: Path, step: int | None, **kw: Any) -> int:
        exc = CheckpointException("read", {0: (KeyboardInterrupt(), traceback.StackSummary())})
        if not wrapped:
            raise exc
        raise IntegrityError(f"{folder}: cannot read tensors ({exc})", step=step) from exc

    monkeypatch.setattr(_integrity, "verify_dcp", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cli.main(["verify", str(root)])


# -- verify: damaged checksums.json -------------------------------------------------------


def _first_key(doc: dict[str, Any]) -> str:
    return sorted(doc["tensors"])[0]


def _edit(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    """A damage that edits the manifest's parsed document in place."""

    def damage(path: Path) -> None:
        doc = json.loads(path.read_text(encoding="utf-8"))
        change(doc)
        path.write_text(json.dumps(doc), encoding="utf-8")

    return damage


def _set(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(doc: dict[str, Any]) -> None:
        doc["tensors"][_first_key(doc)][field] = value

    return change


def _drop(field: str) -> Callable[[dict[str, Any]], None]:
    def change(doc: dict[str, Any]) -> None:
        del doc["tensors"][_first_key(doc)][field]

    return change


def _entry_is_a_list(doc: dict[str, Any]) -> None:
    doc["tensors"][_first_key(doc)] = [1]


def _tensors_is_a_list(doc: dict[str, Any]) -> None:
    doc["tensors"] = []


def _no_tensors(doc: dict[str, Any]) -> None:
    del doc["tensors"]


MANIFEST_DAMAGE: dict[str, tuple[Callable[[Path], object], str]] = {
    "null-digest": (_edit(_set("digest", None)), "'digest' is null"),
    "digest-string": (_edit(_set("digest", "abc")), "'digest'"),
    "digest-empty": (_edit(_set("digest", [])), "'digest'"),
    "no-digest": (_edit(_drop("digest")), "has no 'digest'"),
    "no-fqn": (_edit(_drop("fqn")), "has no 'fqn'"),
    "no-shape": (_edit(_drop("shape")), "has no 'shape'"),
    "offsets-null": (_edit(_set("offsets", None)), "'offsets'"),
    "entry-is-a-list": (_edit(_entry_is_a_list), "is a list, not an object"),
    "tensors-is-a-list": (_edit(_tensors_is_a_list), "'tensors' is a list"),
    "no-tensors": (_edit(_no_tensors), "no 'tensors'"),
    "document-is-a-list": (lambda p: p.write_text("[]"), "holds a list"),
    "document-is-null": (lambda p: p.write_text("null"), "holds null"),
    "invalid-json": (lambda p: p.write_text("{"), "not valid JSON"),
    "empty": (lambda p: p.write_text(""), "not valid JSON"),
    "not-utf8": (lambda p: p.write_bytes(b"\xff\xfe{}"), "UTF-8"),
    "missing": (lambda p: p.unlink(), "missing"),
}


@pytest.mark.parametrize("fmt", ["dcp", "torch"])
@pytest.mark.parametrize("name", sorted(MANIFEST_DAMAGE))
def test_verify_damaged_manifest_is_a_clear_failure_of_that_step(
    saved: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, fmt: str
) -> None:
    damage, words = MANIFEST_DAMAGE[name]
    root = _copy(saved, fmt, tmp_path)
    damage(root / NEWEST / "checksums.json")
    status, lines, _ = _verify(capsys, str(root))
    assert status == 1
    _newest_failed(lines, "checksums.json", words)


def test_verify_fails_when_only_an_older_step_is_damaged(
    saved: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _copy(saved, "dcp", tmp_path)
    _edit(_set("digest", None))(root / "step-00000001" / "checksums.json")
    status, lines, _ = _verify(capsys, str(root))
    assert status == 1  # any step that does not verify
    assert lines[0].startswith(f"{NEWEST}: ok") and lines[2].startswith("step-00000001: FAILED: "), lines
    # Only the newest: it verifies.
    assert _verify(capsys, str(root), "--newest")[:2] == (0, [lines[0]])


# -- verify: damaged torch-format file ----------------------------------------------------


@pytest.mark.parametrize(
    ("damage", "word"),
    [
        (lambda p: p.write_bytes(p.read_bytes()[:100]), "truncated"),
        (lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]), "truncated"),
        (lambda p: p.write_bytes(b""), "empty"),
        (lambda p: torch.save([1, 2], p), ""),
        (lambda p: (p.unlink(), p.mkdir()), "not a file"),
    ],
    ids=["truncated", "half", "zero-length", "not-a-dict", "a-folder"],
)
def test_verify_damaged_torch_file_fails_that_step_and_checks_the_older(
    saved: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    damage: Callable[[Path], Any],
    word: str,
) -> None:
    root = _copy(saved, "torch", tmp_path)
    damage(root / NEWEST / "state.pt")
    status, lines, _ = _verify(capsys, str(root))
    assert status == 1
    _newest_failed(lines, "state.pt", word)


def test_verify_a_corrupted_tensor_still_names_it(
    saved: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _copy(saved, "torch", tmp_path)
    path = root / NEWEST / "state.pt"
    state = torch.load(path, weights_only=True)
    state["model"]["w"][7] += 1
    torch.save(state, path)
    status, lines, _ = _verify(capsys, str(root))
    assert status == 1
    _newest_failed(lines, "'model.w'", "mismatch")


# -- verify: usage ------------------------------------------------------------------------


def test_verify_a_folder_that_does_not_exist_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, lines, err = _verify(capsys, str(tmp_path / "nope"))
    assert (status, lines) == (2, [])
    assert f"{tmp_path / 'nope'} does not exist" in err
    (tmp_path / "file").write_text("x")
    status, _, err = _verify(capsys, str(tmp_path / "file"))
    assert status == 2 and "is not a folder" in err
    status, _, err = _verify(capsys, str(tmp_path))
    assert status == 2 and "no committed checkpoint" in err
    status, _, err = _verify(capsys, "")
    assert status == 2 and "DIR is empty" in err


def test_verify_help_names_the_digests_it_checks(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["verify", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "XXH3-64 per 8 MiB piece" in text and "WSUM64" in text and "GPU" in text
    # CRC-32 only as the first format's digest, which still verifies.
    assert text.count("CRC-32") == 1 and "first manifest format (CRC-32 per 16 MiB piece)" in text
    assert "Exit status 0" in text


# -- demo ----------------------------------------------------------------------------------


def _joined(lines: list[str]) -> str:
    """Wrapped lines joined back into one text."""
    return " ".join(line.strip() for line in lines)


def _hits(text: str) -> list[tuple[int, int]]:
    return [(int(h), int(m)) for h, m in re.findall(r"cache hits/misses (\d+)/(\d+)", text)]


@pytest.mark.anyio
async def test_demo_second_stage_reuses_the_host_memory(anyio_backend: Any) -> None:
    out = io.StringIO()
    first, second = await cli.demo(0.01, torch.device("cpu"), out)
    assert first.cache_misses == first.storages > 0 and first.host_bytes > 0
    assert (second.cache_hits, second.cache_misses) == (second.storages, 0)
    assert second.host_bytes == first.host_bytes  # no new host memory
    lines = out.getvalue().splitlines()
    assert all(len(line) <= cli.DEMO_WIDTH for line in lines), lines
    text = _joined(lines)
    assert _hits(text) == [(0, first.storages), (second.storages, 0)]
    assert "new host memory 0.0 MiB" in text and "equal to the source: True" in text


def test_demo_command_prints_reuse_within_100_columns(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--scale", "0.01", "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert all(len(line) <= 100 for line in lines), [len(line) for line in lines]
    hits = _hits(_joined(lines))
    assert len(hits) == 2 and hits[0][0] == 0 and hits[1][1] == 0 and hits[1][0] > 0, hits


def test_demo_help_describes_what_it_stages(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert cli.main(["demo", "--device", "cpu"]) == 0  # the default scale
    staged = re.search(r"state dict on cpu: (\d+) tensors, ([\d.]+) MiB", capsys.readouterr().out)
    assert staged is not None
    assert f"{staged[1]} tensors, {staged[2]} MiB" in help_text, help_text
    assert describe_transformer(0.25) in help_text and "AdamW" in help_text
    assert "reuses it" in help_text and "dropping the first result" in help_text


# -- check ---------------------------------------------------------------------------------


def _check(*argv: str, limits: HostLimits) -> tuple[int, str]:
    import argparse

    parser = argparse.ArgumentParser()
    add_check_parser(parser.add_subparsers(dest="command"))
    out = io.StringIO()
    status = run_check(parser.parse_args(["check", *argv]), out, limits)
    return status, out.getvalue()


def _budget_n(text: str) -> int:
    m = re.search(
        r"host_budget_bytes=N in Checkpointer\(\.\.\.\) or async_stager\.dcp\.save\(\.\.\.\), e\.g\. N=(\d+)",
        text,
    )
    assert m is not None, text
    return int(m[1])


@pytest.mark.parametrize("where", ["MemAvailable", "cgroup"])
def test_check_suggests_host_budget_bytes_with_a_concrete_n(where: str) -> None:
    left = 10 * GIB
    limits = (
        HostLimits(mem_available=left)
        if where == "MemAvailable"
        else HostLimits(mem_available=None, cgroup=CgroupLimit(2, "/sys/fs/cgroup/job", 16 * GIB, 6 * GIB))
    )
    status, out = _check("--bytes", "40GiB", limits=limits)
    assert status == 1
    assert all(len(line) <= 80 for line in out.splitlines()), out
    text = _joined(out.splitlines())
    n = _budget_n(text)
    assert n >= 4096 and n & (n - 1) == 0 and n <= left // 2, n  # a power of two, half of what is left
    assert f"N={n} ({_preflight.human(n)}" in text
    # One buffer set of 40 GiB does not fit either: fewer sets is not suggested.
    assert "max_buffer_sets" not in text


def test_check_suggests_fewer_buffer_sets_only_where_they_fit() -> None:
    status, out = _check("--bytes", "6GiB", limits=HostLimits(mem_available=10 * GIB))
    text = _joined(out.splitlines())
    assert status == 1 and "lower max_buffer_sets (now 2) to 1" in text
    assert _budget_n(text) == 4 * GIB
    # Nothing left at all: no budget fits either.
    assert "host_budget_bytes" not in _joined(
        _check("--bytes", "6GiB", limits=HostLimits(mem_available=0))[1].splitlines()
    )


@pytest.mark.anyio
async def test_reserve_error_suggests_a_budget_that_then_saves(
    anyio_backend: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The N a HostLimitError suggests is one a budgeted save takes: the state saves
    within it and loads back equal."""
    state = {f"w{i}": torch.full((64 * 1024,), float(i)) for i in range(8)}  # 8 x 256 KiB
    left = 1536 * 1024  # less than the 2 MiB state: no staged copy fits
    monkeypatch.setattr(_preflight, "read_limits", lambda: HostLimits(mem_available=left))
    async with Stager(max_buffer_sets=1) as stager:
        with pytest.raises(HostLimitError) as info:
            await stager.reserve(state)
        n = _budget_n(info.value.fix)
        assert n == 512 * 1024
        await async_stager.dcp.save(
            state, stager=stager, checkpoint_id=str(tmp_path / "c"), no_dist=True, host_budget_bytes=n
        )
    back = {k: torch.empty_like(v) for k, v in state.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(back, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    assert all(torch.equal(back[k], v) for k, v in state.items())


# -- the other commands --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--budgets", "abc"], "is not a number of MiB"),
        (["--budgets", "0"], "must be a number of MiB > 0"),
        (["--tensor-mib", "0"], "--tensor-mib must be >= 1"),
        (["--repeat", "0"], "--repeat must be >= 1"),
        (["--json", "/nonexistent-folder/x.json"], "does not exist"),
    ],
)
def test_bench_budget_bad_flags_are_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["bench-budget", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_bench_budget_refuses_a_budget_below_one_tensor_before_running(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["bench-budget", "--state-mib", "4", "--tensor-mib", "2", "--budgets", "1,unlimited"]
    assert cli.main(argv) == 2
    assert "cannot hold one tensor" in capsys.readouterr().err


def test_bench_budget_lines_fit_100_columns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench-budget", "--state-mib", "2", "--tensor-mib", "1", "--budgets", "1,unlimited"]
    assert cli.main([*argv, "--repeat", "1", "--dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 6 and all(len(line) <= 100 for line in lines), lines


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--contenders", "nope"], "unknown 'nope'"),
        (["--checkpoints", "1"], "--checkpoints must be >= 2"),
        (["--mib", "x"], "--mib must be an integer"),
    ],
)
def test_bench_process_bad_flags_are_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["bench-process", *argv]) == 2
    assert message in capsys.readouterr().err


def test_bench_process_table_fits_100_columns() -> None:
    row = {
        "contender": "ours-torch-reducers",
        "stage_ms_median": 131.3,
        "stage_ms_first": 1175.0,
        "rss_mib_before": 399,
        "rss_mib_first": 660,
        "rss_mib_last": 660,
        "pss_mib_last": 650,
        "descriptors_per_checkpoint": 64,
        "copied_mib": 128,
        "in_own_arenas": False,
        "exact": True,
        "warnings": ["a long warning " * 20],
    }
    lines = format_rows([row], 2, 10, 64, 128 * 2**20).splitlines()
    assert all(len(line) <= 100 for line in lines), [len(line) for line in lines]
    assert any(line.startswith("| ours-torch-reducers | 131.3; 1175.0 |") for line in lines)


def test_top_level_help_is_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--help"], ["bench-process", "--help"]):
        assert cli.main(argv) == 0
        out = capsys.readouterr().out
        assert "``" not in out and all(len(line) <= 100 for line in out.splitlines()), out
