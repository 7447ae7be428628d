"""The benchmark's own logic: CLI, JSON schema, table, chart, errors. Never timed:
these tests assert structure (and that measured numbers are positive), not speed."""

from __future__ import annotations

import asyncio
import io
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from async_stager import __main__ as cli
from async_stager import _bench
from async_stager._bench_report import (
    BenchReport,
    BoundResult,
    LagStats,
    StagerResult,
    WorkloadResult,
    format_table,
    lag_stats,
    write_plot,
)
from async_stager._bench_workloads import WORKLOADS, count_tensors

pytestmark = pytest.mark.timeout(60)

TINY = ["--scale", "0.0005", "--runs", "1", "--warmup", "0", "--quiet"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _check_lag(lag: dict[str, Any]) -> None:
    assert set(lag) == {"p50_ms", "p99_ms", "max_ms", "samples"}
    assert 0 <= lag["p50_ms"] <= lag["p99_ms"] <= lag["max_ms"]
    assert lag["samples"] >= 0


@pytest.mark.timeout(60)
def test_bench_cli_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "bench.json"
    out_png = tmp_path / "bench.png"
    rc = cli.main(["bench", *TINY, "--json", str(out_json), "--plot", str(out_png)])
    assert rc == 0
    table = capsys.readouterr().out
    assert "| workload" in table and "bound (1 buffer)" in table

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
            assert s["host_bytes"] is None or s["host_bytes"] >= w["bytes"]
            assert s["fds"] >= 0
            _check_lag(s["lag"])
            _check_lag(s["cold_lag"])
    assert out_png.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.timeout(30)
def test_bench_json_to_stdout_one_workload(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["bench", *TINY, "--workloads", "small20k", "--no-dcp", "--no-all-threads", "--json", "-"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    (w,) = data["workloads"]
    assert w["name"] == "small20k" and w["tensors"] == 10
    assert [s["name"] for s in w["stagers"]] == ["async_stager", "async_stager.DefaultStager"]
    assert all(s["vs_dcp"] is None and s["of_bound"] > 0 for s in w["stagers"])


@pytest.mark.timeout(30)
def test_failing_contender_is_a_result(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
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
    rc = cli.main(["bench", *TINY, "--workloads", "small20k", "--no-all-threads", "--json", "-"])
    assert rc == 0
    (w,) = json.loads(capsys.readouterr().out)["workloads"]
    ours, seed, dcp = w["stagers"]
    assert dcp["name"] == "dcp" and "Too many open files" in dcp["error"]
    assert ours["error"] is None and ours["vs_dcp"] is None and seed["error"] is None


@pytest.mark.timeout(30)
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


@pytest.mark.timeout(30)
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
@pytest.mark.timeout(30)
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


@pytest.mark.timeout(10)
def test_table_format() -> None:
    text = format_table(_report())
    head, blank, *table = text.splitlines()
    assert "2 cores" in head and "idle loop lag p50/p99/max 0.10/0.50/2.0 ms" in head and blank == ""
    assert len(table) == 2 + 3  # header, separator, ours, dcp, bound
    assert len({len(line) for line in table}) == 1, "columns are aligned"
    cells = [c.strip() for c in table[2].strip("|").split("|")]
    assert cells[:4] == ["small20k", "async_stager", "20000", "1.2"]
    assert cells[5] == "20.00" and cells[7] == "12.50x" and cells[8] == "0.90"
    assert cells[10] == "0.10/0.50/2.0" and cells[-2] == "1.0" and cells[-1] == "0"
    dcp_cells = [c.strip() for c in table[3].strip("|").split("|")]
    assert dcp_cells[7] == "-" and dcp_cells[-2] == "-"
    assert "bound (1 buffer)" in table[4]


@pytest.mark.timeout(10)
def test_ratios_are_paired_per_round() -> None:
    # Round 2 ran on a machine twice as slow for everybody: the paired ratios stay at
    # 2.0, where a ratio of the two medians would say 1.0.
    assert _bench._paired([2.0, 4.0, 2.0], [1.0, 2.0, 1.0]) == 2.0
    assert _bench._paired([1.0, 1.0, 4.0], [1.0, 2.0, 2.0]) == 1.0
    assert _bench._paired([], []) is None


@pytest.mark.timeout(10)
def test_table_shows_failures() -> None:
    text = format_table(_report(error=True))
    assert "failed: OSError: Too many open files" in text


@pytest.mark.timeout(30)
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


@pytest.mark.timeout(30)
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
    p.step("a", "x")
    p.finish()
    assert tty.getvalue().count("\r") == 2 and "2/4" in tty.getvalue() and tty.getvalue().endswith("\n")
    plain = io.StringIO()
    p = _bench.Progress(3, plain)
    for phase in ("a", "a", "b"):
        p.step(phase)
    assert plain.getvalue().count("\n") == 2  # a line per new phase, not per step


@pytest.mark.timeout(30)
def test_demo(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--scale", "0.01", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "second stage (reuses it)" in out and "equal to the source: True" in out


@pytest.mark.timeout(30)
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
    report = asyncio.run(_bench.run_bench(opts, None))
    (w,) = report.workloads
    assert w.bytes == 2**18
    assert report.options["contenders"] == ["async_stager", "async_stager.DefaultStager"]
