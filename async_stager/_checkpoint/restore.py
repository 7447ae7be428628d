"""Restore and verify: find the newest committed step that verifies and load it.

The ranks agree on the candidates (the coordinator's list), verify each through the
checkpoint's format and load the first that verifies; a step that does not verify is
logged and the next older one tried (``fallback``). Every blocking part runs in a
worker thread (``run_in_thread``); the collectives run there in the same order on
every rank.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from async_stager._checkpoint import commit as _commit
from async_stager._checkpoint.formats import CheckpointFormat
from async_stager._checkpoint.options import CheckpointerOptions
from async_stager._checkpoint.ranks import Ranks
from async_stager._core.aio.threads import run_in_thread
from async_stager.errors import CheckpointError, IntegrityError

__all__ = ["restore"]

_log = logging.getLogger("async_stager.checkpoint")


async def restore(
    options: CheckpointerOptions,
    fmt: CheckpointFormat,
    ranks: Ranks,
    state: dict[str, Any],
    *,
    step: int | None,
    fallback: bool,
) -> int | None:
    """Load the newest committed step of ``options.directory`` that verifies into
    ``state`` (in place) and return it; None if there is none (see
    ``Checkpointer.restore``). Cancellation: deferred until the thread reading the
    current candidate returns; ``state`` may then be partly loaded."""
    root = options.directory
    listed: list[int] = await run_in_thread(
        lambda: ranks.broadcast(_commit.committed_steps(root)), name="async-stager-restore"
    )
    candidates = [s for s in reversed(listed) if step is None or s == step]
    if step is not None and not candidates:
        raise CheckpointError(f"no committed checkpoint for step {step} in {root}", step=step)
    first_error: IntegrityError | None = None
    for s in candidates:
        folder = _commit.step_dir(root, s)

        def load(s: int = s, folder: Path = folder) -> None:
            if options.checksums:
                fmt.verify(folder, s, ranks)
            fmt.load(state, folder, s, ranks, options.checksums)

        try:
            await run_in_thread(load, name="async-stager-restore")
        except IntegrityError as exc:
            if not fallback:
                raise
            first_error = first_error or exc
            _log.warning("checkpoint step %d does not verify, trying an older one: %s", s, exc)
            continue
        return s
    if first_error is not None:
        raise first_error
    return None
