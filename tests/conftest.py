"""Shared fixtures: every async test runs on asyncio, asyncio+uvloop and trio."""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_cuda)


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
