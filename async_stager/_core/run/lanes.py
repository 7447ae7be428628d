"""Lanes: copiers and a host ring for work outside a stager's own stages (a budgeted
DCP save), kept from one such save to the next.

Why kept: a copier of an accelerator owns a copy stream, drawn from the device's pool
(32 streams per device on CUDA, handed out round-robin); a copier per save would draw
a new one each time, and within 32 saves one lands on a stream that training or NCCL
uses, queueing its collectives behind gigabytes of copies. The ring is a host arena of
up to the budget, pinned (``cudaHostRegister``: slow, a global driver lock); made per
save it pays that on every checkpoint. So a lane keeps both, and the next save takes
an idle lane again: its streams, its ring (when it is big enough and within the
budget), its CPU copier's threads.

Rules:
- One save uses a lane at a time (``take``/``give_back``); concurrent saves get
  separate lanes. Every lane given back is kept idle with its copiers (its streams):
  saves in parallel again take them again and draw no new stream, so the lanes made
  are the most saves ever in flight at once. Only ``IDLE_LANES`` idle lanes keep their
  ring (host memory) and their host copier (its threads); the others' are closed when
  they are given back.
- A lane whose copies could not be seen to land (a settle that timed out) is never
  reused nor freed: its ring may still be written by a copy in flight, so it is kept
  referenced for the life of the process (``quarantined``) and logged.
- A ring reserved from a node budget is not kept (``keep_ring=False``): between saves
  it would hold memory the node's ledger no longer counts.
- ``trim`` drops the idle lanes' rings (unpinned, unmapped) and keeps their copiers:
  streams are not host memory, and drawing them again is the hazard above. ``close``
  drops the idle lanes (their copiers wait, bounded, for their streams).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import torch

from async_stager._core.copy.device import Backend, Copier
from async_stager._core.memory.arena import Pinner
from async_stager._core.memory.ring import Ring

__all__ = ["IDLE_LANES", "Lane", "Lanes"]

_log = logging.getLogger("async_stager")

#: Idle lanes that keep their ring for the next budgeted saves (every idle lane keeps
#: its copiers).
IDLE_LANES = 1

#: Lanes whose copies may still land in their rings: never freed (see the module doc).
_QUARANTINE: list[Lane] = []


class Lane:
    """One save's copiers (by device) and ring. ``copiers``: the save may add the
    copier of a device it first meets (the CPU's, in its copier thread)."""

    def __init__(self) -> None:
        self.copiers: dict[torch.device, Copier] = {}
        self.ring: Ring | None = None

    def ring_for(self, capacity: int, budget: int, pinner: Pinner | None) -> Ring:
        """A ring of at least ``capacity`` and at most ``budget`` bytes, pinned with
        ``pinner`` (None: pageable): this lane's own again when it fits (emptied),
        else a new one (the old one closed). A failed registration raises
        PinningError."""
        ring = self.ring
        if ring is not None:
            if capacity <= ring.capacity <= budget and ring.pinned == (pinner is not None):
                ring.reset()
                return ring
            self.ring = None
            ring.close()
        self.ring = Ring(capacity, pinner=pinner)
        return self.ring

    def drop_ring(self) -> int:
        """Close and forget the ring; returns its bytes."""
        ring, self.ring = self.ring, None
        if ring is None:
            return 0
        ring.close()
        return ring.capacity

    def drop_host_copiers(self) -> None:
        """Close the copiers of the CPU (no stream to keep; a host copier's helper
        threads end); the next save makes one again if it needs it."""
        for d in [d for d in self.copiers if d.type == "cpu"]:
            self.copiers.pop(d).close()

    def close(self) -> BaseException | None:
        """Close every copier (bounded waits) and the ring; returns the first error."""
        first: BaseException | None = None
        copiers = list(self.copiers.values())
        self.copiers.clear()
        for c in copiers:
            try:
                c.close()
            except Exception as e:  # noqa: BLE001 - returned: the others are closed too
                first = first or e
        try:
            self.drop_ring()
        except Exception as e:  # noqa: BLE001 - returned
            first = first or e
        return first


class Lanes:
    """A stager's lanes (see the module doc). ``backend`` makes the copiers, ``pinner``
    pins the rings (the stager's own). Thread-safe."""

    def __init__(self, backend: Backend, pinner: Pinner | None) -> None:
        self.backend = backend
        self.pinner = pinner
        self._idle: list[Lane] = []
        self._lock = threading.Lock()
        self._closed = False
        #: Lanes made so far (each made its copiers' streams once).
        self.made = 0

    def take(self, devices: Sequence[torch.device]) -> Lane:
        """An idle lane (else a new one) with a copier for each of ``devices``, made now
        on the calling thread (where a copier draws its stream: never the caller's)."""
        with self._lock:
            lane = None
            if self._idle:
                # A lane with a ring first: its ring (pinned) is reused, not made again.
                i = next((i for i, idle in enumerate(self._idle) if idle.ring is not None), -1)
                lane = self._idle.pop(i)
            else:
                self.made += 1
        if lane is None:
            lane = Lane()
        try:
            for d in devices:
                if d not in lane.copiers:
                    lane.copiers[d] = self.backend.copier(d)
        except BaseException:
            lane.close()
            raise
        return lane

    def give_back(self, lane: Lane, *, settled: bool, keep_ring: bool = True) -> BaseException | None:
        """The save is done with ``lane``. ``settled``: every copy it enqueued was seen
        to land (else the lane is quarantined: kept, never reused). ``keep_ring``: False
        drops the ring now (a node-budget reservation is about to be given back).
        Returns an error closing it raised (the lane is gone then)."""
        if not settled:
            _log.error(
                "a budgeted save's copies were not seen to land; its ring (%d bytes) and "
                "streams are kept, unused, for the life of the process",
                lane.ring.capacity if lane.ring is not None else 0,
            )
            _QUARANTINE.append(lane)
            return None
        if not keep_ring:
            try:
                lane.drop_ring()
            except Exception as e:  # noqa: BLE001 - the lane is closed instead
                lane.close()
                return e
        with self._lock:
            closed = self._closed
            rings = sum(1 for idle in self._idle if idle.ring is not None)
        if closed:
            return lane.close()
        if lane.ring is not None and rings >= IDLE_LANES:
            try:
                lane.drop_ring()  # its streams are kept; its host memory is not
                lane.drop_host_copiers()  # no stream to keep: its copy threads go
            except Exception as e:  # noqa: BLE001 - the lane is closed instead
                lane.close()
                return e
        with self._lock:
            if not self._closed:
                self._idle.append(lane)
                return None
        return lane.close()

    def trim(self) -> int:
        """Drop the idle lanes' rings (their copiers and streams are kept); returns the
        ring bytes released."""
        # Taken out meanwhile: a save must not take a lane whose ring is being closed.
        with self._lock:
            idle, self._idle = self._idle, []
        freed = 0
        kept: list[Lane] = []
        for lane in idle:
            try:
                freed += lane.drop_ring()
            except Exception:  # noqa: BLE001 - logged; the lane (streams too) goes
                _log.exception("dropping an idle budget lane's ring failed; the lane is closed")
                lane.close()
            else:
                kept.append(lane)
        with self._lock:
            closed = self._closed
            if not closed:
                self._idle.extend(kept)
        if closed:
            for lane in kept:
                lane.close()
        return freed

    def close(self) -> BaseException | None:
        """Drop the idle lanes; lanes in use are closed when given back. Idempotent."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        first: BaseException | None = None
        for lane in idle:
            first = first or lane.close()
        return first
