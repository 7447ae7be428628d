"""The budgeted save's tensor copies into its ring, through the device seam.

``RingCopies`` copies each tensor item's source into its piece of the ring with the
``Copier`` of the source's device (``_core.copy.device``), one piece per stage:
``begin(order_after(...))``, ``copy``, ``protect``, ``end()`` (the piece's
``Completion``, None when it has landed already). So a budgeted save has the engine's
CUDA ordering and a ``FakeBackend`` drives it on the CPU:

- the copiers of the devices known at the call are made then, on the caller's thread,
  and their ``capture()`` is the snapshot point (an event on the caller's current
  stream); the copy stream (``DevicePrimitives.new_stream``, never the default nor
  the caller's stream) waits on it, a host copy waits for every accelerator's capture;
- ``protect`` keeps the sources' memory from the caching allocator until they are read
  (``record_stream``);
- host waits are bounded (``HOST_WAIT_SECONDS``) and see an abort.

Owner: the pipeline of one save (``pipeline.Pipeline``); the copiers are its lane's
(``_core.run.lanes``: kept from one budgeted save to the next, so no stream is drawn per
save; not the stager's own, which belong to its worker), closed by the lane.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from async_stager._core.copy.copiers import RealBackend
from async_stager._core.copy.device import Backend, Completion, Copier, order_after
from async_stager._core.memory.buffer_sets import HOST_WAIT_SECONDS, wait_bounded
from async_stager.errors import CopyError

__all__ = ["RingCopies"]


class RingCopies:
    """One budgeted save's copiers, captures and the completions of its copies that
    have not been seen to land.

    ``captures``: per device, its copier's ``capture()`` at the call. ``copiers``: the
    copiers that made them (the caller's thread). ``backend``: makes the copier of a
    device first seen in the copier thread (on the real backend, the CPU's; None: the
    real one, non-blocking). Threads: ``copy`` in the copier thread, ``landed`` and
    ``settle`` in the writer's, ``fence_points`` in the caller's,
    ``apply_fence`` on the event loop; the dicts are read there as snapshots."""

    def __init__(
        self,
        captures: Mapping[torch.device, Any],
        *,
        backend: Backend | None = None,
        copiers: dict[torch.device, Copier] | None = None,
    ) -> None:
        self.captures = dict(captures)
        self._backend = backend
        # The lane's (shared: a copier made here stays the lane's for the next save).
        self._copiers: dict[torch.device, Copier] = copiers if copiers is not None else {}
        # Copies not yet seen to land (by ``landed``), in enqueue order, keyed by
        # ``id``: what a fence orders after (each of them: a fake device's completions
        # are independent, and on CUDA more waits on one stream cost microseconds) and
        # what ``settle`` waits for before the ring is unregistered. At most the pieces
        # the ring holds.
        self._pending: dict[int, tuple[torch.device, Completion]] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def serializing(self, *, host_wait: bool = True) -> Iterator[None]:
        """Copier thread, around the serialization of bytes items: first, when a value
        may hold a CPU tensor (``host_wait``), a host wait (bounded) for every capture,
        since ``torch.save`` reads those on the host and the caller's streams may still
        be writing them (otherwise nothing waits on the host before a copy); then,
        for each accelerator, its copy stream current and ordered after its capture
        (``Copier.begin``): a device tensor inside a value, which ``torch.save`` copies
        to the host itself, is read as of the call on the copy stream, never on the
        default stream. Each such stage's completion is waited for by ``settle``."""
        if host_wait:
            for cap in list(self.captures.values()):
                cap.synchronize()
        begun: list[tuple[torch.device, Copier]] = []
        try:
            # Only the captured devices: accelerators (the CPU is one on a simulated
            # or fake device).
            for device in list(self.captures):
                copier = self._copier(device)
                copier.begin(order_after(device, self.captures))
                begun.append((device, copier))
            yield
        finally:
            for device, copier in reversed(begun):
                done = copier.end()
                if done is not None:
                    with self._lock:
                        self._pending[id(done)] = (device, done)

    def _copier(self, device: torch.device) -> Copier:
        copier = self._copiers.get(device)
        if copier is None:
            if self._backend is None:
                self._backend = RealBackend(non_blocking=True)
            copier = self._copiers[device] = self._backend.copier(device)
        return copier

    def copy(self, fqns: list[str], dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> Completion | None:
        """Enqueue ``dsts[i].copy_(srcs[i])`` (copier thread) as one stage of the
        sources' copier (all on one device): ordered after the capture, the sources
        protected until read, one completion for all (a batch of small items costs one
        event and one wait, not one each). Returns it, None when the copies have landed
        already. Each copier copies bytes, not values, and resolves lazy conj/neg bits
        itself (an accelerator on the device: ``AcceleratorCopier``). A failed enqueue
        raises CopyError naming the write items ``fqns``."""
        backend = self._backend
        device = backend.device_of(srcs[0]) if backend is not None else srcs[0].device
        if device.type == "cuda" and device.index is None:  # pragma: no cover - torch sets it
            device = torch.device("cuda", torch.cuda.current_device())
        copier = self._copier(device)
        copier.begin(order_after(device, self.captures))
        try:
            copier.copy(dsts, srcs)
            copier.protect(srcs)
        except Exception as e:
            names = ", ".join(repr(f) for f in fqns)
            what = f"write item {names}" if len(fqns) == 1 else f"write items {names} (one batch)"
            raise CopyError(f"copying {what} into the budget's ring failed: {e}") from e
        finally:
            # The stage ends also when the enqueue failed (the copy stream made current
            # for it is left); what was enqueued is still waited for (``settle``).
            done = copier.end()
            if done is not None:
                with self._lock:
                    self._pending[id(done)] = (device, done)
        return done

    def landed(self, fqn: str, done: Completion, stop: Callable[[], bool]) -> bool:
        """Wait (writer thread) until the copy of write item ``fqn`` has landed; False
        if ``stop()`` became true first (the copy goes on: ``settle`` waits for it).
        Polls ``query()`` with a sleep doubling up to 1 ms, so the wait sees an abort
        and is bounded (a blocking synchronize cannot be): CopyError after
        ``HOST_WAIT_SECONDS``, and when the completion fails (a device reports a copy's
        error there; of a batch, any of its items'), the error its cause."""
        deadline = time.monotonic() + HOST_WAIT_SECONDS
        delay = 0.0001
        try:
            while not done.query():
                if stop():
                    return False
                if time.monotonic() >= deadline:
                    raise CopyError(
                        f"the copy of write item {fqn!r} still not finished after "
                        f"{HOST_WAIT_SECONDS:.0f} s: the device looks wedged (a kernel that never "
                        "ends, an Xid error); see nvidia-smi"
                    )
                time.sleep(delay)
                delay = min(delay * 2, 0.001)
        except CopyError:
            raise
        except Exception as e:
            raise CopyError(f"copying write item {fqn!r} into the budget's ring failed: {e}") from e
        with self._lock:
            self._pending.pop(id(done), None)
        return True

    def settle(self, timeout: float | None = None) -> tuple[BaseException | None, bool]:
        """Wait (bounded: ``timeout`` seconds each, default ``HOST_WAIT_SECONDS``) for every copy not seen to land (the
        writer never took it, or stopped waiting): no copy may still land in ring
        memory about to be reused or unregistered. Every one is waited for even when
        one fails. Returns the first failure (None: all landed) and whether every copy
        is known to be over (False after a wait timed out: a copy may still land, and
        the ring must then be neither reused nor freed). After the copier thread."""
        bound = HOST_WAIT_SECONDS if timeout is None else timeout
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        first: BaseException | None = None
        over = True
        for _, done in pending:
            try:
                wait_bounded(done, "a copy into the budget's ring", bound)
            except CopyError as e:
                first = first or e
                over = over and not _still_running(done)
            except Exception as e:  # noqa: BLE001 - returned: the others are waited for too
                first = first or e  # the device reported the copy's failure: it is over
        return first, over

    def fence_points(self, *, at_call: bool = False) -> dict[torch.device, Any]:
        """Caller's thread, at a ``fence()`` call: each copier's ``fence_point`` (the
        caller's current stream). ``at_call``: the streams of the save's call instead
        (each capture's, ``Copier.fence_point_of``), whichever thread asks and when:
        a save whose pipeline is made after its call (a node budget's admission chose
        to stream it, on the loop) orders the streams current at its call."""
        if at_call:
            return {
                d: c.fence_point_of(self.captures[d])
                for d, c in list(self._copiers.items())
                if self.captures.get(d) is not None
            }
        return {d: c.fence_point() for d, c in list(self._copiers.items())}

    def apply_fence(self, points: Mapping[torch.device, Any]) -> None:
        """Order each point after its device's copies not yet seen to land
        (``Copier.fence``: no host block); a device first seen after the fence's call:
        the current stream of the calling thread. Nothing once settled (every copy
        landed)."""
        copiers = dict(self._copiers)
        with self._lock:
            pending = list(self._pending.values())
        for device, done in pending:
            copier = copiers.get(device)
            if copier is not None:
                copier.fence(done, points.get(device))


def _still_running(done: Completion) -> bool:
    """After a wait for ``done`` gave up: True when it has not completed (a copy may
    still land); False when it completed or reported its failure."""
    try:
        return not done.query()
    except Exception:  # noqa: BLE001 - the device reported the copy's failure: it is over
        return False
