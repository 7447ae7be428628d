"""The OpenMP runtime torch loaded, reached through ctypes: a thread's team size.

The host copy pool (``_hostcopy``) copies single-threaded on each of its threads; the
team size is set per thread with ``omp_set_num_threads`` of the runtime torch itself
calls, which changes only the calling thread. ``torch.set_num_threads`` would also
change a process-wide default that threads started later inherit, so it is only the
fallback when no runtime can be reached (then no helper threads are used at all).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["helpers_supported", "omp_threads", "runtime"]


class _OpenMP:
    """``omp_get_max_threads``/``omp_set_num_threads`` of the runtime torch loaded."""

    def __init__(self, lib: Any) -> None:
        self._get = lib.omp_get_max_threads
        self._get.restype = ctypes.c_int
        self._get.argtypes = []
        self._set = lib.omp_set_num_threads
        self._set.restype = None
        self._set.argtypes = [ctypes.c_int]

    def get(self) -> int:
        return int(self._get())

    def set(self, n: int) -> None:
        self._set(n)


def _controls_torch(omp: _OpenMP) -> bool:
    """True when ``omp`` sets the team size torch sees (checked on a scratch thread)."""
    seen: list[int] = []

    def probe() -> None:
        torch.get_num_threads()  # torch's lazy per-thread setup first
        omp.set(1)
        seen.append(torch.get_num_threads())
        omp.set(2)
        seen.append(torch.get_num_threads())

    t = threading.Thread(target=probe, name="async-stager-omp-probe", daemon=True)
    t.start()
    t.join()
    return seen == [1, 2]


def _findruntime() -> _OpenMP | None:
    """The OpenMP entry points torch itself calls, or None.

    Looked up first through torch's own library (a lookup through a library's handle
    searches its dependencies, so it finds the runtime torch was linked with even when
    another extension loaded a second copy), then through any loaded OpenMP library;
    each candidate must be seen to change ``torch.get_num_threads()`` on a scratch
    thread.
    """
    if "OpenMP" not in torch.__config__.parallel_info().rsplit("ATen parallel backend:", 1)[-1]:
        return None
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) < 6:
                    continue
                path = fields[5].strip()
                name = os.path.basename(path)
                if name.startswith("libtorch_cpu"):
                    paths.insert(0, path)
                elif name.startswith(("libgomp", "libiomp", "libomp")):
                    paths.append(path)
    except OSError:
        pass
    seen: set[str] = set()
    for path in paths:
        if path in seen:
            continue
        seen.add(path)
        try:
            # Opening an already-loaded path returns that library, not a second copy.
            omp = _OpenMP(ctypes.CDLL(path))
        except (OSError, AttributeError):
            continue
        if _controls_torch(omp):
            return omp
    return None


@functools.cache
def runtime() -> _OpenMP | None:
    """The OpenMP runtime torch calls, looked up once per process; None if unreachable."""
    # Once per process (two first callers at once may both look: harmless).
    return _findruntime()


def helpers_supported() -> bool:
    """True when copy threads can be made single-threaded one by one (see module doc)."""
    return runtime() is not None


@contextlib.contextmanager
def omp_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op threads for copies made by this thread inside the block
    (None: unchanged). Per thread when the OpenMP runtime is reachable; otherwise
    through ``torch.set_num_threads`` (process-wide default, put back right after)."""
    if n is None:
        yield
        return
    # torch sets a thread's team size lazily, on its first parallel op, from its own
    # process-wide default: trigger that first, or it would undo ours.
    before = torch.get_num_threads()
    if n == before:
        yield
        return
    omp = runtime()
    if omp is not None:
        omp.set(n)
        try:
            yield
        finally:
            omp.set(before)
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
