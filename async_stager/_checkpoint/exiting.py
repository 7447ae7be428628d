"""Leaving the process after a missed exit deadline: the exit status survives a write's
thread that is still inside torch, and a close that would wait for a stage still
running (a value slow to copy) is left to its thread.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Callable

import anyio

from async_stager._core.aio.threads import start_thread
from async_stager._core.aio.waiting import wait_future
from async_stager._core.interp import library_thread

__all__ = ["CLOSE_GRACE", "close_by", "exit_fast_if_abandoned"]

#: Seconds a close after a missed deadline may take beyond it (an idle stager closes in
#: milliseconds; one whose thread is inside a slow value's copy would take as long).
CLOSE_GRACE = 0.1

_exit_hook: list[int] = []


def exit_fast_if_abandoned(code: int) -> None:
    """At interpreter exit, if an abandoned write's thread is still inside torch (a
    daemon thread), leave with ``os._exit(code)`` after flushing stdio: finalizing the
    interpreter under it aborts the process ("terminate called without an active
    exception", status 134), so the exit status a scheduler reads would be lost."""
    if _exit_hook:
        _exit_hook[0] = code
        return
    _exit_hook.append(code)

    def hook() -> None:
        import sys
        import threading

        busy = [t for t in threading.enumerate() if t.daemon and t.is_alive() and library_thread(t)]
        if busy:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            os._exit(_exit_hook[0])

    atexit.register(hook)


async def close_by(close: Callable[[], None], deadline: float, *, name: str) -> bool:
    """Run the blocking ``close`` in a daemon thread named ``name`` and wait for it until
    ``deadline`` (anyio clock; ``CLOSE_GRACE`` at least): True if it ended by then,
    False if it was left to finish in its thread (the process leaves meanwhile).
    Cancellation: only the wait; the close goes on."""
    fut = start_thread(close, name=name, daemon=True)
    with anyio.CancelScope(deadline=max(deadline, anyio.current_time() + CLOSE_GRACE)):
        await wait_future(fut)
    return fut.done()
