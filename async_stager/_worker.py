"""The stager's one worker thread: runs jobs in submission order.

One thread per stager, started at the first job and joined by ``stop``: staging work is
serialized (a stage never interleaves with another), and a closed stager leaves no
thread behind. Jobs report through ``concurrent.futures.Future``.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

__all__ = ["Worker"]

T = TypeVar("T")


class Worker:
    """A single thread with a FIFO of jobs."""

    def __init__(self, name: str = "async-stager") -> None:
        self._name = name
        self._queue: queue.SimpleQueue[
            tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None
        ] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stopped = False

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Queue ``fn(*args)``; raises RuntimeError after ``stop``."""
        fut: Future[T] = Future()
        with self._lock:
            if self._stopped:
                raise RuntimeError("worker stopped")
            if self._thread is None:
                # A daemon thread: a stager that is never closed must not keep the
                # interpreter from exiting; close() joins it deterministically.
                self._thread = threading.Thread(
                    target=_run, args=(self._queue,), name=self._name, daemon=True
                )
                self._thread.start()
            self._queue.put((fut, fn, args))
        return fut

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def in_worker(self) -> bool:
        return threading.current_thread() is self._thread

    def stop(self, timeout: float | None = None) -> None:
        """Finish queued jobs, then end the thread; idempotent."""
        with self._lock:
            if self._stopped:
                thread = self._thread
            else:
                self._stopped = True
                thread = self._thread
                if thread is not None:
                    self._queue.put(None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)


def _run(
    q: queue.SimpleQueue[
        tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None
    ],
) -> None:
    # A module function, not a bound method: the thread must not keep the Worker (and
    # through it the stager) alive.
    while True:
        item = q.get()
        if item is None:
            return
        fut, fn, args = item
        del item
        if not fut.set_running_or_notify_cancel():
            continue
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            fut.set_exception(e)
            del e
        # Drop this job's references before blocking on the next one.
        del fut, fn, args
