"""Progress of a Checkpointer's saves where a person watches: one status line.

``watch(ckpt, out)`` prints the in-flight view (``Checkpointer.in_flight()``) every
``interval`` seconds until cancelled: on a terminal one line redrawn in place, else a
line each time the status changes (a CI log shows each phase once). Used by ``demo
--checkpoint``; any service can run it beside its training loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TextIO

import anyio

if TYPE_CHECKING:
    from async_stager._checkpoint.checkpointer import Checkpointer
    from async_stager._checkpoint.progress import SaveProgress

__all__ = ["status_line", "watch"]


def status_line(saves: list[SaveProgress]) -> str:
    """One line for the saves in flight (``"no save in flight"`` when none): per save
    its step, phase, MiB, seconds since the call and the ETA when known."""
    if not saves:
        return "no save in flight"
    parts = []
    for p in saves:
        text = f"step {p.step}: {p.phase} {p.seconds:.1f} s"
        if p.bytes is not None:
            text += f", {p.bytes / 2**20:.1f} MiB"
        if p.eta_seconds is not None:
            text += f", ~{p.eta_seconds:.0f} s left"
        parts.append(text)
    return "; ".join(parts)


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
