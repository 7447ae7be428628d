"""The simulated device's streams and events (``simulated``): a stream is a queue of
operations run in order by its own thread, each after a delay drawn at its enqueue from
the stream's own seeded generator; an event is a position in a stream's queue.
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

import torch

from async_stager._core.copy.simulated_memory import Slab

__all__ = ["Event", "Host", "SimulatedStream"]


class Host(Protocol):
    """What a stream reads of its device (``SimulatedDevice``): the lock its queues and
    memory share, whether it is closed, where device errors go, the seed and delays of
    its operations, and its memory (reaped as operations end)."""

    cond: threading.Condition
    closed: bool
    errors: list[BaseException]
    seed: int
    delay: tuple[float, float]
    kernel_delay: tuple[float, float]
    memory: Slab


class SimulatedStream:
    """A queue of operations run in order by its own thread (started at the first
    operation). ``capturing``: a test sets it to play a stream capturing a graph."""

    def __init__(self, sim: Host, name: str, number: int) -> None:
        self.sim = sim
        self.name = name
        self.number = number
        self.capturing = False
        self.queued = 0
        self.finished = 0
        #: ``time.perf_counter()`` when the last operation ended (how late a waiter
        #: saw it is measured against this).
        self.finished_at = 0.0
        self._ops: deque[Callable[[], None]] = deque()
        self._rng = random.Random(sim.seed * 1_000_003 + number)
        self._thread: threading.Thread | None = None

    def delay(self, kernel: bool = False) -> float:
        lo, hi = self.sim.kernel_delay if kernel else self.sim.delay
        return self._rng.uniform(lo, hi) if hi > 0 else 0.0

    def enqueue(self, op: Callable[[], None]) -> int:
        """Queue ``op``; returns its position (done once ``finished`` reaches it)."""
        with self.sim.cond:
            if self.sim.closed:
                raise RuntimeError("the simulated device is closed")
            self._ops.append(op)
            self.queued += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"sim-stream-{self.name}", daemon=True)
                self._thread.start()
            self.sim.cond.notify_all()
            return self.queued

    def _run(self) -> None:
        cond = self.sim.cond
        while True:
            with cond:
                while not self._ops and not self.sim.closed:
                    cond.wait()
                if not self._ops:
                    return
                op = self._ops[0]
            try:
                with torch.no_grad():
                    op()
            except BaseException as e:  # noqa: BLE001 - a device error: recorded, the stream goes on
                self.sim.errors.append(e)
            with cond:
                self._ops.popleft()
                self.finished_at = time.perf_counter()
                self.finished += 1
                self.sim.memory.reap()
                cond.notify_all()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def __repr__(self) -> str:
        return f"<SimulatedStream {self.name!r} {self.finished}/{self.queued}>"


class Event:
    """A position in a stream's queue: done once the stream has run everything queued
    before it."""

    __slots__ = ("position", "stream")

    def __init__(self, stream: SimulatedStream, position: int) -> None:
        self.stream, self.position = stream, position

    def done(self) -> bool:
        return self.stream.finished >= self.position
