"""Blocking work in a thread of its own, awaited without blocking the event loop.

The one home of "run it in a thread, and say what cancellation means": the
Checkpointer's writes, commits and restores, ``dcp.save``'s write, and the checksum
threads all start their threads here. Two rules, picked per call:

- ``abandon_on_cancel=False`` (default): cancellation is deferred until the thread
  returns (``wait_future_uninterrupted``), so work that must not be left half done (a
  save in flight, a commit, a lock file) ends before the caller sees the cancellation.
- ``abandon_on_cancel=True``: cancelling stops only the wait; the thread goes on. For
  a write the Checkpointer abandons at a missed shutdown deadline (with
  ``daemon=True``, so it cannot keep the process alive either).

Hazard: the thread lets go of ``fn`` (and of what its closure holds: typically a
staged dict) before it completes the future, and the error's finished frames are
cleared (``clear_locals``), so a waiter woken by the result never finds the staged
buffers still held by this module.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from async_stager._core.aio.waiting import wait_future, wait_future_uninterrupted
from async_stager._core.run.worker import clear_locals

__all__ = ["run_in_thread", "start_thread"]

T = TypeVar("T")


def start_thread(fn: Callable[[], T], *, name: str, daemon: bool = False) -> Future[T]:
    """Start ``fn`` in a new thread named ``name``; its Future gives the result or the
    error. Not a daemon by default: an interpreter that exits waits for it (a write is
    never killed halfway through a file)."""
    fut: Future[T] = Future()
    box = [fn]
    del fn

    def target() -> None:
        f = box.pop()
        if not fut.set_running_or_notify_cancel():
            return
        try:
            result = f()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            del f
            clear_locals(exc)
            fut.set_exception(exc)
            return
        del f
        fut.set_result(result)

    threading.Thread(target=target, name=name, daemon=daemon).start()
    return fut


async def run_in_thread(
    fn: Callable[[], T], *, name: str, daemon: bool = False, abandon_on_cancel: bool = False
) -> T:
    """Run ``fn`` in a new thread and await its result.

    Cancellation: with ``abandon_on_cancel=False`` deferred until ``fn`` has returned,
    then raised (its result is lost; its side effects remain; if it failed too, its
    error is the cancellation's cause). With ``abandon_on_cancel=True`` only the wait
    is cancelled and ``fn`` goes on in its thread."""
    fut = start_thread(fn, name=name, daemon=daemon)
    if abandon_on_cancel:
        return await wait_future(fut)
    return await wait_future_uninterrupted(fut)
