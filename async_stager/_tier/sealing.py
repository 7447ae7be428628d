"""Sealed snapshots: memory no process can change any more, verified once after the seal.

A snapshot's arenas are memfds made with ``MFD_ALLOW_SEALING``. Once the trainer that
wrote them is gone, the agent adds the seals ``F_SEAL_WRITE | F_SEAL_SHRINK |
F_SEAL_GROW`` (``seal``). The kernel grants ``F_SEAL_WRITE`` only if no process maps
the memfd shared and writable (``EBUSY`` otherwise: the trainer is still alive, or a
stray writer holds a mapping), and from then on refuses every way of changing the
bytes: ``write``, a shared writable mapping (``mmap``/``mprotect``), a hole punched,
a truncation. So a snapshot whose arenas are all sealed can never change again, and
the agent then hashes it once more (``check``, through private read-only mappings:
they never count as writers) and compares every region with the digest of its commit.
A snapshot that passes is marked ``verified``: its bytes are exactly the bytes the
trainer hashed at its stage, and they stay so for as long as anyone holds them.

A restarted trainer's restore trusts that check instead of re-reading every byte:
the agent says ``sealed`` in its FETCH answer and the trainer confirms the seals on
its own descriptors (``is_sealed``: the kernel's word, not the agent's). Where the
seal is refused (a writer maps the memory) nothing is trusted: the trainer verifies
every byte itself, as before. A snapshot that does not match after its seal (bytes
changed between the commit's verification and the seal) is dropped, with a warning.

What is not covered, as for every copy in RAM: a bit flipped by the hardware after
the check (ECC's job; the disk tier has the same exposure between its verification and
its load).
"""

from __future__ import annotations

import fcntl
import logging
import mmap
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import anyio.abc
import anyio.to_thread

from async_stager._tier.regions import Region, digests_in

__all__ = ["SEALS", "SealState", "Sealer", "finish", "is_sealed", "seal", "start"]

_log = logging.getLogger("async_stager.agent")

#: Seconds between tries to seal a gone trainer's snapshots (``Sealer.seal_gone``).
RETRIES = (0.05, 0.2, 1.0, 3.0)

#: The seals a snapshot's arenas get: no write, no shrink, no growth.
SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


def seal(fd: int) -> bool:
    """Seal ``fd`` against every change (already sealed: True). False if the kernel
    refuses: a process maps it shared and writable (``EBUSY``), or the file takes no
    seals (not a memfd made with ``MFD_ALLOW_SEALING``: ``EPERM``/``EINVAL``)."""
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except OSError:
        return False
    return True


def is_sealed(fd: int) -> bool:
    """Whether ``fd``'s file carries every seal of ``SEALS`` (the kernel's answer)."""
    try:
        return fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS
    except OSError:
        return False


@dataclass(eq=False)
class SealState:
    """A held snapshot's seal: ``verified`` once every arena is sealed and every
    region matched its digest after the seal; ``done`` is set when a running check
    ends (None: none started); ``tries`` counts seals the kernel refused."""

    verified: bool = False
    damaged: bool = False
    done: anyio.Event | None = None
    tries: int = 0

    @property
    def running(self) -> bool:
        return self.done is not None and not self.done.is_set()


def start(state: SealState, fds: Sequence[int], sizes: Sequence[int]) -> list[mmap.mmap] | None:
    """The first half of a check, synchronous: seal every arena of a snapshot and map
    it (private, read only: the agent may close the descriptors of a snapshot it
    forgets meanwhile; the mappings keep the memory). None if a check ran or runs, or
    the kernel refused a seal (a writer maps the memory: tried again later)."""
    if state.verified or state.damaged or state.running:
        return None
    if not all(seal(fd) for fd in fds):
        state.tries += 1
        return None
    state.done = anyio.Event()
    maps: list[mmap.mmap] = []
    try:
        for fd, n in zip(fds, sizes):
            maps.append(mmap.mmap(fd, n, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ))
    except BaseException:
        _close(maps)
        state.done.set()
        raise
    return maps


async def finish(
    state: SealState,
    maps: list[mmap.mmap],
    regions: Sequence[Region],
    digests: Sequence[Sequence[int]],
    piece: int,
) -> bool:
    """The second half: hash every region through ``maps`` (a thread) and compare it
    with ``digests``; True (``state.verified``) or False (``state.damaged``: the bytes
    changed between the commit's verification and the seal). Cancellation: the hash's
    thread finishes on its own; the snapshot stays unverified."""
    try:
        got = await anyio.to_thread.run_sync(lambda: digests_in(dict(enumerate(maps)), regions, piece))
        ok = len(got) == len(digests) and all(
            [int(x) for x in want] == have for want, have in zip(digests, got)
        )
        state.verified, state.damaged = ok, not ok
        return ok
    finally:
        _close(maps)
        assert state.done is not None
        state.done.set()


def _close(maps: list[mmap.mmap]) -> None:
    for mm in maps:
        try:
            mm.close()
        except BufferError:  # pragma: no cover - a digest's thread still reading
            pass


class _Arena(Protocol):
    @property
    def fd(self) -> int: ...
    @property
    def nbytes(self) -> int: ...


class Sealable(Protocol):
    """What the agent holds of a snapshot, as far as its seal goes."""

    @property
    def rank(self) -> int: ...
    @property
    def step(self) -> int: ...
    @property
    def complete(self) -> bool: ...
    @property
    def arenas(self) -> Sequence[_Arena]: ...
    @property
    def meta(self) -> dict[str, Any]: ...
    @property
    def seal(self) -> SealState: ...


class Sealer:
    """The agent's seals: ``seal`` starts one (its verification runs in ``tg``, the
    agent's task group), ``seal_gone`` seals a gone trainer's snapshots, ``seal_now``
    one at a FETCH. ``drop``: how a snapshot found damaged after its seal is forgotten."""

    def __init__(self, drop: Callable[[Any], Awaitable[None]]) -> None:
        self.tg: anyio.abc.TaskGroup | None = None
        self._drop = drop

    def seal(self, h: Sealable) -> None:
        """Seal ``h``'s arenas and verify them in the background, if the kernel grants
        the seals now."""
        if self.tg is None or not h.complete or not h.arenas:
            return
        try:
            maps = start(h.seal, [a.fd for a in h.arenas], [a.nbytes for a in h.arenas])
        except OSError as exc:  # a mapping refused (memory): the trainer verifies it itself
            _log.warning("rank %d step %d: sealed, but not checked after the seal: %s", h.rank, h.step, exc)
            return
        if maps is not None:
            self.tg.start_soon(self._verify, h, maps)

    async def _verify(self, h: Sealable, maps: list[mmap.mmap]) -> None:
        from async_stager._tier.regions import PIECE_BYTES, regions_of

        regions = regions_of(h.meta.get("refs", []))
        piece = int(h.meta.get("piece_bytes", PIECE_BYTES))
        try:
            ok = await finish(h.seal, maps, regions, h.meta.get("digests", []), piece)
        except Exception as exc:  # noqa: BLE001 - the agent serves on: the trainer verifies it itself
            _log.warning("rank %d step %d: its check after the seal failed: %r", h.rank, h.step, exc)
            return
        if ok:
            _log.debug("rank %d step %d sealed and verified", h.rank, h.step)
            return
        _log.warning(
            "rank %d step %d: its regions do not match their checksums after its seal (its "
            "memory changed after the commit was verified): dropped",
            h.rank,
            h.step,
        )
        await self._drop(h)

    async def seal_gone(self, snapshots: Callable[[], Sequence[Sealable]]) -> None:
        """A trainer's connection ended: seal its complete ``snapshots()``. A trainer
        closing cleanly still maps its arenas for a moment (the kernel refuses): tried
        again after each of ``RETRIES``, then at a FETCH. Cancellation: stops trying."""
        for delay in RETRIES:
            waiting = [
                h
                for h in snapshots()
                if h.complete and h.arenas and not h.seal.verified and not h.seal.damaged
            ]
            if not waiting:
                return
            for h in waiting:
                self.seal(h)
            await anyio.sleep(delay)

    async def seal_now(self, h: Sealable, wait: float) -> None:
        """At a FETCH: seal ``h`` now if it is not (and the kernel grants it), and wait
        at most ``wait`` seconds for its verification. Cancellation: only the wait."""
        if h.seal.verified or wait <= 0:
            return
        self.seal(h)
        done = h.seal.done
        if done is not None:
            with anyio.move_on_after(wait):
                await done.wait()
