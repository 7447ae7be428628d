"""The suite's own set-up: what CI runs, and the ``slow`` gate.

The README's test command leaves the ``slow`` tests out (the heaviest process tests), so
CI must run them in a call of its own, after that command: a test marked ``slow`` that
no CI call selects would prove nothing. The gate is in ``tests/conftest.py``.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest

from tests import conftest

ROOT = Path(__file__).resolve().parents[1]
README_COMMAND = "python -m pytest -q -n auto --dist loadgroup"
SLOW_COMMAND = f"env ASYNC_STAGER_SLOW=1 {README_COMMAND} -m slow"


def _ci_pytest_calls() -> list[str]:
    calls = []
    for line in (ROOT / ".ci" / "run").read_text().splitlines():
        words = shlex.split(line, comments=True)
        if words[:1] == ["check"] and "pytest" in words:
            calls.append(" ".join(words[1:]))
    return calls


def test_ci_runs_the_readme_command_first_then_the_slow_tests() -> None:
    assert f"\n{README_COMMAND} " in (ROOT / "README.md").read_text()
    assert _ci_pytest_calls() == [README_COMMAND, SLOW_COMMAND]


def test_the_slow_marker_is_declared_and_documented() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    markers = config["tool"]["pytest"]["ini_options"]["markers"]
    assert any(m.startswith("slow:") and "ASYNC_STAGER_SLOW=1" in m for m in markers), markers
    assert SLOW_COMMAND.removeprefix("env ") in (ROOT / "CONTRIBUTING.md").read_text()


class _Item:
    """What the collection hook reads of a test item."""

    def __init__(self, *marks: str) -> None:
        self.marks = [getattr(pytest.mark, m) for m in marks]

    def get_closest_marker(self, name: str) -> Any:
        return next((m for m in self.marks if m.name == name), None)

    def add_marker(self, mark: Any) -> None:
        self.marks.append(mark)

    def skipped(self) -> bool:
        return self.get_closest_marker("skip") is not None


@pytest.mark.parametrize(
    ("slow", "stress", "runs"),
    [(False, False, False), (True, False, True), (False, True, True), (True, True, True)],
)
def test_slow_tests_skip_unless_the_gate_is_open(
    monkeypatch: pytest.MonkeyPatch, slow: bool, stress: bool, runs: bool
) -> None:
    monkeypatch.setattr(conftest, "SLOW", slow or stress)
    monkeypatch.setattr(conftest, "STRESS", stress)
    heavy, light, both = _Item("slow"), _Item(), _Item("slow", "stress")
    items: Any = [heavy, light, both]
    conftest.pytest_collection_modifyitems(None, items)  # type: ignore[arg-type]
    assert heavy.skipped() is not runs
    assert not light.skipped()
    assert both.skipped() is not stress  # a stress test in a slow module: the stress run's


class _Report:
    def __init__(self, nodeid: str, cpu: float) -> None:
        self.nodeid, self.duration, self.user_properties = nodeid, 0.1, [("cpu_s", cpu)]


class _Terminal:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def section(self, title: str) -> None:
        self.lines.append(f"== {title}")

    def line(self, text: str) -> None:
        self.lines.append(text)


def test_cpu_time_is_summed_per_module_and_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    # The run's own tallies stay as they are: these reports go to fresh ones.
    monkeypatch.setattr(conftest, "CPU_SECONDS", {})
    monkeypatch.setattr(conftest, "TIME_USED", {})
    monkeypatch.setattr(conftest, "CPU_REPORT", 1)
    for nodeid, cpu in [("tests/a.py::x", 1.5), ("tests/a.py::x", 0.5), ("tests/b.py::y[1]", 1.0)]:
        conftest.pytest_runtest_logreport(_Report(nodeid, cpu))  # type: ignore[arg-type]
    assert conftest.CPU_SECONDS == {"tests/a.py": 2.0, "tests/b.py": 1.0}
    terminal = _Terminal()
    conftest.pytest_terminal_summary(terminal)
    assert terminal.lines[1:] == [
        "     2.0 s  tests/a.py",
        "CPU time of the tests and their child processes: 3 s (whatever the load; "
        "ASYNC_STAGER_CPU_REPORT=N lists the N costliest modules)",
    ]
