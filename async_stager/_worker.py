"""The stager's one worker thread: runs jobs in submission order.

One thread per stager, started at the first job and joined by ``stop``: staging work is
serialized (a stage never interleaves with another), and a closed stager leaves no
thread behind. Jobs report through ``concurrent.futures.Future``.
"""

from __future__ import annotations

import os
import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from ._errors import StagingError

__all__ = ["Worker", "WorkerStopped"]

T = TypeVar("T")
_Item = tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]


class WorkerStopped(RuntimeError):
    """The worker was stopped; no job is accepted any more."""


class Worker:
    """A single thread with a FIFO of jobs; ``nice`` lowers its CPU priority (Linux)."""

    def __init__(self, name: str = "async-stager", *, nice: int = 0) -> None:
        self._name = name
        self._nice = nice
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stopped = False

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Queue ``fn(*args)``. Raises WorkerStopped after ``stop``, and StagingError
        if the thread cannot be started (the worker stays startable)."""
        fut: Future[T] = Future()
        with self._lock:
            if self._stopped:
                raise WorkerStopped("worker stopped")
            if self._thread is None:
                # A daemon thread: a stager that is never closed must not keep the
                # interpreter from exiting; close() joins it deterministically.
                thread = threading.Thread(
                    target=_run, args=(self._queue, self._nice), name=self._name, daemon=True
                )
                try:
                    thread.start()
                except RuntimeError as e:
                    raise StagingError(f"could not start the staging worker thread: {e}") from e
                self._thread = thread
                # A stager dropped without close(): when this Worker is collected,
                # the thread is told to end (after the jobs queued before), instead
                # of waiting on its queue until the process exits.
                weakref.finalize(self, self._queue.put, None)
            self._queue.put((fut, fn, args))
        return fut

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float | None = None) -> None:
        """Finish queued jobs, then end the thread; idempotent."""
        with self._lock:
            thread = self._thread
            if not self._stopped:
                self._stopped = True
                if thread is not None:
                    self._queue.put(None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)


def _run(q: queue.SimpleQueue[_Item | None], nice: int) -> None:
    # A module function, not a bound method: the thread must not keep the Worker (and
    # through it the stager) alive.
    if nice and hasattr(os, "setpriority"):
        # Staging is background work: a lower CPU priority for this thread (and for the
        # OpenMP team torch creates from it, which inherits it) lets the event loop
        # thread preempt big host copies sooner. Trade-off: on a machine whose cores
        # are all busy (data loaders), a high niceness starves the stage (CFS weight
        # 15/1024 at nice 19); the default 5 keeps a third of a core's share.
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        except OSError:
            pass
    while True:
        item = q.get()
        if item is None:
            return
        fut, fn, args = item
        del item
        if fut.set_running_or_notify_cancel():
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                fut.set_exception(e)
                del e
        # Drop this job's references before blocking on the next one.
        del fut, fn, args
