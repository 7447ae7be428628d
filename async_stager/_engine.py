"""The staging engine: walk, reserve host blocks, enqueue copies. Synchronous.

Both public APIs sit on this: the async Stager (``_stager.py``) and the seed's
DefaultStager (``_seed.py``). ``capture`` runs on the caller's thread at the call;
``run`` runs on the stager's worker thread; ``settle``/``release`` may run anywhere.

Fast path: the state dict is walked once with the host tensors of the plan that
matches its signature; if every leaf's fingerprint (data pointer, dtype, dim, numel,
device) equals the plan's, the plan's copy program runs as is. Otherwise the slow path
validates every leaf, groups leaves by source storage, looks each storage up in the
storage cache (allocating exact-size blocks for misses), makes a new plan and walks
again to build the result around it.
"""

from __future__ import annotations

import contextlib
import gc
import operator
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._arena import CudaPinner, Pinner
from ._cache import BufferSet, Plan, signature_of
from ._device import Backend, Completion, Copier, RealBackend
from ._errors import ClosedError, CopyError, StagingError
from ._options import StagerOptions
from ._plan import make_plan, plan_holds, sources
from ._tree import Interrupt, Walk, path_of_leaf

__all__ = ["Cancelled", "Engine", "Staged"]


class Cancelled(Interrupt):
    """Internal: the job was cancelled before its copies were enqueued."""


class _PlanStale(Exception):
    """Internal: the fast path's copy failed; retry on the slow path."""


@dataclass(eq=False)
class Staged:
    """The worker's half of a stage: the result and what is still in flight."""

    result: Any
    bufset: BufferSet
    completions: list[Completion]
    leased: bool
    tensors: int
    storages: int
    nbytes: int
    hits: int
    misses: int
    fast_path: bool
    worker_seconds: float
    devices: list[torch.device]


class Engine:
    """Host buffers, caches, plans and copiers of one stager."""

    def __init__(
        self,
        options: StagerOptions,
        *,
        backend: Backend | None = None,
        pinner: Pinner | None = None,
    ) -> None:
        self.options = options
        self.backend = (
            backend
            if backend is not None
            else RealBackend(non_blocking=options.non_blocking, copy_threads=options.copy_threads)
        )
        if pinner is None and options.pin_memory:
            pinner = CudaPinner()
        self._pinner = pinner if options.pin_memory else None
        self._sets: list[BufferSet] = []
        self._cond = threading.Condition()
        self._copiers: dict[torch.device, Copier] = {}
        self._copiers_lock = threading.Lock()
        #: The latest completion enqueued per device, by any stage (also one that
        #: failed or was cancelled after enqueueing part of its copies): what fence()
        #: must order after.
        self.latest: dict[torch.device, Completion] = {}
        self._recent: BufferSet | None = None
        self.closed = False
        #: Measured bytes/second of device-to-host copies, per device (for polling).
        self.bandwidth: dict[torch.device, float] = {}

    # -- caller thread ----------------------------------------------------------------

    def capture(self) -> dict[torch.device, Any]:
        """Snapshot point: an event on the caller's current stream of each known device."""
        if self.closed:
            raise ClosedError("the stager is closed")
        devices = set(self.backend.known_devices())
        devices.update(d for d in list(self._copiers) if d.type != "cpu")
        return {d: self._copier(d).capture() for d in devices}

    def _copier(self, device: torch.device) -> Copier:
        # Called from the caller's thread (capture) and the worker: one copier (one
        # copy stream) per device, or scratch made on one stream could be used on
        # another without ordering.
        c = self._copiers.get(device)
        if c is None:
            with self._copiers_lock:
                c = self._copiers.get(device)
                if c is None:
                    c = self._copiers[device] = self.backend.copier(device)
        return c

    def _device_context(self, captures: dict[torch.device, Any]) -> Any:
        """The CUDA device of this stage (or of any copier) as the worker's current
        device: a new thread starts on device 0, and pinning, event waits or stream
        work there would create a CUDA context on GPU 0 for every rank."""
        devs = [d for d in captures if d.type == "cuda"] or [
            d for d in list(self._copiers) if d.type == "cuda"
        ]
        if devs:
            return torch.cuda.device(devs[0])
        return contextlib.nullcontext()

    # -- worker thread ----------------------------------------------------------------

    def run(
        self,
        sd: Any,
        captures: dict[torch.device, Any],
        *,
        lease: bool = False,
        cancel: threading.Event | None = None,
        copy: bool = True,
    ) -> Staged:
        """Stage ``sd`` into a free buffer set; returns once the copies are enqueued
        (on the CPU: done). Raises StagingError subclasses, or Cancelled."""
        with _gil_interval(self.options.yield_interval), self._device_context(captures):
            try:
                return self._run(sd, captures, lease, cancel, copy, allow_fast=True)
            except _PlanStale:
                # A leaf changed in a way the fingerprint does not see (its shape): the
                # plan is gone; the slow path checks everything.
                return self._run(sd, captures, lease, cancel, copy, allow_fast=False)

    def _run(
        self,
        sd: Any,
        captures: dict[torch.device, Any],
        lease: bool,
        cancel: threading.Event | None,
        copy: bool,
        *,
        allow_fast: bool,
    ) -> Staged:
        t0 = time.perf_counter()
        tick = _Ticker(cancel, self)
        sig = signature_of(sd)
        bufset = self._select(sig, lease, cancel)
        try:
            bufset.wait_inflight()
            plan = bufset.plan_for(sig) if allow_fast else None
            result: Any = None
            leaves: list[torch.Tensor] = []
            fast = False
            hits = misses = 0
            if plan is not None:
                walk = Walk(plan.hosts, validate=False, tick=tick)
                result = walk.run(sd)
                leaves = walk.leaves
                with _no_torch_function():
                    fast = plan_holds(plan, leaves, tick)
            if not fast:
                collect = Walk((), validate=True, tick=tick)
                collect.run(sd)
                with _gc_paused(), _no_torch_function():
                    plan, hits, misses = make_plan(
                        self._copier, self.options, bufset, sig, collect.leaves, tick, prefault=not copy
                    )
                walk = Walk(plan.hosts, validate=False, tick=tick)
                result = walk.run(sd)
                leaves = walk.leaves
                # Hazard: another thread may have changed the state dict between the
                # two walks. The copies read the second walk's leaves into the plan of
                # the first: they must still fit it (a (1,)-tensor swapped in for a
                # (4,)-tensor would even broadcast silently), or the stage is refused.
                with _no_torch_function():
                    holds = plan_holds(plan, leaves, tick)
                if not holds:
                    raise StagingError(
                        "the state dict changed while it was being staged: "
                        "do not mutate it until stage() returns"
                    )
                bufset.remember(plan)
            else:
                assert plan is not None
                hits = plan.storages
            tick.check()
            completions: list[Completion] = []
            devices: list[torch.device] = []
            if copy:
                try:
                    with _no_torch_function():
                        completions, devices = self._enqueue(bufset, plan, leaves, captures, tick)
                except RuntimeError as e:
                    if fast:
                        bufset.plans.pop(sig, None)
                        raise _PlanStale() from None
                    err = self._copy_error(sd, plan, leaves, bufset, e)
                    raise err from err.__cause__
            with self._cond:
                bufset.inflight.extend(completions)
            self._recent = bufset
            return Staged(
                result=result,
                bufset=bufset,
                completions=completions,
                leased=lease,
                tensors=len(leaves),
                storages=plan.storages,
                nbytes=plan.nbytes,
                hits=hits,
                misses=misses,
                fast_path=fast,
                worker_seconds=time.perf_counter() - t0,
                devices=devices,
            )
        except BaseException:
            if lease:
                self.release(bufset)
            raise
        finally:
            with self._cond:
                bufset.busy = False
                self._cond.notify_all()

    def _select(self, sig: Any, lease: bool, cancel: threading.Event | None) -> BufferSet:
        """A buffer set that is neither leased nor busy; waits (cancellably) if none."""
        with self._cond:
            while True:
                if self.closed:
                    raise ClosedError("the stager is closed")
                if cancel is not None and cancel.is_set():
                    raise Cancelled()
                free = [s for s in self._sets if not s.leases and not s.busy]
                pick = None
                for s in free:
                    if sig in s.plans:
                        pick = s
                        break
                if pick is None and self._recent in free:
                    pick = self._recent
                if pick is None and free:
                    pick = free[0]
                if pick is None and len(self._sets) < self.options.max_buffer_sets:
                    pick = BufferSet(
                        len(self._sets),
                        shared=self.options.share_memory,
                        pinner=self._pinner,
                    )
                    self._sets.append(pick)
                if pick is not None:
                    pick.busy = True
                    if lease:
                        pick.leases += 1
                    return pick
                # Every set is leased: wait for a release, waking now and then to see
                # whether the stage was cancelled.
                self._cond.wait(0.05)

    def _enqueue(
        self,
        bufset: BufferSet,
        plan: Plan,
        leaves: list[torch.Tensor],
        captures: dict[torch.device, Any],
        tick: Callable[[], None],
    ) -> tuple[list[Completion], list[torch.device]]:
        """Enqueue every program's copies; returns the completions and, pairwise, the
        device each belongs to (CPU programs finish inside and have none)."""
        completions: list[Completion] = []
        devices: list[torch.device] = []
        with torch.no_grad():
            for prog in plan.programs:
                copier = self._copier(prog.device)
                # Hazard: from begin() to end() the copier may hold a stream context on
                # this thread; end() must run whatever happens.
                copier.begin(captures.get(prog.device))
                srcs_all: list[torch.Tensor] = []
                try:
                    for run in prog.runs:
                        for views, units in run.groups:
                            srcs = sources(units, leaves)
                            srcs_all.extend(srcs)
                            _copy_chunked(copier, views, srcs, tick)
                        copier.copy([run.span], [run.scratch])
                    if prog.direct:
                        if prog.direct_whole:
                            srcs = sources(prog.direct, leaves)
                        elif len(prog.direct_reps) == 1:
                            srcs = [leaves[prog.direct_reps[0]]]
                        else:
                            srcs = list(operator.itemgetter(*prog.direct_reps)(leaves))
                        srcs_all.extend(srcs)
                        if prog.direct_layout is not None:
                            copier.copy_planned(prog.direct_dsts, srcs, prog.direct_layout, tick)
                        else:
                            _copy_chunked(copier, prog.direct_dsts, srcs, tick)
                    copier.protect(srcs_all)
                except BaseException:
                    # Failed or cancelled (a tick) part way: copies enqueued before
                    # that may still read the sources and land in this set's buffers.
                    # Protect the sources and track the copies as in flight, so no
                    # later stage (or close) reuses the buffers before they finish.
                    try:
                        copier.protect(srcs_all)
                    finally:
                        done = copier.end()
                    if done is not None:
                        completions.append(done)
                        devices.append(prog.device)
                        self.latest[prog.device] = done
                    with self._cond:
                        bufset.inflight.extend(completions)
                    raise
                done = copier.end()
                if done is not None:
                    completions.append(done)
                    devices.append(prog.device)
                    self.latest[prog.device] = done
        return completions, devices

    def _copy_error(
        self, sd: Any, plan: Plan, leaves: list[torch.Tensor], bufset: BufferSet, cause: BaseException
    ) -> StagingError:
        """Find which unit's copy fails, for an error that names its path: each unit is
        copied again on its own, through its device's copier (the failed batch may have
        mixed many tensors)."""
        with torch.no_grad(), _no_torch_function():
            for unit in plan.units:
                copier = self._copier(unit.device)
                copier.begin(None)
                try:
                    copier.copy([unit.dst], sources([unit], leaves))
                except RuntimeError as e:
                    err = CopyError(f"copying this tensor failed: {e}", path=path_of_leaf(sd, unit.rep))
                    err.__cause__ = e
                    return err
                finally:
                    done = copier.end()
                    if done is not None:
                        with self._cond:
                            bufset.inflight.append(done)
        err = CopyError(f"a batched copy failed ({cause}), but no single copy did")
        err.__cause__ = cause
        return err

    # -- any thread -------------------------------------------------------------------

    def settle(self, staged: Staged) -> None:
        """The stage's completions have been observed: the set has nothing in flight."""
        with self._cond:
            for c in staged.completions:
                try:
                    staged.bufset.inflight.remove(c)
                except ValueError:
                    pass

    def release(self, bufset: BufferSet) -> None:
        """Give back one lease on ``bufset``; later stages may write into it again."""
        with self._cond:
            if bufset.leases > 0:
                bufset.leases -= 1
            self._cond.notify_all()

    def fence(self) -> None:
        """Order the caller's current stream of each device after the latest copies
        enqueued there (by whichever stage: a later stage that failed validation or was
        a reserve() must not hide an earlier one's copies still in flight)."""
        for d, c in list(self.latest.items()):
            self._copier(d).fence(c)

    @property
    def host_bytes(self) -> int:
        """Host memory (bytes) mapped by every buffer set."""
        return sum(s.pool.host_bytes for s in list(self._sets))

    @property
    def buffer_sets(self) -> int:
        return len(self._sets)

    def close(self) -> None:
        """Wait for copies in flight, release every arena and stream; idempotent."""
        with self._cond:
            self.closed = True
            self._cond.notify_all()
            sets, self._sets = self._sets, []
            self._recent = None
        errors: list[BaseException] = []
        with self._device_context({}):
            for s in sets:
                try:
                    s.close()
                except Exception as e:  # noqa: BLE001 - keep releasing the rest
                    errors.append(e)
        self.latest.clear()
        for c in list(self._copiers.values()):
            try:
                c.close()
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        self._copiers.clear()
        if errors:
            raise StagingError(f"closing released everything but reported: {errors[0]!r}") from errors[0]


class _Ticker:
    """Called every few hundred leaves by the walk: aborts a cancelled or closed job
    before its copies start."""

    __slots__ = ("cancel", "engine")

    def __init__(self, cancel: threading.Event | None, engine: Engine) -> None:
        self.cancel = cancel
        self.engine = engine

    def __call__(self) -> None:
        self.check()

    def check(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise Cancelled()
        if self.engine.closed:
            raise ClosedError("the stager was closed during the stage")


_switch_lock = threading.Lock()
_switch_users = 0
_switch_saved = 0.0


@contextlib.contextmanager
def _gil_interval(seconds: float) -> Iterator[None]:
    """Lower the interpreter's GIL switch interval while a job runs.

    Hazard: the walk holds the GIL in pure Python. A thread that wants the GIL (the
    event loop's) waits one switch interval (5 ms by default), then asks, and the
    holder hands over at its next bytecode. Lowering the interval while staging bounds
    the loop's wait to about ``seconds``; it costs nothing when nobody waits (no
    switch is requested). Voluntary sleeps were measured instead: same lag, but they
    doubled the time of a cached 20k-tensor stage (33 ms against 17 ms). The setting is
    process-wide: the first of concurrent jobs lowers it, the last puts it back, and
    only if nobody else changed it meanwhile.
    """
    global _switch_users, _switch_saved
    with _switch_lock:
        if _switch_users == 0:
            _switch_saved = sys.getswitchinterval()
            if seconds < _switch_saved:
                sys.setswitchinterval(seconds)
        _switch_users += 1
    try:
        yield
    finally:
        with _switch_lock:
            _switch_users -= 1
            if (
                _switch_users == 0
                and _switch_saved > seconds
                and abs(sys.getswitchinterval() - seconds) < 1e-9
            ):
                sys.setswitchinterval(_switch_saved)


def _no_torch_function() -> Any:
    """Tensor subclasses' ``__torch_function__`` overrides off (this thread) while the
    engine inspects and copies their data: staging copies the bytes as they are, and an
    override that raises or redirects must not break or bend that."""
    return torch._C.DisableTorchFunctionSubclass()


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic GC while a plan is made: it allocates a few objects per tensor,
    and with tens of thousands of tensors the collections it triggers, each scanning
    the caller's whole heap, were half the cold-path time (measured 0.47 s -> 0.23 s at
    20k tensors). Hazard: this is process-wide for those milliseconds; it is restored
    only if it was on, so a caller that disabled GC keeps it off."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


#: Tensors per batched copy call. torch parses a tensor list holding the GIL (about
#: 0.1 us a tensor, both lists): 20k tensors in one call held it for ~4 ms.
_COPY_CHUNK = 1024


def _copy_chunked(
    copier: Copier, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], tick: Callable[[], None]
) -> None:
    n = len(dsts)
    if n <= _COPY_CHUNK:
        copier.copy(dsts, srcs)
        return
    for lo in range(0, n, _COPY_CHUNK):
        copier.copy(dsts[lo : lo + _COPY_CHUNK], srcs[lo : lo + _COPY_CHUNK])
        tick()
