"""Bad options fail at construction, clearly: every option of Stager, DefaultStager and
StagerOptions is checked (type and range) before anything starts, with a StagingError
that names the option; bad command-line flags are usage errors (exit status 2) before
anything runs."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import math
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from async_stager import (
    CheckpointStagerConfig,
    DefaultStager,
    Stager,
    StagerOptions,
    StagingError,
    UnsupportedError,
)
from async_stager._cli import main as cli
from async_stager._cli.workloads import WORKLOADS, count_tensors

pytestmark = pytest.mark.timeout(300)  # a hang guard, not a speed check (see CONTRIBUTING.md, "Tests")

TYPE, RANGE = "type", "range"

#: (option, bad value, kind): kind TYPE is a wrong type (also a TypeError), RANGE a value
#: out of range (also a ValueError).
BAD: list[tuple[str, Any, str]] = [
    ("pin_memory", "yes", TYPE),
    ("pin_memory", 1, TYPE),
    ("pin_memory", "", TYPE),
    ("non_blocking", "yes", TYPE),
    ("non_blocking", 0, TYPE),
    ("share_memory", "yes", TYPE),
    ("share_memory", 1, TYPE),
    ("share_memory", None, TYPE),
    ("max_buffer_sets", 0, RANGE),
    ("max_buffer_sets", -1, RANGE),
    ("max_buffer_sets", 1.5, TYPE),
    ("max_buffer_sets", 2.0, TYPE),
    ("max_buffer_sets", "2", TYPE),
    ("max_buffer_sets", True, TYPE),
    ("max_buffer_sets", None, TYPE),
    ("max_buffer_sets", torch.tensor(2), TYPE),
    ("small_tensor_bytes", None, TYPE),
    ("small_tensor_bytes", -1, RANGE),
    ("small_tensor_bytes", 1024.0, TYPE),
    ("small_tensor_bytes", "65536", TYPE),
    ("scratch_bytes", -1, RANGE),
    ("scratch_bytes", None, TYPE),
    ("scratch_bytes", 1e6, TYPE),
    ("scratch_bytes", False, TYPE),
    ("yield_interval", 0, RANGE),
    ("yield_interval", -0.001, RANGE),
    ("yield_interval", 1.5, RANGE),
    ("yield_interval", math.nan, RANGE),
    ("yield_interval", math.inf, RANGE),
    ("yield_interval", "0.001", TYPE),
    ("yield_interval", True, TYPE),
    ("yield_interval", None, TYPE),
    ("worker_nice", "5", TYPE),
    ("worker_nice", 5.0, TYPE),
    ("worker_nice", True, TYPE),
    ("worker_nice", None, TYPE),
    ("worker_nice", 20, RANGE),
    ("worker_nice", -21, RANGE),
    ("worker_nice", 2**40, RANGE),
    ("copy_threads", 0, RANGE),
    ("copy_threads", -3, RANGE),
    ("copy_threads", 1025, RANGE),
    ("copy_threads", 2**40, RANGE),
    ("copy_threads", 2.5, TYPE),
    ("copy_threads", 2.0, TYPE),
    ("copy_threads", "2", TYPE),
    ("copy_threads", True, TYPE),
    ("buffer_wait_timeout", -1, RANGE),
    ("buffer_wait_timeout", math.nan, RANGE),
    ("buffer_wait_timeout", "60", TYPE),
    ("buffer_wait_timeout", True, TYPE),
]
IDS = [f"{name}={value!r}" for name, value, _ in BAD]
#: Options DefaultStager takes as keywords (the others come from its config).
ENGINE_ONLY = {"pin_memory", "share_memory", "non_blocking"}
#: Options Stager takes as keywords (an option newer than Stager's signature is checked
#: through the others).
STAGER_TAKES = set(inspect.signature(Stager).parameters)


def _check(exc: BaseException, name: str, value: Any, kind: str) -> None:
    assert isinstance(exc, UnsupportedError) and isinstance(exc, StagingError)
    assert isinstance(exc, TypeError if kind == TYPE else ValueError), type(exc).__mro__
    text = str(exc)
    assert text.startswith(f"{name} must be "), text
    if not isinstance(value, torch.Tensor):
        assert repr(value) in text, text  # the value given
    assert exc.__cause__ is None or isinstance(exc.__cause__, Exception)


def _base() -> dict[str, Any]:
    return {"pin_memory": False, "share_memory": False, "non_blocking": False}


@pytest.mark.timeout(20)
@pytest.mark.parametrize("name, value, kind", BAD, ids=IDS)
def test_stager_refuses_bad_option_at_construction(name: str, value: Any, kind: str) -> None:
    if name not in STAGER_TAKES:
        pytest.skip(f"Stager() does not take {name} (yet)")
    threads = set(threading.enumerate())
    with pytest.raises(StagingError) as info:
        Stager(**{name: value})
    _check(info.value, name, value, kind)
    # Nothing was started that could hang: no thread is left behind.
    assert set(threading.enumerate()) <= threads


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    "name, value, kind",
    [b for b in BAD if b[0] not in ENGINE_ONLY],
    ids=[i for i, b in zip(IDS, BAD) if b[0] not in ENGINE_ONLY],
)
def test_default_stager_refuses_bad_option(name: str, value: Any, kind: str) -> None:
    with pytest.raises(StagingError) as info:
        DefaultStager(**{name: value})
    _check(info.value, name, value, kind)


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    "field, name", [("use_pinned_memory", "pin_memory"), ("use_non_blocking_copy", "non_blocking")]
)
@pytest.mark.parametrize("value", ["yes", "False", 1])
def test_default_stager_refuses_non_bool_config(field: str, name: str, value: Any) -> None:
    config = CheckpointStagerConfig(**{field: value})
    with pytest.raises(StagingError) as info:
        DefaultStager(config)
    _check(info.value, name, value, TYPE)


@pytest.mark.parametrize("name, value, kind", BAD, ids=IDS)
def test_stager_options_refuse_bad_field(name: str, value: Any, kind: str) -> None:
    with pytest.raises(StagingError) as info:
        StagerOptions(**{**_base(), name: value})
    _check(info.value, name, value, kind)
    good = StagerOptions(**_base())
    with pytest.raises(StagingError) as info:
        good.replace(**{name: value})
    _check(info.value, name, value, kind)


def test_unknown_option_names_are_refused() -> None:
    with pytest.raises(StagingError, match="unknown option 'max_buffer_set'") as info:
        DefaultStager(max_buffer_set=2)
    assert isinstance(info.value, TypeError) and "max_buffer_sets" in str(info.value)
    with pytest.raises(TypeError, match="unknown option 'nope'"):
        StagerOptions(**_base()).replace(nope=1)


@pytest.mark.parametrize(
    "name, value, stored",
    [
        ("max_buffer_sets", 1, 1),
        ("max_buffer_sets", 10**6, 10**6),
        ("max_buffer_sets", np.int64(3), 3),
        ("small_tensor_bytes", 0, 0),
        ("scratch_bytes", 0, 0),
        ("scratch_bytes", 2**40, 2**40),
        ("yield_interval", 1, 1.0),
        ("yield_interval", 1e-6, 1e-6),
        ("yield_interval", np.float64(0.001), 0.001),
        ("worker_nice", -20, -20),
        ("worker_nice", 19, 19),
        ("worker_nice", 0, 0),
        ("copy_threads", 1, 1),
        ("copy_threads", 1024, 1024),
        ("copy_threads", None, None),
        ("share_memory", True, True),
        ("buffer_wait_timeout", None, None),
        ("buffer_wait_timeout", 0, 0.0),
        ("buffer_wait_timeout", math.inf, math.inf),
        ("buffer_wait_timeout", 5, 5.0),
    ],
)
def test_good_values_are_kept_and_normalized(name: str, value: Any, stored: Any) -> None:
    opts = StagerOptions(**{**_base(), name: value})
    got = getattr(opts, name)
    assert got == stored and type(got) is type(stored)
    assert StagerOptions(**_base()).replace(**{name: value}) == opts


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_type_is_checked_before_the_machine() -> None:
    # A string must not be taken for True (and then refused for lack of CUDA).
    with pytest.raises(TypeError, match="pin_memory must be True, False or None"):
        Stager(pin_memory="no")  # type: ignore[arg-type]
    with pytest.raises(UnsupportedError, match="pin_memory=True needs CUDA"):
        Stager(pin_memory=True)


@pytest.mark.timeout(30)
def test_stager_with_good_edge_options_stages() -> None:
    async def main() -> None:
        sd: dict[str, Any] = {"w": torch.arange(10.0), "b": [torch.ones(3)]}
        async with Stager(
            max_buffer_sets=np.int64(1), copy_threads=1, worker_nice=19, yield_interval=1, scratch_bytes=0
        ) as stager:
            assert stager.options.max_buffer_sets == 1 and stager.options.yield_interval == 1.0
            staged = await stager.stage(sd)
            assert torch.equal(staged["w"], sd["w"]) and torch.equal(staged["b"][0], sd["b"][0])

    asyncio.run(main())


# -- the command line ---------------------------------------------------------------------


def _run_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "async_stager", *args], capture_output=True, text=True, timeout=timeout
    )


BAD_FLAGS: list[tuple[list[str], str]] = [
    (["bench", "--scale", "nan"], "--scale must be a finite number > 0"),
    (["bench", "--scale", "inf"], "--scale must be a finite number > 0"),
    (["bench", "--scale", "0"], "--scale must be a finite number > 0"),
    (["bench", "--scale", "-1"], "--scale must be a finite number > 0"),
    (["bench", "--scale", "big"], "--scale must be a finite number > 0"),
    (["bench", "--scale", "1e9"], "<= 1e+06, got '1e9'"),
    (["demo", "--scale", "-1"], "--scale must be a finite number > 0"),
    (["demo", "--scale", "nan"], "--scale must be a finite number > 0"),
    (["bench", "--workloads", ","], "--workloads names no workload"),
    (["bench", "--workloads", ""], "--workloads names no workload"),
    (["bench", "--workloads", "nope,small20k"], "unknown workload 'nope'; choose from transformer, small20k"),
    (["bench", "--workloads", "small20k,small20k"], "'small20k' more than once"),
    (["bench", "--runs", "0"], "--runs must be >= 1"),
    (["bench", "--runs", "1.5"], "--runs must be an integer >= 1"),
    (["bench", "--warmup", "-1"], "--warmup must be >= 0"),
    (["bench", "--warmup", "x"], "--warmup must be an integer >= 0"),
    (["bench", "--device", "tpu"], "argument --device: invalid choice"),
    (["bench", "--json", "{missing}/out.json"], "does not exist"),
    (["bench", "--json", "{tmp}"], "is a folder"),
    (["bench", "--json", ""], "an empty file name"),
    (["bench", "--plot", "{missing}/out.png"], "does not exist"),
    (["bench", "--plot", "-"], "--plot cannot write to stdout"),
    (["bench", "--json", "{tmp}/same.png", "--plot", "{tmp}/same.png"], "the same file as --json"),
    (["bench", "--plot", "{tmp}/a.png", "--json", "{tmp}/a.png"], "the same file as --plot"),
    (["demo", "--device", "tpu"], "argument --device: invalid choice"),
    ([], "the following arguments are required"),
    (["nope"], "invalid choice: 'nope'"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("argv, message", BAD_FLAGS, ids=[" ".join(a) or "<none>" for a, _ in BAD_FLAGS])
def test_bad_flags_are_usage_errors(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [a.format(tmp=tmp_path, missing=tmp_path / "missing") for a in argv]
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert message in err and "usage:" in err, err
    assert out == ""
    assert not list(tmp_path.iterdir()), "nothing was written"


#: The same, as a user runs it: a process, its exit status and stderr. Each process
#: imports torch (2-3 CPU seconds): the default run keeps one, CI's second call (slow)
#: the others; every message is checked in-process above.
BAD_COMMANDS: list[tuple[list[str], str]] = [
    (["bench", "--scale", "nan"], "--scale must be a finite number > 0"),
    (["bench", "--scale", "inf"], "--scale must be a finite number > 0"),
    (["demo", "--scale", "-1"], "--scale must be a finite number > 0"),
    (["bench", "--workloads", ","], "--workloads names no workload"),
    (["bench", "--warmup", "-1"], "--warmup must be >= 0"),
]


@pytest.mark.timeout(300)  # a hang guard: a subprocess starting torch took 44 s at a load of 10-18
@pytest.mark.parametrize(
    "argv, message",
    [pytest.param(*c, marks=() if i == 0 else pytest.mark.slow) for i, c in enumerate(BAD_COMMANDS)],
    ids=[" ".join(a) for a, _ in BAD_COMMANDS],
)
def test_bad_flags_exit_2_without_a_traceback(argv: list[str], message: str) -> None:
    proc = _run_cli(*argv)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert message in proc.stderr and "usage:" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


@pytest.mark.timeout(600)  # two subprocesses
def test_bad_json_path_fails_before_any_workload(tmp_path: Path) -> None:
    # Without --quiet a run would draw its progress on stderr; none may appear. Startup
    # (importing torch) is measured alongside, so a slow machine does not fail this.
    t0 = time.monotonic()
    assert _run_cli("--help").returncode == 0
    startup = time.monotonic() - t0
    t0 = time.monotonic()
    proc = _run_cli("bench", "--json", str(tmp_path / "missing" / "out.json"))
    elapsed = time.monotonic() - t0
    assert proc.returncode == 2
    assert "--json" in proc.stderr and "does not exist" in proc.stderr
    assert "built" not in proc.stderr and "[#" not in proc.stderr and "[ " not in proc.stderr
    assert elapsed < startup + 3, (elapsed, startup)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("command", ["bench", "demo"])
def test_scale_beyond_memory_is_refused_up_front(
    command: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # 100000: the transformer alone would be about 27 TiB. "Up front": before any
    # state dict is built (checked directly, not by a wall-clock limit).
    def must_not_build(*args: Any) -> Any:
        raise AssertionError("a state dict was built before the scale was refused")

    for name, w in list(WORKLOADS.items()):
        monkeypatch.setitem(WORKLOADS, name, dataclasses.replace(w, build=must_not_build))
    monkeypatch.setattr(cli, "build_transformer", must_not_build)
    assert cli.main([command, "--scale", "100000", "--device", "cpu"]) == 2
    assert "--scale 100000 is too large" in capsys.readouterr().err


def test_main_returns_the_usage_status(capsys: pytest.CaptureFixture[str]) -> None:
    # In-process callers get the status back, not a SystemExit.
    assert cli.main(["bench", "--scale", "nan"]) == 2
    assert "--scale must be a finite number" in capsys.readouterr().err
    assert cli.main(["--help"]) == 0
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("scale", [1e-9, 0.0005, 0.01, 0.124, 0.125, 0.3, 1.0])
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_workload_footprint_matches_what_is_built(name: str, scale: float) -> None:
    workload = WORKLOADS[name]
    if name == "large1g" and scale > 0.01:
        scale /= 64  # keep it small
    assert workload.footprint(scale) == count_tensors(workload.build(scale, torch.device("cpu")))
