"""``python -m async_stager check --ranks-per-node K [--node-budget SIZE]``: the
pre-flight judges the node (K ranks' worth against the machine's memory, capped by a
node budget; one rank's need against the whole budget)."""

from __future__ import annotations

import argparse
import io

import pytest

from async_stager._cli.check import add_check_parser, run_check
from async_stager._core.memory.host_limits import HostLimits

pytestmark = pytest.mark.timeout(60)

GiB = 1 << 30


def run(*argv: str, mem: int) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    add_check_parser(parser.add_subparsers(dest="command"))
    out = io.StringIO()
    rc = run_check(parser.parse_args(["check", *argv]), out, HostLimits(mem_available=mem))
    return rc, out.getvalue()


def test_ranks_per_node_multiply_the_machine_wide_need() -> None:
    assert run("--bytes", "10GiB", mem=30 * GiB)[0] == 0  # one rank: 2 x 10 GiB fit
    rc, text = run("--bytes", "10GiB", "--ranks-per-node", "4", mem=30 * GiB)
    assert rc == 1 and "4 ranks x 2 x 10 GiB" in text
    assert "node_budget_bytes" in text  # the fix names the node budget


def test_a_node_budget_caps_the_node_and_must_hold_one_rank() -> None:
    rc, text = run("--bytes", "10GiB", "--ranks-per-node", "4", "--node-budget", "25GiB", mem=30 * GiB)
    assert rc == 0, text
    assert "at most 25 GiB (node budget)" in text and "not enforced" in text
    rc, text = run("--bytes", "10GiB", "--ranks-per-node", "4", "--node-budget", "15GiB", mem=30 * GiB)
    assert rc == 1 and "does not fit: node budget, one rank" in text
    assert "lower max_buffer_sets (now 2) to 1" in text
    # A budget bigger than the machine can hold is judged against the machine.
    rc, text = run("--bytes", "10GiB", "--ranks-per-node", "4", "--node-budget", "60GiB", mem=30 * GiB)
    assert rc == 1 and "does not fit: host memory (MemAvailable)" in text


@pytest.mark.parametrize("bad", [["--ranks-per-node", "0"], ["--node-budget", "0"], ["--node-budget", "x"]])
def test_bad_flags_are_usage_errors(bad: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        run("--bytes", "1GiB", *bad, mem=GiB)
    assert e.value.code == 2
