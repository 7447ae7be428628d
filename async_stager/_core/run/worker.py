"""The stager's one worker thread: runs jobs in submission order.

One thread per stager, started at the first job and joined by ``stop``: staging work is
serialized (a stage never interleaves with another), and a closed stager leaves no
thread behind. Jobs report through ``concurrent.futures.Future``.

Lifecycle hazards:

- Interpreter exit with a stager never closed: the thread is a daemon (it must not keep
  the process alive), and a daemon thread still inside torch when the interpreter
  finalizes aborts the process (see ``_interp``). An exit hook stops every worker
  thread first: jobs not started yet are cancelled, the running job is asked to stop
  (its ``cancel`` event, when it gave one) and is waited for, copies included.
- ``os.fork()``: the thread does not exist in the child. A worker whose thread was
  started in another process refuses every job with ``WorkerForked`` (a
  ``WorkerStopped``) instead of queueing jobs nobody runs; a worker never started may
  start in the child.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import queue
import sys
import threading
import traceback
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from async_stager._core import interp as _interp
from async_stager.errors import StagingError

__all__ = ["FifoLock", "Worker", "WorkerForked", "WorkerStopped", "clear_locals"]

T = TypeVar("T")
_Item = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], "threading.Event | None"]


class WorkerStopped(RuntimeError):
    """The worker was stopped; no job is accepted any more."""


class WorkerForked(WorkerStopped):
    """The worker's thread was started in another process (this one was forked from it)."""


class _Control:
    """What the thread, its Worker and the process-wide hooks share. The thread and the
    hooks hold this, never the Worker, so that a dropped stager can be collected."""

    __slots__ = ("current", "exiting", "lock", "pid", "queue", "stopped", "thread")

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.stopped = False
        #: Set by the exit hook: queued jobs are cancelled instead of run.
        self.exiting = False
        #: The cancel event of the job running now (None: none, or it gave none).
        self.current: threading.Event | None = None
        self.thread: threading.Thread | None = None
        #: The process that started the thread.
        self.pid = 0

    def begin_exit(self) -> None:
        with self.lock:
            self.stopped = True
            self.exiting = True
            if self.current is not None:
                self.current.set()
            self.queue.put(None)


#: Controls of the worker threads running in this process.
_live: set[_Control] = set()
_live_lock = threading.Lock()


def _exit_hook() -> None:
    with _live_lock:
        controls = list(_live)
    for c in controls:
        c.begin_exit()
    for c in controls:
        t = c.thread
        if t is not None and t is not threading.current_thread():
            t.join(_interp.EXIT_JOIN_SECONDS)


def _after_fork_in_child() -> None:
    global _live_lock
    _live_lock = threading.Lock()
    _live.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Worker:
    """A single thread with a FIFO of jobs; ``nice`` lowers its CPU priority (Linux)."""

    def __init__(self, name: str = f"{_interp.THREAD_PREFIX}worker", *, nice: int = 0) -> None:
        self._name = name
        self._nice = nice
        self._ctl = _Control()

    @property
    def forked(self) -> bool:
        """True in a process forked after this worker's thread was started."""
        ctl = self._ctl
        return ctl.thread is not None and ctl.pid != os.getpid()

    def forked_error(self) -> WorkerForked:
        return WorkerForked(
            f"this stager's worker thread was started in process {self._ctl.pid}, and this "
            f"is process {os.getpid()}, forked from it: a stager cannot stage across "
            "os.fork() (its thread and copies are not in the child, and its host buffers "
            "may be shared with the parent); create a new stager in the child"
        )

    def submit(self, fn: Callable[..., T], *args: Any, cancel: threading.Event | None = None) -> Future[T]:
        """Queue ``fn(*args)``. ``cancel``: an event the job checks; it is set at
        interpreter exit if the job is running then. Raises WorkerStopped after
        ``stop``, WorkerForked in a forked child, and StagingError if the thread cannot
        be started (the worker stays startable)."""
        if self.forked:
            # Before taking the lock: the parent may have held it when it forked.
            raise self.forked_error()
        ctl = self._ctl
        fut: Future[T] = Future()
        with ctl.lock:
            if ctl.stopped:
                raise WorkerStopped("worker stopped")
            if ctl.thread is None:
                # A daemon thread: a stager that is never closed must not keep the
                # interpreter from exiting; close() joins it deterministically, and the
                # exit hook stops it before the interpreter finalizes.
                thread = threading.Thread(target=_run, args=(ctl, self._nice), name=self._name, daemon=True)
                if not self._name.startswith(_interp.THREAD_PREFIX):
                    _interp.adopt_thread(thread)  # named by its caller: still the library's
                _interp.at_exit(_exit_hook, order=0)
                with _live_lock:
                    _live.add(ctl)
                ctl.pid = os.getpid()  # before ``thread``: ``forked`` reads both
                try:
                    thread.start()
                except RuntimeError as e:
                    with _live_lock:
                        _live.discard(ctl)
                    raise StagingError(f"could not start the staging worker thread: {e}") from e
                ctl.thread = thread
                # A stager dropped without close(): when this Worker is collected,
                # the thread is told to end (after the jobs queued before), instead
                # of waiting on its queue until the process exits.
                weakref.finalize(self, ctl.queue.put, None)
            ctl.queue.put((fut, fn, args, cancel))
        return fut

    @property
    def alive(self) -> bool:
        t = self._ctl.thread
        return t is not None and t.is_alive() and not self.forked

    def stop(self, timeout: float | None = None) -> None:
        """Finish queued jobs, then end the thread; idempotent. In a forked child there
        is no thread: the worker is only marked stopped."""
        ctl = self._ctl
        if self.forked:
            ctl.stopped = True
            return
        with ctl.lock:
            thread = ctl.thread
            if not ctl.stopped:
                ctl.stopped = True
                if thread is not None:
                    ctl.queue.put(None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)


def _run(ctl: _Control, nice: int) -> None:
    # A module function holding only the control block, not the Worker: the thread
    # must not keep the Worker (and through it the stager) alive.
    try:
        _serve(ctl, nice)
    finally:
        with _live_lock:
            _live.discard(ctl)


def set_os_thread_name(name: str) -> None:
    """Name the calling thread at OS level too (``top -H``, ``py-spy``, ``gdb``, and
    ``/proc/self/task/<tid>/comm`` on Linux), best effort: Linux keeps 15 bytes (cut
    at a character boundary), macOS 63; elsewhere, or if the call fails, nothing."""
    try:
        raw = name.encode("utf-8", "replace")
        if sys.platform.startswith("linux"):
            raw = raw[:15].decode("utf-8", "ignore").encode("utf-8")
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(15, ctypes.c_char_p(raw), 0, 0, 0)  # PR_SET_NAME: this thread
        elif sys.platform == "darwin":
            raw = raw[:63].decode("utf-8", "ignore").encode("utf-8")
            path = ctypes.util.find_library("c")
            if path:
                ctypes.CDLL(path).pthread_setname_np(ctypes.c_char_p(raw))
    except (OSError, AttributeError, ValueError):
        pass


def _serve(ctl: _Control, nice: int) -> None:
    set_os_thread_name(threading.current_thread().name)
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
    q = ctl.queue
    while True:
        item = q.get()
        if item is None:
            return
        fut, fn, args, cancel = item
        del item
        with ctl.lock:
            exiting = ctl.exiting
            if not exiting:
                ctl.current = cancel
        if exiting:
            # The interpreter is exiting: nobody is left to wait for this job. (Outside
            # the lock: the future's callbacks run here.)
            fut.cancel()
        if fut.set_running_or_notify_cancel():
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                clear_locals(e)
                fut.set_exception(e)
                del e
        with ctl.lock:
            ctl.current = None
        # Drop this job's references before blocking on the next one.
        del fut, fn, args, cancel


def clear_locals(exc: BaseException) -> None:
    """Drop the locals of the finished frames an error's traceback holds (and those of
    its cause and context). Hazard: the error lives on in the job's future, and those
    frames hold a half-built staged result (which would keep its buffer set held) and
    the source tensors (which would keep their memory alive) for as long as it does.
    The error's message, type, path and traceback lines stay as they are."""
    seen: set[int] = set()
    stack: list[BaseException] = [exc]
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        stack.extend(x for x in (e.__cause__, e.__context__) if x is not None)


class FifoLock:
    """Stages of one stager, one at a time, in submission order (on a shared executor,
    whichever of its threads picks a stage up): a ticket per stage at submission,
    released once the stage ran or its Future was cancelled before it started."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._issued = 0
        self._serving = 0
        self._over: set[int] = set()

    def ticket(self) -> int:
        with self._cond:
            t = self._issued
            self._issued += 1
            return t

    def acquire(self, ticket: int) -> None:
        with self._cond:
            while self._serving != ticket:
                self._cond.wait()

    def release(self, ticket: int) -> None:
        with self._cond:
            self._over.add(ticket)
            while self._serving in self._over:
                self._over.remove(self._serving)
                self._serving += 1
            self._cond.notify_all()
