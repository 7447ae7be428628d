"""Benchmark measurements: the contenders, the one-buffer bound, the loop-lag ticker.

Every contender is staged the same way, from a coroutine on the running asyncio loop,
while a ticker task sleeps 1 ms at a time and records how late each wake-up was: that
lateness is the event-loop lag a training loop's other coroutines (heartbeats, RPCs,
data loading) would see while a checkpoint is staged.

- ``ours``: ``await Stager().stage(sd)``.
- ``ours.DefaultStager``: the seed's API on our engine, in async mode, its Future
  awaited like DCP's: the like-for-like row against DCP.
- ``dcp``: PyTorch DCP's ``DefaultStager`` in async mode; its ``concurrent.futures``
  Future is awaited through ``asyncio.wrap_future``.
- the bound: ``dst.copy_(src)`` of one contiguous buffer with the same bytes (on a GPU:
  device to pinned host, ``non_blocking`` and a synchronize), the best any stager can do.
  It is timed like a contender (the copy in a worker thread while the ticker runs),
  so the ticker's own cost (each wake-up takes a core from the copy for a moment)
  weighs on both sides of the ratio; ``OneBufferCopy.run`` times it on the calling thread
  with nothing else running, reported as well.
- the limit (``ForeachCopyLimit``): one ``torch._foreach_copy_`` of the same tensors
  into host tensors that already exist: the bare copy a cached stage pays for, per
  tensor (the bound is one buffer: no per-tensor cost at all).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.utils._pytree import tree_leaves

from async_stager._core.aio.stager import Stager
from async_stager._core.interp import THREAD_PREFIX
from async_stager._dcp.default_stager import DefaultStager
from async_stager._dcp.interface import CheckpointStagerConfig

from .report import LIMIT_ROW

__all__ = [
    "LIMIT",
    "ForeachCopyLimit",
    "OneBufferCopy",
    "Contender",
    "DcpContender",
    "OursContender",
    "DefaultStagerContender",
    "idle_lag",
    "open_fds",
    "timed_stage",
]

#: The name of the copy limit's row (``ForeachCopyLimit``).
LIMIT = LIMIT_ROW


def open_fds() -> int:
    """File descriptors open in this process (Linux ``/proc/self/fd``; 0 elsewhere)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def synchronize(device: torch.device) -> None:
    """Wait for all work queued on ``device`` (nothing to do on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Contender(Protocol):
    """A stager under test."""

    name: str

    async def stage(self, sd: Any) -> None:
        """Stage ``sd`` completely (host copies landed) and drop the result."""

    def host_bytes(self) -> int | None:
        """Host memory (bytes) the stager holds, or None if it does not say."""

    async def close(self) -> None:
        """Release everything."""


class OursContender:
    """async_stager's ``Stager``; ``copy_threads=None`` keeps its default (``"auto"``,
    decided per copy program), a number overrides it."""

    def __init__(self, name: str, *, copy_threads: int | None = None, share_memory: bool = False) -> None:
        self.name = name
        self._stager = Stager(copy_threads=copy_threads, share_memory=share_memory)

    async def stage(self, sd: Any) -> None:
        staged = await self._stager.stage(sd)
        del staged

    def host_bytes(self) -> int | None:
        return self._stager.host_bytes

    async def close(self) -> None:
        await self._stager.aclose()


class DefaultStagerContender:
    """async_stager's ``DefaultStager`` (the seed's API) in async mode; its Future is
    awaited through ``asyncio.wrap_future``, exactly as DCP's is."""

    def __init__(self, name: str, *, share_memory: bool = False) -> None:
        self.name = name
        self._stager = DefaultStager(CheckpointStagerConfig(use_shared_memory=share_memory))

    async def stage(self, sd: Any) -> None:
        fut = self._stager.stage(sd)
        assert isinstance(fut, concurrent.futures.Future)
        staged = await asyncio.wrap_future(fut)
        del staged

    def host_bytes(self) -> int | None:
        return self._stager.host_bytes

    async def close(self) -> None:
        self._stager.close()


def dcp_available() -> str | None:
    """None if DCP's DefaultStager imports, else why not (older torch)."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: F401
    except ImportError as exc:  # pragma: no cover - torch without the staging module
        return f"torch {torch.__version__} has no DCP DefaultStager ({exc})"
    return None


def dcp_stage_closes_itself() -> bool:
    """True on torch before 2.13, where DCP's ``DefaultStager._stage`` calls
    ``StateDictStager.close()``, which clears its deepcopy dispatch: the second
    ``stage()`` then fails with ``KeyError: <class 'type'>``."""
    major, minor = (int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    return (major, minor) < (2, 13)


class DcpContender:
    """PyTorch DCP's ``DefaultStager`` in async mode: pinned memory and non-blocking
    copies exactly when the device is CUDA (both need an accelerator).

    ``direct`` (default: on torch before 2.13, see ``dcp_stage_closes_itself``): DCP's
    ``StateDictStager`` driven directly, the way 2.13's ``DefaultStager._stage`` does
    (one worker thread, a staging stream made on the calling thread, the stream
    synchronized after the copies), without the ``close()`` that breaks the second
    stage; its pinned-storage cache is kept across stages as in 2.13.
    """

    def __init__(
        self, name: str, *, cuda: bool, share_memory: bool = False, direct: bool | None = None
    ) -> None:
        self.name = name
        self.direct = dcp_stage_closes_itself() if direct is None else direct
        self._cuda = cuda
        if self.direct:
            from torch.distributed.checkpoint._state_dict_stager import StateDictStager

            self._sds = StateDictStager(pin_memory=cuda, share_memory=share_memory)
            self._executor: concurrent.futures.ThreadPoolExecutor | None = (
                concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"{THREAD_PREFIX}dcp-stager")
            )
            # Made here, on the calling thread, as DCP does: not the training stream.
            self._stream = torch.cuda.Stream() if cuda else None
        else:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self._stager = DefaultStager(StagingOptions(cuda, share_memory, True, cuda))

    def _direct_stage(self, sd: Any) -> Any:
        if self._stream is None:
            return self._sds.stage(sd, non_blocking=False)
        with torch.cuda.stream(self._stream):
            staged = self._sds.stage(sd, non_blocking=True)
        self._stream.synchronize()
        return staged

    async def stage(self, sd: Any) -> None:
        if self.direct:
            assert self._executor is not None
            staged = await asyncio.wrap_future(self._executor.submit(self._direct_stage, sd))
        else:
            fut = self._stager.stage(sd)
            staged = await asyncio.wrap_future(fut)  # type: ignore[arg-type]
        del staged

    def host_bytes(self) -> int | None:
        """The bytes of DCP's cached host storages (a private attribute: None if gone)."""
        try:
            sds = self._sds if self.direct else self._stager._state_dict_stager
            mapping = sds._cached_storage_mapping
            return int(sum(s.nbytes() for s in mapping.values()))
        except (AttributeError, TypeError):
            return None

    async def close(self) -> None:
        if self.direct:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            self._sds.close()
        else:
            self._stager.close()


async def timed_stage(
    contender: Contender, sd: Any, device: torch.device, period: float = 0.001
) -> tuple[float, list[float]]:
    """Stage once; (wall seconds, lateness in seconds of each 1 ms tick meanwhile).

    The ticker is armed before the stage starts, and the tick in progress when the stage
    ends is waited for, so a loop blocked right at the end is still seen.
    """
    samples: list[float] = []
    stop = False
    synchronize(device)
    task = asyncio.create_task(_tick(samples, period, lambda: not stop))
    await asyncio.sleep(0)  # the ticker takes its first timestamp and sleeps
    t0 = time.perf_counter()
    try:
        await contender.stage(sd)
        seconds = time.perf_counter() - t0
    finally:
        stop = True
        await task
    return seconds, samples


async def idle_lag(seconds: float = 0.3, period: float = 0.001) -> list[float]:
    """Ticker lateness (seconds) with nothing else running: the loop's own floor."""
    samples: list[float] = []
    end = time.perf_counter() + seconds
    await _tick(samples, period, lambda: time.perf_counter() < end)
    return samples


async def _tick(samples: list[float], period: float, going: Callable[[], bool]) -> None:
    """The lag ticker: sleep ``period`` seconds over and over while ``going()``, and
    append how late (seconds) each wake-up was."""
    while going():
        t = time.perf_counter()
        await asyncio.sleep(period)
        samples.append(time.perf_counter() - t - period)


class ForeachCopyLimit:
    """The copy limit of a cached stage: one ``torch._foreach_copy_`` of the state
    dict's tensors into host tensors that already exist (pinned on CUDA), every core
    copying (torch's intra-op threads), in a worker thread, awaited, timed like the
    stagers. No walk, no checks, no result: what a stager of the same tensors cannot
    beat. The outputs are made (and copied into once, untimed) at the first stage of
    each state dict; for a state dict new at every stage (``fresh``) collecting its
    tensors is part of each stage's time."""

    name = LIMIT

    def __init__(self, device: torch.device) -> None:
        self.device = device
        #: The state dict the lists below were made for (kept: its id must stay its own).
        self._sd: Any = None
        self._srcs: list[torch.Tensor] = []
        self._dsts: list[torch.Tensor] = []

    def _prepare(self, sd: Any) -> None:
        if sd is self._sd:
            return
        srcs = [t for t in tree_leaves(sd) if isinstance(t, torch.Tensor)]
        same = len(srcs) == len(self._dsts) and all(
            d.shape == s.shape and d.dtype == s.dtype for d, s in zip(self._dsts, srcs)
        )
        if not same:
            cuda = self.device.type == "cuda"
            self._dsts = [torch.empty(s.shape, dtype=s.dtype, pin_memory=cuda) for s in srcs]
            self._sd, self._srcs = sd, srcs
            self.copy()  # pages touched before any timed run
        self._sd, self._srcs = sd, srcs

    def copy(self) -> None:
        """The copy, device synchronized after it (any thread)."""
        if self._dsts:
            torch._foreach_copy_(self._dsts, self._srcs, non_blocking=self.device.type == "cuda")
        synchronize(self.device)

    def _stage(self, sd: Any) -> None:
        self._prepare(sd)
        self.copy()

    async def stage(self, sd: Any) -> None:
        """Outputs made (a new state dict) and the copy, in a worker thread, awaited:
        the loop keeps running, as it does while a stager stages."""
        await asyncio.to_thread(self._stage, sd)

    def host_bytes(self) -> int | None:
        return sum(d.nbytes for d in self._dsts)

    async def close(self) -> None:
        self._sd = None
        self._srcs, self._dsts = [], []


class OneBufferCopy:
    """One contiguous buffer of ``nbytes`` on ``device`` and its host destination
    (pinned on CUDA). Both are touched (and one copy done) at construction, so no run
    pays page faults. It is also a Contender (``stage`` ignores the state dict), so it
    can be timed exactly like the stagers."""

    name = "bound (1 buffer)"

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.device = device
        cuda = device.type == "cuda"
        self._src = torch.empty(max(1, nbytes), dtype=torch.uint8, device=device).fill_(1)
        self._dst = torch.empty(max(1, nbytes), dtype=torch.uint8, pin_memory=cuda).fill_(0)
        self.run()

    def copy(self) -> None:
        """One copy of the whole buffer, device synchronized after it (any thread)."""
        self._dst.copy_(self._src, non_blocking=self.device.type == "cuda")
        synchronize(self.device)

    def run(self) -> float:
        """Seconds for one copy on the calling thread (device synchronized around it)."""
        synchronize(self.device)
        t0 = time.perf_counter()
        self.copy()
        return time.perf_counter() - t0

    async def stage(self, sd: Any) -> None:
        """The copy in a worker thread, awaited (the loop keeps running)."""
        await asyncio.to_thread(self.copy)

    def host_bytes(self) -> int | None:
        return self._dst.nbytes

    async def close(self) -> None:
        return None
