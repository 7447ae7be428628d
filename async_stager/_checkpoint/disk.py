"""A checkpoint write that fails for want of disk space says so, and names its file.

The OSError of a full filesystem is found however it is wrapped, and given the file
being written, by ``_dcp.files`` (DCP's writer and ``torch_write`` name their files);
``write_failure`` is the message a failed save's CheckpointError carries: one line for
a person (the disk is full, which file, what to do; a DCP failure described by its
ranks' errors, not their tracebacks).
"""

from __future__ import annotations

import errno
import os
from typing import Any

from async_stager._dcp.files import disk_full_in, naming_writer

__all__ = ["checkpoint_failure", "dcp_writer", "failure_reason", "write_failure"]


def _first_line(text: str, limit: int = 200) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    line = lines[0] if lines else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _describe(exc: BaseException) -> str:
    """One line: DCP's CheckpointException by its ranks' errors, anything else by its
    first line."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for rank, wrapped in sorted(failures.items(), key=lambda kv: str(kv[0])):
            inner = wrapped[0] if isinstance(wrapped, tuple) and wrapped else wrapped
            text = _describe(inner) if isinstance(inner, BaseException) else str(inner)
            parts.append(f"rank {rank}: {text}")
        return "; ".join(parts[:4]) + ("; ..." if len(parts) > 4 else "")
    text = _first_line(str(exc))
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def failure_reason(exc: BaseException, folder: str | os.PathLike[str] | None = None) -> str:
    """Why a write or commit failed, in one line: for a full disk, that it is full, the
    file (or ``folder`` when the error names none) and what to do."""
    full = disk_full_in(exc)
    if full is not None:
        where = full.filename or folder
        target = f" writing {os.fspath(where)}" if where else ""
        reason = full.strerror or os.strerror(full.errno or errno.ENOSPC)
        return (
            f"the disk is full ({reason}, errno {full.errno}){target}. Nothing was committed for "
            "this step and its temporary files were removed; the newest earlier commit stays the "
            "one restore() loads. Free space there (or keep fewer checkpoints: keep=) and save again"
        )
    return _describe(exc)


def write_failure(step: int, exc: BaseException, folder: str | os.PathLike[str] | None = None) -> str:
    """The message of the CheckpointError for step ``step``'s failed write or commit
    (``exc`` is chained as its cause by the caller). ``folder``: the step's folder, named
    when the full disk's error names no file."""
    return f"checkpoint step {step} failed: {failure_reason(exc, folder)}"


def dcp_writer(path: str | os.PathLike[str]) -> Any:
    """A DCP storage writer for a step folder on a local path: DCP's own
    ``FileSystemWriter`` with the host loader (``per_thread_copy_ahead=0``, as
    ``_dcp.blocking.host_writer``), whose full-disk errors name their file."""
    return naming_writer(path, per_thread_copy_ahead=0)


def checkpoint_failure(
    step: int, exc: BaseException, folder: str | os.PathLike[str] | None = None
) -> BaseException:
    """The error a failed write of ``step`` is raised as: ``exc`` itself when it is a
    CheckpointError that is not a full disk, else a CheckpointError saying what failed
    (``write_failure``), caused by the full disk's OSError (which names the file) or by
    ``exc``."""
    from async_stager.errors import CheckpointError

    if isinstance(exc, CheckpointError) and disk_full_in(exc) is None:
        return exc
    failure = CheckpointError(write_failure(step, exc, folder), step=step)
    failure.__cause__ = disk_full_in(exc) or exc
    return failure
