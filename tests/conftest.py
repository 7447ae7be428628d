"""Shared fixtures: every async test runs on asyncio, asyncio+uvloop and trio.

Markers (declared once, in pyproject.toml): ``cuda`` tests skip without a CUDA device;
``stress`` tests skip unless ``ASYNC_STAGER_STRESS=1`` is set (the one gate, here), so
the default run and CI leave them out. The stress run:
``ASYNC_STAGER_STRESS=1 python -m pytest -m stress``.
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

HAS_CUDA = torch.cuda.is_available()
#: Stress runs are on when ASYNC_STAGER_STRESS is set to anything but "" or "0".
STRESS = os.environ.get("ASYNC_STAGER_STRESS", "") not in ("", "0")

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


#: Test modules that run several processes at once (ranks, a writer beside its
#: trainer) and use every core while they run. Under pytest-xdist (``-n auto --dist
#: loadgroup``, the README's command) they form one group, run one after another on one
#: worker while the other workers take the rest: two of them at once on 2 cores would
#: only slow each other and put their timeouts at risk. Modules that start one child at
#: a time are not in it.
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
}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device")
    skip_stress = pytest.mark.skip(reason="stress run: set ASYNC_STAGER_STRESS=1 (and -m stress)")
    processes = pytest.mark.xdist_group("processes")
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and module.__name__.rsplit(".", 1)[-1] in PROCESS_MODULES:
            item.add_marker(processes)
        if item.get_closest_marker("cuda") is not None and not HAS_CUDA:
            item.add_marker(skip_cuda)
        if item.get_closest_marker("stress") is not None and not STRESS:
            item.add_marker(skip_stress)


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
