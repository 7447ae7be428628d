"""``python -m async_stager check``: sizes, the table, exit statuses (0 fits, 1 does not,
2 usage), against this machine's real limits and through the reader's seam."""

from __future__ import annotations

import argparse
import io
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from async_stager._cli.check import add_check_parser, checkpoint_bytes, parse_bytes, parse_count, run_check
from async_stager._cli.main import main
from async_stager._core.memory.host_limits import CgroupLimit, HostLimits
from async_stager._core.memory.preflight import set_bytes

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_check_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["check", *argv])


@pytest.mark.parametrize(
    ("text", "n"),
    [
        ("1e9", 10**9),
        ("40GB", 40 * 10**9),
        ("37.2GiB", int(37.2 * 2**30) + 1),
        ("512 MiB", 512 * 2**20),
        ("64kib", 65536),
        ("100", 100),
    ],
)
def test_parse_bytes(text: str, n: int) -> None:
    assert parse_bytes(text) == pytest.approx(n, abs=1)


@pytest.mark.parametrize(
    ("text", "n"), [("7B", 7 * 10**9), ("350M", 350 * 10**6), ("1.5k", 1500), ("7e9", 7 * 10**9)]
)
def test_parse_count(text: str, n: int) -> None:
    assert parse_count(text) == n


@pytest.mark.parametrize("text", ["", "GiB", "-1GiB", "0", "1XB", "inf", "nan"])
def test_bad_sizes_are_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes(text)


def test_model_size_counts_weights_and_optimizer_states() -> None:
    assert checkpoint_bytes(_parse("--model-size", "7B")) == 7 * 10**9 * 2  # bf16 weights
    assert checkpoint_bytes(_parse("--model-size", "7B", "--optimizer", "adamw")) == 7 * 10**9 * 2 * 3
    assert (
        checkpoint_bytes(_parse("--model-size", "1B", "--dtype", "fp32", "--optimizer", "sgd")) == 8 * 10**9
    )
    assert checkpoint_bytes(_parse("--bytes", "1GiB")) == 2**30


def test_fits_prints_the_table_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--bytes", "1MiB", "--share-memory", "--buffer-sets", "1"]) == 0
    out = capsys.readouterr().out
    assert "pre-flight: 1 MiB checkpoint" in out and "need: 1 MiB of shared host memory" in out
    assert "descriptors (RLIMIT_NOFILE)" in out and out.rstrip().endswith("fits: yes")
    assert all(len(line) <= 80 for line in out.splitlines()), out


def test_does_not_fit_exits_1_through_the_seam() -> None:
    gib = 1 << 30
    limits = HostLimits(
        mem_available=100 * gib,
        cgroup=CgroupLimit(2, "/sys/fs/cgroup/job", 16 * gib, 2 * gib),
        memlock=64 * 1024,
        nofile=1024,
        open_fds=12,
    )
    out = io.StringIO()
    ns = _parse("--model-size", "7B", "--optimizer", "adamw", "--pin-memory", "--share-memory")
    assert run_check(ns, out, limits) == 1
    text = out.getvalue()
    assert "(7B parameters, bf16, adamw optimizer)" in text
    assert "2 x 39.1 GiB" in text
    lines = text.splitlines()
    row = next(line for line in lines if line.startswith("cgroup v2 memory.max"))
    assert row.split()[-1] == "NO" and "14 GiB" in row
    assert next(line for line in lines if line.startswith("pinned memory")).endswith("not enforced")
    assert "does not fit: cgroup v2 memory.max: raise the container's memory limit" in text
    assert all(len(line) <= 80 for line in lines), text
    # The same with room for it.
    roomy = HostLimits(mem_available=100 * gib, cgroup=CgroupLimit(2, "/x", 100 * gib, 0))
    assert run_check(ns, io.StringIO(), roomy) == 0


def test_buffer_sets_multiply_the_need() -> None:
    per_set = set_bytes([3 * 2**30])
    limits = HostLimits(mem_available=2 * per_set)
    assert run_check(_parse("--bytes", "3GiB", "--buffer-sets", "2"), io.StringIO(), limits) == 0
    assert run_check(_parse("--bytes", "3GiB", "--buffer-sets", "3"), io.StringIO(), limits) == 1


@pytest.mark.parametrize(
    "argv",
    [
        [],  # a size is required
        ["--bytes", "1GiB", "--model-size", "7B"],  # not both
        ["--bytes", "lots"],
        ["--bytes", "1GiB", "--buffer-sets", "0"],
        ["--model-size", "7B", "--dtype", "int3"],
    ],
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", *argv]) == 2
    assert "usage:" in capsys.readouterr().err


def test_real_limit_in_a_subprocess_exits_1() -> None:
    """python -m async_stager check against a real RLIMIT_NOFILE of a few descriptors."""

    def few_fds() -> None:
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "async_stager", "check", "--bytes", "1MiB", "--share-memory"]
    many = [*cmd, "--buffer-sets", "40"]  # 80 descriptors
    ok = subprocess.run(many, env=env, capture_output=True, text=True, timeout=100)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    low = subprocess.run(many, env=env, capture_output=True, text=True, timeout=100, preexec_fn=few_fds)
    assert low.returncode == 1, low.stdout + low.stderr
    assert "does not fit: descriptors (RLIMIT_NOFILE)" in low.stdout
