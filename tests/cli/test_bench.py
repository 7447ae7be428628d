"""The benchmark's own logic: CLI, JSON schema, table, chart, errors. Never timed:
these tests assert structure (and that measured numbers are positive), not speed."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import io
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from async_stager._cli import bench as _bench, main as cli
from async_stager._cli.report import (
    BenchReport,
    BoundResult,
    LagStats,
    StagerResult,
    WorkloadResult,
    format_table,
    lag_stats,
    of_limit,
    write_plot,
)
from async_stager._cli.workloads import WORKLOADS, count_tensors

# Hang guards, not speed checks: a pure function's test gets 10 s; a test that runs the
# bench (or shares a run made by a fixture, whose time counts in the first test that
# uses it) gets minutes: the full tiny run took 19 s quiet and 71 s beside a loaded
# suite on 2 cores.
pytestmark = pytest.mark.timeout(300)

#: Every bench run here: the smallest workloads, one round, no warm-up.
TINY = ["--scale", "0.0005", "--runs", "1", "--warmup", "0"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@dataclasses.dataclass(frozen=True)
class CliRun:
    """One ``python -m async_stager`` run in this process: its exit status, stdout and
    stderr (the progress lines: not a terminal, so one line per step)."""

    status: int
    out: str
    err: str


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """The heap that pytest built frozen (``gc.freeze``) while a bench runs: the bench
    collects garbage before every measured step (about a hundred in a tiny run), and
    each full collection would otherwise walk every object of torch, hypothesis and
    the collected tests, 0.1-0.3 s each on 2 cores, most of the run's time. What the
    bench makes is collected as ever."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def run_cli(argv: list[str]) -> CliRun:
    out, err = io.StringIO(), io.StringIO()
    with frozen_heap(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main(argv)
    return CliRun(status, out.getvalue(), err.getvalue())


# The runs are shared: each is made once per module (per pytest-xdist worker: the module
# is one xdist group, tests/conftest.py) by the first test that needs it, and several
# tests assert different things about it.


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[CliRun, Path, Path]:
    """Every workload and contender: (the run, its JSON file, its chart)."""
    d = tmp_path_factory.mktemp("bench")
    out_json, out_png = d / "bench.json", d / "bench.png"
    return run_cli(["bench", *TINY, "--json", str(out_json), "--plot", str(out_png)]), out_json, out_png


@pytest.fixture(scope="module")
def small20k_json_run() -> CliRun:
    """One workload without DCP and the all-threads variant, JSON on stdout."""
    return run_cli(["bench", *TINY, "--workloads", "small20k", "--no-dcp", "--no-all-threads", "--json", "-"])


def _check_width(text: str, width: int = 80) -> None:
    wide = [line for line in text.splitlines() if len(line) > width]
    assert not wide, f"{len(wide)} lines wider than {width}: {wide[:3]}"


def _check_lag(lag: dict[str, Any]) -> None:
    assert set(lag) == {"p50_ms", "p99_ms", "max_ms", "samples"}
    assert 0 <= lag["p50_ms"] <= lag["p99_ms"] <= lag["max_ms"]
    assert lag["samples"] >= 0


@pytest.mark.timeout(600)
def test_bench_cli_table(full_run: tuple[CliRun, Path, Path]) -> None:
    run, _, _ = full_run
    assert run.status == 0, run.err
    table = run.out
    assert "| stager" in table and "bound (1 buffer)" in table and "[1]" not in table
    assert "small20k, stage over the copy limit: async_stager " in table
    assert "small20k, lag p50/p99/max ms: async_stager " in table
    _check_width(table)


@pytest.mark.timeout(600)
def test_bench_cli_json(full_run: tuple[CliRun, Path, Path]) -> None:
    run, out_json, _ = full_run
    assert run.status == 0, run.err
    data = json.loads(out_json.read_text())
    assert data["schema_version"] == 2
    assert set(data) == {"machine", "options", "idle_lag", "workloads", "seconds", "schema_version"}
    assert data["machine"]["device"].startswith("cpu")
    assert data["machine"]["cores"] >= 1
    assert data["options"]["device"] == "cpu"
    _check_lag(data["idle_lag"])
    assert [w["name"] for w in data["workloads"]] == list(WORKLOADS)
    for w in data["workloads"]:
        assert w["tensors"] > 0 and w["bytes"] > 0 and w["device"] == "cpu"
        assert w["bound"]["seconds"] > 0 and w["bound"]["gbps"] > 0 and w["bound"]["sync_seconds"] > 0
        _check_lag(w["bound"]["lag"])
        names = [s["name"] for s in w["stagers"]]
        assert names[0] == "async_stager" and names[-1] == "dcp" and "async_stager.DefaultStager" in names
        # One bound copy before each round and one after each contender in it.
        rounds = WORKLOADS[w["name"]].runs_factor
        assert len(w["bound"]["runs"]) == rounds * (len(names) + 1)
        for s in w["stagers"]:
            assert s["error"] is None, s["error"]
            assert s["cold_seconds"] > 0 and s["seconds"] > 0 and s["gbps"] > 0
            assert s["us_per_tensor"] > 0 and s["of_bound"] > 0
            assert len(s["runs"]) == WORKLOADS[w["name"]].runs_factor
            assert (s["vs_dcp"] is None) == (s["name"] == "dcp")
            # DCP lets go of the host storages of sources that died (every stage of
            # a fresh workload): it holds none once its last sources are gone.
            dcp_fresh = WORKLOADS[w["name"]].fresh and s["name"] == "dcp"
            assert s["host_bytes"] is None or s["host_bytes"] >= w["bytes"] or dcp_fresh
            assert s["fds"] >= 0
            _check_lag(s["lag"])
            _check_lag(s["cold_lag"])


@pytest.mark.timeout(600)
def test_bench_cli_plot_and_progress(full_run: tuple[CliRun, Path, Path]) -> None:
    run, out_json, out_png = full_run
    assert run.status == 0, run.err
    assert out_png.read_bytes()[:8] == PNG_MAGIC
    # Without a terminal: one progress line per step of every workload, none wider than 80.
    contenders = {len(w["stagers"]) for w in json.loads(out_json.read_text())["workloads"]}
    (n,) = contenders
    steps = _bench._steps(_bench.BenchOptions(runs=1, warmup=0), n)
    lines = [line for line in run.err.splitlines() if re.search(r"\] \d+/\d+ ", line)]
    assert [_count(line) for line in lines] == [f"{i}/{steps}" for i in range(1, steps + 1)]
    _check_width(run.err)


def test_bench_json_to_stdout_one_workload(small20k_json_run: CliRun) -> None:
    run = small20k_json_run
    assert run.status == 0, run.err
    data = json.loads(run.out)
    (w,) = data["workloads"]
    assert w["name"] == "small20k" and w["tensors"] == 10
    names = [s["name"] for s in w["stagers"]]
    assert names == ["async_stager", "async_stager.DefaultStager", "limit (_foreach_copy_)"]
    assert all(s["vs_dcp"] is None and s["of_bound"] > 0 for s in w["stagers"])
    # The copy limit holds exactly the workload's tensors, in host tensors of its own.
    assert w["stagers"][-1]["host_bytes"] == w["bytes"]


def test_cli_progress_on_a_pipe_is_a_line_per_step(small20k_json_run: CliRun) -> None:
    run = small20k_json_run
    assert run.status == 0, run.err
    # Contenders: ours, its DefaultStager and the copy limit.
    steps = _bench._steps(_bench.BenchOptions(workloads=("small20k",), runs=1, warmup=0), 3)
    lines = run.err.splitlines()
    assert len(lines) == steps and "\r" not in run.err
    assert [_count(line) for line in lines] == [f"{i}/{steps}" for i in range(1, steps + 1)]
    assert "small20k built" in lines[0] and " eta " in lines[-1]
    _check_width(run.err)


def test_failing_contender_is_a_result(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    class Failing:
        def __init__(self, name: str, **kw: Any) -> None:
            self.name = name

        async def stage(self, sd: Any) -> None:
            raise OSError(24, "Too many open files")

        def host_bytes(self) -> int | None:
            return None

        async def close(self) -> None:
            pass

    monkeypatch.setattr(_bench, "DcpContender", Failing)
    # One run: the table on stdout, the same report as JSON in a file.
    out_json = tmp_path / "bench.json"
    argv = ["bench", *TINY, "--quiet", "--workloads", "small20k", "--no-all-threads", "--json", str(out_json)]
    run = run_cli(argv)
    assert run.status == 0, run.err
    (w,) = json.loads(out_json.read_text())["workloads"]
    ours, seed, limit, dcp = w["stagers"]
    assert dcp["name"] == "dcp" and "Too many open files" in dcp["error"]
    assert limit["name"] == "limit (_foreach_copy_)" and limit["error"] is None
    assert ours["error"] is None and ours["vs_dcp"] is None and seed["error"] is None
    # The table: the failure is a footnote under the tables, marked in dcp's rows.
    table = run.out
    _check_width(table)
    assert table.splitlines()[-1] == "[1] dcp failed on small20k: OSError: [Errno 24] Too many open files"
    assert sum("| dcp" in line and "failed" in line and "[1]" in line for line in table.splitlines()) == 2


def test_contender_failing_on_its_second_stage_is_a_footnote(monkeypatch: pytest.MonkeyPatch) -> None:
    # DCP's DefaultStager on torch 2.11: the cold stage works, the next one raises.
    class SecondFails:
        def __init__(self, name: str, **kw: Any) -> None:
            self.name = name
            self.calls = 0

        async def stage(self, sd: Any) -> None:
            self.calls += 1
            if self.calls > 1:
                raise KeyError(type)

        def host_bytes(self) -> int | None:
            return None

        async def close(self) -> None:
            pass

    monkeypatch.setattr(_bench, "DcpContender", SecondFails)
    run = run_cli(["bench", *TINY, "--quiet", "--workloads", "small20k", "--no-all-threads", "--json", "-"])
    assert run.status == 0, run.err
    (w,) = json.loads(run.out)["workloads"]
    ours, _seed, _limit, dcp = w["stagers"]
    assert "KeyError" in dcp["error"] and "<class 'type'>" in dcp["error"]
    assert ours["error"] is None and ours["seconds"] > 0 and ours["vs_dcp"] is None


def test_dcp_direct_path_stages_twice() -> None:
    # The torch-2.11 path: DCP's StateDictStager driven directly, cache kept.
    from async_stager._cli.measure import DcpContender, dcp_available

    if dcp_available() is not None:
        pytest.skip("no DCP staging in this torch")

    async def main() -> int | None:
        c = DcpContender("dcp", cuda=False, direct=True)
        sd = {"a": torch.arange(1000, dtype=torch.float32), "b": {"c": torch.ones(7)}}
        try:
            await c.stage(sd)
            await c.stage(sd)
            return c.host_bytes()
        finally:
            await c.close()

    assert asyncio.run(main()) is not None


def test_missing_matplotlib_fails_fast(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setattr(_bench, "run_bench", _must_not_run)
    rc = cli.main(["bench", "--plot", str(tmp_path / "x.png")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "matplotlib" in err and "pip install 'async_stager[plot]'" in err
    assert not (tmp_path / "x.png").exists()


async def _must_not_run(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("the benchmark ran although --plot could not be honoured")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--workloads", "nope"], "unknown workload 'nope'"),
        (["--runs", "0"], "--runs must be >= 1"),
    ],
)
def test_bad_flags_are_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["bench", "--quiet", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_cuda_device_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--quiet", "--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def _report(error: bool = False) -> BenchReport:
    lag = LagStats(0.1, 0.5, 2.0, 100)
    ours = StagerResult("async_stager", 0.3, 0.02, (0.02, 0.021), 1.0, 12.5, 0.9, 1.0, lag, lag, 2**20, 0)
    if error:
        dcp = StagerResult(
            "dcp", 0.0, 0.0, (), 0.0, None, None, 0.0, lag, lag, None, 0, "OSError: Too many open files"
        )
    else:
        dcp = StagerResult("dcp", 0.3, 0.25, (0.25,), 0.1, None, 0.08, 12.5, lag, lag, None, 0)
    w = WorkloadResult(
        "small20k", "d", "cpu", 20000, 1_280_000, BoundResult(0.001, 1.28, (0.001,), 0.0009, lag), (ours, dcp)
    )
    machine = {
        "device": "cpu (x86_64)",
        "cores": 2,
        "torch": "2.x",
        "python": "3.x",
        "loadavg_1min_at_start": 0.5,
    }
    return BenchReport(machine, {"runs": 1, "scale": 1.0}, lag, (w,), 3.0)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip("|").split("|")]


@pytest.mark.timeout(10)
def test_table_format() -> None:
    text = format_table(_report())
    _check_width(text)
    lines = text.splitlines()
    assert "2 cores" in lines[0]
    assert "idle loop lag p50/p99/max 0.10/0.50/2.00 ms" in text
    # Per workload: a title, then two tables (times and ratios; loop lag and memory),
    # each with a header, a separator, a row per stager and the bound.
    title = lines.index("small20k: 20,000 tensors, 1.2 MiB on cpu")
    speed, loop = lines[title + 1 : title + 6], lines[title + 7 : title + 12]
    assert lines[title + 6] == "" and len(lines) == title + 12
    for table in (speed, loop):
        assert len({len(line) for line in table}) == 1, "columns are aligned"
        assert [_cells(r)[0] for r in table[2:]] == ["async_stager", "dcp", "bound (1 buffer)"]
    assert _cells(speed[0]) == ["stager", "cold ms", "ms", "GB/s", "vs DCP", "of bound"]
    assert _cells(speed[2]) == ["async_stager", "300.0", "20.00", "1.00", "12.50x", "0.90"]
    assert _cells(speed[3])[4] == "-"
    assert _cells(speed[4]) == ["bound (1 buffer)", "", "1.00", "1.28", "", "1.00"]
    assert _cells(loop[0]) == ["stager", "lag p99/max", "cold p99/max", "host MiB", "fds"]
    assert _cells(loop[2]) == ["async_stager", "0.50/2.00", "0.50/2.00", "1.0", "0"]
    assert _cells(loop[3])[3] == "-"
    assert "[1]" not in text


@pytest.mark.timeout(10)
def test_wide_table_has_every_column() -> None:
    text = format_table(_report(), wide=True)
    lines = text.splitlines()
    table = lines[lines.index("") + 1 :]
    assert len(table) == 2 + 3  # header, separator, ours, dcp, bound
    assert len({len(line) for line in table}) == 1, "columns are aligned"
    cells = _cells(table[2])
    assert cells[:4] == ["small20k", "async_stager", "20000", "1.2"]
    assert cells[5] == "20.00" and cells[7] == "12.50x" and cells[8] == "0.90"
    assert cells[10] == "0.10/0.50/2.00" and cells[11] == "0.50/2.00"
    assert cells[-2] == "1.0" and cells[-1] == "0"
    dcp_cells = _cells(table[3])
    assert dcp_cells[7] == "-" and dcp_cells[-2] == "-"
    assert "bound (1 buffer)" in table[4]


@pytest.mark.timeout(10)
def test_lag_p99_and_max_share_their_precision() -> None:
    report = _report()
    (w,) = report.workloads
    lag = LagStats(0.3, 98.64, 118.61, 1000)
    slow = dataclasses.replace(w.stagers[0], lag=lag, cold_lag=LagStats(0.1, 0.57, 4.8, 10))
    text = format_table(dataclasses.replace(report, workloads=(dataclasses.replace(w, stagers=(slow,)),)))
    row = next(line for line in text.splitlines() if line.startswith("| async_stager ") and "/" in line)
    assert _cells(row)[1:3] == ["98.6/118.6", "0.57/4.80"]


@pytest.mark.timeout(10)
def test_huge_numbers_still_fit() -> None:
    # A very slow machine: times and lags in the tens of seconds keep the width.
    report = _report(error=True)
    (w,) = report.workloads
    lag = LagStats(1234.5, 23456.7, 34567.8, 10)
    slow = dataclasses.replace(w.stagers[0], cold_seconds=1234.5, seconds=987.65, lag=lag, cold_lag=lag)
    w = dataclasses.replace(w, stagers=(slow, w.stagers[1]))
    _check_width(format_table(dataclasses.replace(report, workloads=(w, w))))


@pytest.mark.timeout(10)
def test_ratios_are_paired_per_round() -> None:
    # Round 2 ran on a machine twice as slow for everybody: the paired ratios stay at
    # 2.0, where a ratio of the two medians would say 1.0.
    assert _bench._paired([2.0, 4.0, 2.0], [1.0, 2.0, 1.0]) == 2.0
    assert _bench._paired([1.0, 1.0, 4.0], [1.0, 2.0, 2.0]) == 1.0
    assert _bench._paired([], []) is None


@pytest.mark.timeout(10)
def test_table_shows_failures_in_a_footnote() -> None:
    text = format_table(_report(error=True))
    _check_width(text)
    lines = text.splitlines()
    assert lines[-2:] == ["", "[1] dcp failed on small20k: OSError: Too many open files"]
    rows = [_cells(line) for line in lines if line.startswith("| dcp ")]
    assert rows == [["dcp", "failed", "[1]", "", "", ""], ["dcp", "failed", "[1]", "", ""]]
    # A long message wraps under its number; the wide table uses the same footnote.
    report = _report(error=True)
    (w,) = report.workloads
    long = dataclasses.replace(w.stagers[1], error="RuntimeError: " + "unable to open shared memory " * 8)
    two = (w, dataclasses.replace(w, name="large1g", stagers=(w.stagers[0], long)))
    text = format_table(dataclasses.replace(report, workloads=two))
    _check_width(text)
    foot = text[text.index("\n[1] ") + 1 :].splitlines()
    assert foot[1].startswith("[2] dcp failed on large1g: RuntimeError: unable")
    assert len(foot) > 3 and all(line.startswith("    ") for line in foot[2:])
    wide = format_table(_report(error=True), wide=True)
    assert wide.splitlines()[-1] == "[1] dcp failed on small20k: OSError: Too many open files"
    assert "failed: " not in wide


def test_plot_writes_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "chart.png"
    write_plot(_report(error=True), str(path))
    assert path.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.timeout(10)
def test_lag_stats() -> None:
    s = lag_stats([i / 1000 / 1000 for i in range(101)])  # 0..100 us in seconds
    assert s.samples == 101
    assert (
        s.p50_ms == pytest.approx(0.050)
        and s.p99_ms == pytest.approx(0.099)
        and s.max_ms == pytest.approx(0.1)
    )
    assert lag_stats([-1.0]).max_ms == 0.0  # early wake-ups count as on time
    assert lag_stats([]) == LagStats(0.0, 0.0, 0.0, 0)


def test_workload_shapes() -> None:
    cpu = torch.device("cpu")
    n, b = count_tensors(WORKLOADS["small20k"].build(1.0, cpu))
    assert (n, b) == (20_000, 20_000 * 64)
    n, b = count_tensors(WORKLOADS["large1g"].build(1 / 1024, cpu))
    assert (n, b) == (64, 2**20)
    sd = WORKLOADS["transformer"].build(0.125, cpu)
    model, optim = sd["model"], sd["optim"]
    assert len(optim["state"]) == len(model) == len(optim["param_groups"][0]["params"])
    for i, p in enumerate(model.values()):
        st = optim["state"][i]
        assert st["exp_avg"].shape == st["exp_avg_sq"].shape == p.shape and st["step"].dim() == 0
    assert any(p.dim() == 1 for p in model.values()) and any(p.dim() == 2 for p in model.values())


@pytest.mark.timeout(10)
def test_progress_bar() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Tty()
    p = _bench.Progress(4, tty)
    p.step("a")
    p.step("a", "x" * 200)
    p.finish()
    text = tty.getvalue()
    assert text.count("\r") == 2 and "2/4" in text and text.endswith("\n")
    assert all(len(part) <= 79 for part in text.strip("\n").split("\r")), "fits 80 columns"
    assert "eta 0:00" in text  # two steps took well under a second: two more, likewise


def _count(line: str) -> str:
    """The ``done/total`` of a progress line."""
    found = re.search(r"\] (\d+/\d+) ", line)
    assert found, line
    return found.group(1)


@pytest.mark.timeout(10)
def test_progress_lines_without_a_terminal() -> None:
    # A CI log or a file: one line per step (the log never goes quiet for long), each
    # with the count, the time so far and the estimate of the time left.
    plain = io.StringIO()
    p = _bench.Progress(3, plain)
    for phase in ("a", "a", "b"):
        p.step(phase, "detail")
    p.finish()
    lines = plain.getvalue().splitlines()
    assert len(lines) == 3 and plain.getvalue().endswith("\n") and "\r" not in plain.getvalue()
    assert [_count(line) for line in lines] == ["1/3", "2/3", "3/3"]
    assert all(" eta " in line and line.endswith(" detail") and len(line) <= 79 for line in lines)
    assert _bench._clock(59.4) == "0:59" and _bench._clock(61) == "1:01" and _bench._clock(3725) == "1:02:05"


def test_demo(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--scale", "0.01", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "second stage (reuses it)" in out and "equal to the source: True" in out


def test_run_bench_api_is_quiet_without_stream() -> None:
    opts = _bench.BenchOptions(
        workloads=("large1g",),
        runs=1,
        warmup=0,
        scale=1 / 4096,
        dcp=False,
        all_threads=False,
        idle_seconds=0.05,
    )
    with frozen_heap():
        report = asyncio.run(_bench.run_bench(opts, None))
    (w,) = report.workloads
    assert w.bytes == 2**18
    assert report.options["contenders"] == [
        "async_stager",
        "async_stager.DefaultStager",
        "limit (_foreach_copy_)",
    ]


@pytest.mark.timeout(10)
def test_stage_over_the_copy_limit_is_paired_per_round() -> None:
    lag = LagStats(0.1, 0.5, 2.0, 100)
    ours = StagerResult(
        "async_stager", 0.3, 0.03, (0.03, 0.06, 0.02), 1.0, 12.5, 0.9, 1.0, lag, lag, 2**20, 0
    )
    limit = StagerResult(
        "limit (_foreach_copy_)", 0.1, 0.02, (0.02, 0.02, 0.01), 1.0, None, 0.9, 1.0, lag, lag, 2**20, 0
    )
    w = WorkloadResult(
        "small20k",
        "d",
        "cpu",
        20000,
        1_280_000,
        BoundResult(0.001, 1.28, (0.001,), 0.0009, lag),
        (ours, limit),
    )
    # Round ratios 1.5, 3.0, 2.0: their median, not the ratio of the medians.
    assert of_limit(w) == {"async_stager": 2.0}
    text = format_table(BenchReport(_report().machine, {"runs": 3, "scale": 1.0}, lag, (w,), 3.0))
    _check_width(text)
    assert "small20k, stage over the copy limit: async_stager 2.00x" in text
    assert "small20k, lag p50/p99/max ms: async_stager 0.10/0.50/2.00" in text
    assert of_limit(_report().workloads[0]) == {}  # no limit row: no ratios, no lines
    assert "copy limit" not in format_table(_report())
