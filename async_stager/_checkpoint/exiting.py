"""Leaving the process after a missed exit deadline: the exit status survives a write's
thread that is still inside torch.
"""

from __future__ import annotations

import atexit
import os

__all__ = ["exit_fast_if_abandoned"]

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

        busy = [
            t
            for t in threading.enumerate()
            if t.daemon and t.is_alive() and t.name.startswith("async-stager-")
        ]
        if busy:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            os._exit(_exit_hook[0])

    atexit.register(hook)
