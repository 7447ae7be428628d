"""Restore and verify: find the newest committed step that verifies and load it.

The ranks agree on the candidates (the coordinator's list), verify each through the
format it was written in (its commit record says which: a folder may hold steps of
both) and load the first that verifies; a step that does not verify is logged and the
next older one tried (``fallback``). Each candidate is held while it is read
(``commit.reading``): a trainer saving into the folder meanwhile neither retires nor
replaces it under the reader; a candidate retired before it could be held is no
candidate (the commits are listed again). Every blocking part runs in a worker thread
(``run_in_thread``); the collectives run there in the same order on every rank.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from async_stager._checkpoint import commit as _commit
from async_stager._checkpoint.formats import CheckpointFormat, format_of
from async_stager._checkpoint.options import CheckpointerOptions
from async_stager._checkpoint.place import Place
from async_stager._checkpoint.ranks import Ranks
from async_stager._core.aio.threads import run_in_thread
from async_stager.errors import CheckpointError, IntegrityError

__all__ = ["restore"]

_log = logging.getLogger("async_stager.checkpoint")

#: Times the commits are listed again because a candidate went before it was held (a
#: trainer committing faster than the reader can take a hold): then the newest is read
#: without one.
_RELISTS = 50


async def restore(
    options: CheckpointerOptions,
    place: Place,
    fmt: CheckpointFormat,
    ranks: Ranks,
    state: dict[str, Any],
    *,
    step: int | None,
    fallback: bool,
    created: bool = False,
) -> int | None:
    """Load the newest committed step of ``place`` that verifies into
    ``state`` (in place) and return it; None if there is none (see
    ``Checkpointer.restore``), said in one log line (a WARNING when the folder did not
    exist, or this Checkpointer's open made it: ``created``, a typo in the path trains
    from scratch otherwise in silence). Cancellation: deferred until the thread reading
    the current candidate returns; ``state`` may then be partly loaded."""
    first_error: IntegrityError | None = None
    failed: set[int] = set()
    for _ in range(_RELISTS):
        listed: list[int] = await run_in_thread(
            lambda: ranks.broadcast(place.steps_for_reading()), name="async-stager-restore"
        )
        candidates = [s for s in reversed(listed) if (step is None or s == step) and s not in failed]
        if step is not None and not candidates and not failed:
            raise CheckpointError(f"no committed checkpoint for step {step} in {place.where}", step=step)
        for s in candidates:
            try:
                await run_in_thread(
                    lambda s=s: _load(options, place, fmt, ranks, state, s),  # type: ignore[misc]
                    name="async-stager-restore",
                )
            except _commit.StepGone:
                break  # retired or replaced before it was held: list again
            except IntegrityError as exc:
                if not fallback:
                    raise
                failed.add(s)
                first_error = first_error or exc
                _log.warning("checkpoint step %d does not verify, trying an older one: %s", s, exc)
                continue
            return s
        else:
            break
    if first_error is not None:
        raise first_error
    if ranks.coordinator:
        _say_nothing_restored(place, created)
    return None


def _say_nothing_restored(place: Place, created: bool) -> None:
    root = place.where
    if "://" in root and not place.exists():
        # An object store makes no folder: nothing was created, nothing failed to be.
        _log.warning(
            "restore: nothing to restore: %s holds no object; training starts from scratch "
            "(a typo in the URL?)",
            root,
        )
    elif created or not place.exists():
        made = "this Checkpointer created it" if created else "it could not be created"
        _log.warning(
            "restore: nothing to restore: %s did not exist (%s); training starts from scratch "
            "(a typo in the path?)",
            root,
            made,
        )
    else:
        _log.info("restore: nothing to restore: no committed checkpoint in %s", root)


def _load(
    options: CheckpointerOptions,
    place: Place,
    default: CheckpointFormat,
    ranks: Ranks,
    state: dict[str, Any],
    s: int,
) -> None:
    """Hold committed step ``s`` and load it in its own format (every rank; blocking).
    Raises StepGone on every rank if any rank found it gone before holding it."""
    with contextlib.ExitStack() as stack:
        try:
            folder, seq, held = stack.enter_context(place.reading(s))
            here = False
        except _commit.StepGone:
            folder, seq, held, here = place.scratch, None, False, True
        # Every rank learns whether any rank found it gone: none loads it alone.
        if any(ranks.all_gather(here)) if ranks.distributed else here:
            raise _commit.StepGone(s)
        fmt = format_of(folder, default)
        if ranks.distributed and not fmt.several_ranks:
            raise CheckpointError(
                f"checkpoint step {s} in {folder} was written in format {fmt.name!r} (one process): "
                f"it cannot be restored on {ranks.world} ranks; restore it in one process, or pass "
                "step= to restore a step written in format 'dcp'",
                step=s,
            )
        try:
            if options.checksums:
                fmt.verify(folder, s, ranks)
            fmt.load(state, folder, s, ranks, options.checksums)
        except IntegrityError:
            if not held and place.commit_number(s) != seq:
                # Read without a hold (a folder without lock files): it was retired or
                # replaced while it was read, which is no damage.
                raise _commit.StepGone(s) from None
            raise
