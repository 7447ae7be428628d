"""What a service sees of a Checkpointer's saves: the in-flight view and save requests.

``SaveProgress`` is one save not yet ended, as ``Checkpointer.in_flight()`` reports it.
``SaveRequest`` is a save asked for from any task (a request handler, a timer, an
operator's command) and taken by the training loop at its next step boundary
(``Checkpointer.save_if_requested``), where the state is consistent: the requester
never touches the state, and the training loop never tracks who asked.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import anyio

from async_stager._checkpoint.item import Phase

if TYPE_CHECKING:
    from async_stager._checkpoint.item import SaveItem
    from async_stager._checkpoint.options import SaveStats

__all__ = [
    "PROGRESS_SECONDS",
    "SaveProgress",
    "SaveRequest",
    "describe",
    "finish_request",
    "interrupted_line",
    "progress_of",
    "report_progress",
    "status_line",
    "take_request",
]

_log = logging.getLogger("async_stager.checkpoint")
#: Seconds between the progress records of a save still writing (at most one record
#: per save per interval: a long save is visible in the logs, a short one is quiet).
PROGRESS_SECONDS = 10.0


@dataclass(frozen=True)
class SaveProgress:
    """One save in flight. ``phase``: ``"deferred"`` (waits for a buffer set or a write
    slot), ``"staging"``, ``"queued"`` (staged, waits for its write), ``"writing"``
    (its files written and checksummed, in its thread), ``"committing"`` (written;
    waits for the earlier saves, then commits); a memory snapshot (``agent=``):
    ``"memory-staging"``, ``"memory-committing"``. ``seconds`` since ``save()`` was
    called; ``staged_seconds`` the stage took (None before it ended); ``bytes`` its
    tensor bytes (None before its write knows them); ``eta_seconds`` a guess of the
    seconds left to its commit from the previous commit's write rate (None without
    one); ``waiting_for`` what a ``"committing"`` save waits for besides the earlier
    saves, for a person (a reader of the step it replaces, by pid), else None."""

    step: int
    phase: str
    seconds: float
    staged_seconds: float | None
    bytes: int | None = None
    eta_seconds: float | None = None
    waiting_for: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain data (str, int, float, None), for a JSON reply or a log record."""
        return asdict(self)

    def status(self) -> str:
        """This save in a few words: ``step 40: writing 1.2 s, 96.0 MiB, ~3 s left``
        (the MiB and the time left when known)."""
        text = f"step {self.step}: {self.phase} {self.seconds:.1f} s"
        if self.bytes is not None:
            text += f", {self.bytes / 2**20:.1f} MiB"
        if self.eta_seconds is not None:
            text += f", ~{self.eta_seconds:.0f} s left"
        if self.waiting_for:
            text += f", {self.waiting_for}"
        return text


def status_line(saves: list[SaveProgress]) -> str:
    """One line for the saves in flight, ``"; "``-joined ``SaveProgress.status()``, or
    ``"no save in flight"``: what ``Checkpointer.status_line()`` and the demo show."""
    return "; ".join(p.status() for p in saves) if saves else "no save in flight"


def progress_of(item: SaveItem, now: float | None = None, rate: float | None = None) -> SaveProgress:
    """``item`` as a SaveProgress; ``rate``: the previous commit's bytes per second."""
    now = time.monotonic() if now is None else now
    staged = item.staged if item.phase in (Phase.QUEUED, Phase.WRITING) else None
    phase = item.route.shown(item)
    nbytes = item.route.bytes
    eta = None
    if rate and nbytes is not None and phase is Phase.WRITING:
        eta = max(0.0, nbytes / rate - (now - item.called - (staged or 0.0)))
    waiting = item.waiting_for or None if phase is Phase.COMMITTING else None
    return SaveProgress(item.step, phase.value, now - item.called, staged, nbytes, eta, waiting)


def interrupted_line(exc: BaseException, items: list[SaveItem], newest: SaveStats | None) -> str:
    """One line for leaving a Checkpointer by ``exc`` (Ctrl-C, a cancellation) with
    ``items`` in flight, once they ended: which were committed, which not, and the
    newest commit (what a restart restores)."""
    how = "Ctrl-C" if isinstance(exc, KeyboardInterrupt) else "a cancellation (Ctrl-C is one under asyncio)"
    done = [str(i.step) for i in items if i.committed]
    lost = [str(i.step) for i in items if not i.committed]
    said = []
    if done:
        said.append(f"step {', '.join(done)} committed before leaving")
    if lost:
        said.append(f"step {', '.join(lost)} not committed")
    last = f"the newest commit is step {newest.step}" if newest is not None else "no commit in this session"
    return f"checkpoint: left by {how} with saves in flight: {'; '.join(said)}; {last}"


def describe(item: SaveItem, rate: float | None = None) -> str:
    """One line for a log: the phase, its seconds, bytes, stage time and ETA."""
    p = progress_of(item, rate=rate)
    parts = [f"{p.phase} for {p.seconds:.1f} s since save()"]
    if p.bytes is not None:
        parts.append(f"{p.bytes / 2**20:.1f} MiB")
    if p.staged_seconds:
        parts.append(f"staged in {p.staged_seconds:.1f} s")
    if p.eta_seconds is not None:
        parts.append(f"about {p.eta_seconds:.0f} s left")
    if p.waiting_for:
        parts.append(p.waiting_for)
    return ", ".join(parts)


async def report_progress(item: SaveItem, rate: Callable[[], float | None]) -> None:
    """Log a long save's progress every ``PROGRESS_SECONDS`` until it ends, then its
    outcome once if it was long (INFO on ``async_stager.checkpoint``); ``rate`` gives
    the newest commit's write rate for the ETA. Cancellation: it stops logging."""
    long = False
    while True:
        with anyio.move_on_after(PROGRESS_SECONDS):
            await item.done.wait()
        if item.done.is_set():
            break
        long = True
        _log.info("checkpoint step %d: %s", item.step, describe(item, rate()))
    if long:
        outcome = "committed" if item.committed else "not committed"
        _log.info("checkpoint step %d: %s after %.1f s", item.step, outcome, time.monotonic() - item.called)


class SaveRequest:
    """A save asked for with ``Checkpointer.request_save()``; requests made before the
    training loop takes one are the same request (one save answers them all).

    ``step`` is None until the training loop takes it; ``await taken()`` returns it
    then (None if the request was answered without being taken: the Checkpointer
    closed first). ``await wait()`` returns the
    commit's ``SaveStats``, or None when no commit answers it (skipped by ``"skip"``,
    replaced by ``"coalesce"``, the Checkpointer closed first); a failed write raises
    its CheckpointError here (and, as always, at the next ``save()``/``wait()``).
    Cancellation: only the wait."""

    def __init__(self) -> None:
        self.step: int | None = None
        self._taken = anyio.Event()
        self._done = anyio.Event()
        self._stats: SaveStats | None = None
        self._error: BaseException | None = None

    @property
    def done(self) -> bool:
        """The request is answered (committed, failed or not saved)."""
        return self._done.is_set()

    async def taken(self) -> int | None:
        """The step the training loop took this request at, once it took it (its save
        is then being staged or was accepted; ``wait()`` for its commit); None if it
        was answered without being taken. Cancellation: only the wait."""
        await self._taken.wait()
        return self.step

    async def wait(self) -> SaveStats | None:
        """The commit's SaveStats, or None when no commit answers the request; a failed
        write's CheckpointError is raised. Cancellation: only the wait."""
        await self._done.wait()
        if self._error is not None:
            raise self._error
        return self._stats


# What the Checkpointer does to a request: functions, not methods, so a SaveRequest
# shows its users only what they call.


def take_request(request: SaveRequest, step: int) -> None:
    """The training loop took ``request`` at ``step`` (its save is being staged)."""
    request.step = step
    request._taken.set()


def finish_request(
    request: SaveRequest, stats: SaveStats | None = None, error: BaseException | None = None
) -> None:
    """Answer ``request`` (once; later calls do nothing): ``stats`` of the commit, None
    when no commit answers it; ``error``, a failed write's."""
    if request._done.is_set():
        return
    request._stats, request._error = stats, error
    request._taken.set()
    request._done.set()
