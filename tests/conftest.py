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
import resource
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
    "test_checkpointer_s3_procs",
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
    "test_agent_signals",
    "test_agent_lifetime",
    "test_job_kills",
    "test_checkpointer_agent_crash",
    "test_replication",
    "test_replication_faults",
    "test_service_example",
    "test_checkpointer_paths",
    "test_reliability_faults",
    "test_store_kill",
    "test_store_faults",
    "test_dependencies",
    "test_incremental_ranks",
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
TIME_USED: dict[str, tuple[float, float]] = {}


def _timeout(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    if marker is not None and "timeout" in marker.kwargs:
        return float(marker.kwargs["timeout"])
    return float(item.config.getini("timeout") or 0)


# -- CPU time: what the suite costs, whatever the machine's load ----------------------

#: ASYNC_STAGER_CPU_REPORT=N lists the N modules that cost the most CPU time at the end
#: of the run; the total is always printed. CPU seconds, unlike wall time, do not grow
#: with the load: they are how to tell whether a change keeps the README's command
#: within its time (CONTRIBUTING.md, "Tests").
CPU_REPORT = int(os.environ.get("ASYNC_STAGER_CPU_REPORT", "0") or 0)
_cpu_mark = [0.0]
CPU_SECONDS: dict[str, float] = {}


def _cpu_now() -> float:
    """CPU seconds of this process (every thread) and of its child processes that ended
    (and theirs, when each waited for its own: ranks under torchrun, a spawned writer)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _cpu_mark[0] = _cpu_now()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    # Both travel with the reports to pytest-xdist's controller.
    if call.when == "setup":
        report.user_properties.append(("timeout_s", _timeout(item)))
    now = _cpu_now()
    report.user_properties.append(("cpu_s", now - _cpu_mark[0]))
    _cpu_mark[0] = now
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    properties = dict(report.user_properties)
    timeout = properties.get("timeout_s")
    used, limit = TIME_USED.get(report.nodeid, (0.0, 0.0))
    if isinstance(timeout, (int, float)) and timeout > 0:
        limit = float(timeout)
    TIME_USED[report.nodeid] = (used + report.duration, limit)
    cpu = properties.get("cpu_s")
    if isinstance(cpu, (int, float)):
        module = report.nodeid.split("::", 1)[0]
        CPU_SECONDS[module] = CPU_SECONDS.get(module, 0.0) + float(cpu)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if CPU_SECONDS:
        if CPU_REPORT > 0:
            terminalreporter.section(f"the {CPU_REPORT} modules that cost the most CPU time")
            for module, seconds in sorted(CPU_SECONDS.items(), key=lambda kv: -kv[1])[:CPU_REPORT]:
                terminalreporter.line(f"{seconds:8.1f} s  {module}")
        terminalreporter.line(
            f"CPU time of the tests and their child processes: {sum(CPU_SECONDS.values()):.0f} s"
            " (whatever the load; ASYNC_STAGER_CPU_REPORT=N lists the N costliest modules)"
        )
    tight = sorted(
        ((used / limit, used, limit, nodeid) for nodeid, (used, limit) in TIME_USED.items() if limit > 0),
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
