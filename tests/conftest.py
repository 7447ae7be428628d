"""Shared fixtures: every async test runs on asyncio, asyncio+uvloop and trio.

Markers (declared once, in pyproject.toml): ``cuda`` tests skip without a CUDA device;
``stress`` tests skip unless ``ASYNC_STAGER_STRESS=1`` is set (the one gate, here), so
the default run and CI leave them out. The stress run:
``ASYNC_STAGER_STRESS=1 python -m pytest -m stress``. ``slow`` tests (the heaviest
process tests: multi-rank jobs, crash chains, the examples under torchrun, the GPU
check's dry run) skip unless ``ASYNC_STAGER_SLOW=1`` is set (the gate, here): the
README's command leaves them out, and CI runs them in a second call,
``ASYNC_STAGER_SLOW=1 python -m pytest -q -n auto --dist loadgroup -m slow`` (.ci/run).
"""

from __future__ import annotations

import gc
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

# tests/ is a package (for mypy); its helper modules (helpers.py, the child scripts)
# are imported by their plain names, as the child processes import them.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# A coroutine garbage-collected unawaited warns when the collector runs, which may be in
# a later test on the same worker (an error there, under -W error). Recording where each
# coroutine was made puts the test that made it into that warning's text.
sys.set_coroutine_origin_tracking_depth(12)

HAS_CUDA = torch.cuda.is_available()
#: Stress runs are on when ASYNC_STAGER_STRESS is set to anything but "" or "0".
STRESS = os.environ.get("ASYNC_STAGER_STRESS", "") not in ("", "0")
#: Slow process tests run when ASYNC_STAGER_SLOW is set to anything but "" or "0", and in
#: stress runs (a stress test in a slow module carries both markers).
SLOW = STRESS or os.environ.get("ASYNC_STAGER_SLOW", "") not in ("", "0")

try:
    import uvloop  # noqa: F401

    _BACKENDS: list[Any] = [
        pytest.param(("asyncio", {}), id="asyncio"),
        pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
        pytest.param(("trio", {}), id="trio"),
    ]
except ImportError:  # pragma: no cover - uvloop missing on this platform
    _BACKENDS = [pytest.param(("asyncio", {}), id="asyncio"), pytest.param(("trio", {}), id="trio")]


@pytest.fixture(params=_BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


#: Test modules that start processes (ranks, a writer beside its trainer, a child
#: Python, torchrun) or otherwise run for seconds per test. Under pytest-xdist (``-n
#: auto --dist loadgroup``, the README's command) they are collected first, so the
#: workers start on the long tests and end on the short ones, and the last worker
#: does not run a long test alone while the others idle. They are not serialized:
#: each test has its own ports (a free one per run) and folders (``tmp_path``), so two
#: of them run side by side on two workers; their timeouts are hang guards sized for
#: that (see CONTRIBUTING.md, "Tests").
PROCESS_MODULES = {
    "test_multirank",
    "test_multirank_crash",
    "test_checkpointer_budget",
    "test_node_budget_procs",
    "test_dcp_budget_procs",
    "test_torch_checkpointing",
    "test_ledger_procs",
    "test_process_writer",
    "test_writer_process",
    "test_fsdp_example",
    "test_gpu_readiness",
    "test_examples",
    "test_lifecycle",
    "test_checkpointer_crash",
    "test_checkpointer_model",
    "test_bench",
    "test_reliability_leaks",
    "test_reliability_cancel",
    "test_reliability_input",
    "test_cli_check",
    "test_checkpointer_trust",
    "test_compare_edges",
    "test_checkpointer_edges",
    "test_budget_objects",
    "test_share_views",
    "test_agent_process",
    "test_agent_lifetime",
    "test_job_kills",
    "test_checkpointer_agent_crash",
    "test_service_example",
    "test_checkpointer_paths",
    "test_reliability_faults",
    "test_store_kill",
    "test_store_faults",
    "test_dependencies",
}

#: Modules whose tests share one module-scoped child process or run (spawning a writer
#: costs seconds; the bench CLI tests share one bench run): each is its own xdist
#: group, so its tests run on one worker and the shared fixture is made once.
SHARED_FIXTURE_MODULES = {
    "test_process_writer",
    "test_writer_process",
    "test_bench",
}


def _module(item: pytest.Item) -> str:
    module = getattr(item, "module", None)
    return "" if module is None else str(module.__name__).rsplit(".", 1)[-1]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device")
    skip_stress = pytest.mark.skip(reason="stress run: set ASYNC_STAGER_STRESS=1 (and -m stress)")
    skip_slow = pytest.mark.skip(
        reason="slow process test (CI's second call): set ASYNC_STAGER_SLOW=1 (and -m slow)"
    )
    for item in items:
        module = _module(item)
        if module in SHARED_FIXTURE_MODULES:
            item.add_marker(pytest.mark.xdist_group(module))
        if item.get_closest_marker("cuda") is not None and not HAS_CUDA:
            item.add_marker(skip_cuda)
        if item.get_closest_marker("stress") is not None and not STRESS:
            item.add_marker(skip_stress)
        if item.get_closest_marker("slow") is not None and not SLOW:
            item.add_marker(skip_slow)
    # Long first (a stable sort: each module keeps its order). Every worker collects
    # the same order, as pytest-xdist requires.
    items.sort(key=lambda item: _module(item) not in PROCESS_MODULES)


# -- hang guards: how close each test came to its timeout ------------------------------

#: A test that used more than this share of its timeout is listed at the end of the
#: run: its timeout is too tight to be a hang guard on a loaded machine (raise it; see
#: CONTRIBUTING.md). Listed only, never failed: the run's load decides the durations.
MARGIN = 0.2
_used: dict[str, tuple[float, float]] = {}


def _timeout(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    if marker is not None and "timeout" in marker.kwargs:
        return float(marker.kwargs["timeout"])
    return float(item.config.getini("timeout") or 0)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if call.when == "setup":  # travels with the reports to pytest-xdist's controller
        report.user_properties.append(("timeout_s", _timeout(item)))
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    timeout = dict(report.user_properties).get("timeout_s")
    used, limit = _used.get(report.nodeid, (0.0, 0.0))
    if isinstance(timeout, (int, float)) and timeout > 0:
        limit = float(timeout)
    _used[report.nodeid] = (used + report.duration, limit)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    tight = sorted(
        ((used / limit, used, limit, nodeid) for nodeid, (used, limit) in _used.items() if limit > 0),
        reverse=True,
    )
    tight = [row for row in tight if row[0] > MARGIN]
    if tight:
        terminalreporter.section(
            f"tests that used over {MARGIN:.0%} of their timeout (hang guards too tight?)"
        )
        for share, used, limit, nodeid in tight:
            terminalreporter.line(f"{share:5.0%} {used:7.1f} s of {limit:5.0f} s  {nodeid}")


@pytest.fixture
def no_thread_leak() -> Iterator[None]:
    """Fails the test if it leaves an async_stager worker thread running."""
    yield
    gc.collect()
    left = [t for t in threading.enumerate() if t.name.startswith("async-stager")]
    for t in left:
        t.join(2.0)
    left = [t for t in left if t.is_alive()]
    assert not left, f"worker threads left running: {left}"


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))
