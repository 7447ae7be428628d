"""Progress of a Checkpointer's saves where a person watches: one status line.

``watch(ckpt, out)`` prints the in-flight view (``Checkpointer.in_flight()``) every
``interval`` seconds until cancelled: on a terminal one line redrawn in place, else a
line each time the status changes (a CI log shows each phase once). Used by ``demo
--checkpoint``; any service can run it beside its training loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TextIO

import anyio

from async_stager._checkpoint.progress import status_line

if TYPE_CHECKING:
    from async_stager._checkpoint.checkpointer import Checkpointer

__all__ = ["status_line", "watch"]


async def watch(ckpt: Checkpointer, out: TextIO, interval: float = 0.25) -> None:
    """Print ``status_line(ckpt.in_flight())`` on ``out`` every ``interval`` seconds
    until cancelled. Cancellation: it stops; on a terminal the line is ended first."""
    tty = out.isatty()
    last = None
    try:
        while True:
            line = status_line(ckpt.in_flight())
            if tty:
                out.write("\r\x1b[K" + line)
                out.flush()
            else:
                # Off a terminal the seconds would make every line new: a line per phase.
                key = tuple((p.step, p.phase) for p in ckpt.in_flight())
                if key != last:
                    out.write(line + "\n")
                    out.flush()
                    last = key
            await anyio.sleep(interval)
    finally:
        if tty:
            out.write("\n")
            out.flush()
