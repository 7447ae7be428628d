"""The staging engine: walk, reserve host blocks, enqueue copies. Synchronous.

Both public APIs sit on this: the async Stager (``_stager.py``) and the seed's
DefaultStager (``_seed.py``). ``capture`` runs on the caller's thread at the call;
``run`` runs on the stager's worker thread; ``settle`` may run anywhere.

Fast path: the state dict is walked once with the host tensors of the plan that
matches its signature; if every leaf's fingerprint (see ``_cache.FINGERPRINT``)
equals the plan's, the plan's copy program runs as is. Otherwise the slow path
validates every leaf, groups leaves by source storage, looks each storage up in the
storage cache (allocating exact-size blocks for misses), makes a new plan and walks
again to build the result around it.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import operator
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._arena import Arena, CudaPinner, Pinner
from ._cache import BufferSet, Plan, signature_of
from ._device import (
    Backend,
    Completion,
    Copier,
    RealBackend,
    ScratchCopier,
    graph_capture_error,
    order_after,
)
from ._errors import BuffersHeldError, ClosedError, CopyError, StagingError
from ._interp import gc_paused, gil_interval
from ._lease import Lease
from ._options import StagerOptions
from ._plan import make_plan, plan_holds, sources
from ._preflight import engine_hook
from ._tree import Interrupt, Walk, path_of_leaf

__all__ = ["Cancelled", "Engine", "Staged"]


_log = logging.getLogger("async_stager")

#: Seconds a stage waits for a buffer set before it logs a warning.
_WARN_AFTER = 5.0


class Cancelled(Interrupt):
    """Internal: the job was cancelled before its copies were enqueued."""


class _PlanStale(Exception):
    """Internal: the fast path's copy failed; retry on the slow path."""


@dataclass(eq=False)
class Staged:
    """The worker's half of a stage: the result and what is still in flight."""

    #: The staged structure; whoever hands it on sets this to None, so the stager
    #: itself never keeps a result reachable (which would hold its buffer set).
    result: Any
    bufset: BufferSet
    completions: list[Completion]
    #: The hold on ``bufset`` when the stage was leased (released exactly once).
    lease: Lease[Any] | None
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
        """Snapshot point: an event on the caller's current stream of every device a
        source may live on (every CUDA device with a context, the caller's current one
        first, and every device staged from before). The leaves are not known before
        the walk, so all of them: an event record each, microseconds.

        Raises UnsupportedError if one of those streams is capturing a CUDA graph."""
        if self.closed:
            raise ClosedError("the stager is closed")
        devices = dict.fromkeys(self.backend.known_devices())
        devices.update(dict.fromkeys(d for d in list(self._copiers) if d.type != "cpu"))
        # Checked before anything is made or recorded on a device (a capturing stream
        # would take an event record into its graph).
        for d in devices:
            if self.backend.capturing(d):
                raise graph_capture_error("stage()", d)
        return {d: self._copier(d).capture() for d in devices}

    def _copier(self, device: torch.device) -> Copier:
        # Called from the caller's thread (capture, fence) and the worker: one copier
        # (one copy stream) per device, or scratch made on one stream could be used on
        # another without ordering.
        c = self._copiers.get(device)
        if c is None:
            with self._copiers_lock:
                c = self._copiers.get(device)
                if c is None:
                    c = self.backend.copier(device)
                    if isinstance(c, ScratchCopier) and c.scratch_budget is None:
                        # One budget for all of this copier's plans (see ScratchCopier).
                        c.scratch_budget = self.options.scratch_bytes
                    self._copiers[device] = c
        return c

    def _device_context(self, captures: dict[torch.device, Any]) -> Any:
        """The CUDA device of this stage (the caller's current one when it has a
        context, else another captured one, else that of any copier) as the worker's
        current device: a new thread starts on device 0, and pinning, event waits or
        stream work there would create a CUDA context on GPU 0 for every rank. With no
        such device (a CPU-only state dict before CUDA is initialised) and pinning on,
        the backend's ``host_device`` (pinning needs a context somewhere)."""
        devs = [d for d in captures if d.type == "cuda"] or [
            d for d in list(self._copiers) if d.type == "cuda"
        ]
        device = devs[0] if devs else None
        if device is None and self._pinner is not None:
            device = self.backend.host_device()
        if device is not None:
            return self.backend.device_guard(device)
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
        with gil_interval(self.options.yield_interval), self._device_context(captures):
            try:
                return self._run(sd, captures, lease, cancel, copy, allow_fast=True)
            except _PlanStale:
                pass
            # A leaf changed in a way the fingerprint does not see: the plan is gone;
            # the slow path checks everything. Retried outside the except block, so the
            # failed attempt's frame (and the result it built) is gone: a stale result
            # alive now would skew the buffer set's reachability baseline.
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
        bufset, held = self._select(sig, lease, cancel)
        try:
            bufset.wait_inflight()
            plan = bufset.plan_for(sig) if allow_fast else None
            result: Any = None
            walk: Walk | None = None
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
                # Drop what the failed fast attempt built before the set is re-watched.
                result = walk = None
                collect = Walk((), validate=True, tick=tick)
                collect.run(sd)
                with gc_paused(), _no_torch_function():
                    plan, hits, misses = make_plan(
                        self._copier,
                        self.options,
                        bufset,
                        sig,
                        collect.leaves,
                        tick,
                        prefault=not copy,
                        preflight=self._preflight(bufset, reserve=not copy),
                    )
                # Remembered and watched before the walk below builds the result: the
                # baseline of ``held`` must count the stager's references only.
                bufset.remember(plan)
                bufset.watch()
                walk = Walk(plan.hosts, validate=False, tick=tick)
                result = walk.run(sd)
                leaves = walk.leaves
                # Hazard: the copies read the second walk's leaves into the plan of the
                # first. Their memory may differ (an object's __getstate__ may make new
                # tensors each call), their layout may not: another thread may have
                # changed the state dict between the walks (a (1,)-tensor swapped in
                # for a (4,)-tensor would even broadcast silently), and then the stage
                # is refused.
                with _no_torch_function():
                    holds = plan_holds(plan, leaves, tick, planned=collect.leaves, pool=bufset.pool)
                if not holds:
                    result = walk = None
                    bufset.forget_plan(sig)
                    bufset.watch()
                    raise StagingError(
                        "the state dict changed while it was being staged: "
                        "do not mutate it until stage() returns"
                    )
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
                        result = walk = None
                        bufset.forget_plan(sig)
                        bufset.watch()
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
                lease=held,
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
            if held is not None:
                held.release()
            raise
        finally:
            with self._cond:
                bufset.busy = False
                self._cond.notify_all()

    def _preflight(self, bufset: BufferSet, *, reserve: bool) -> Callable[[list[int]], None] | None:
        """The pre-flight check ``make_plan`` runs before it allocates (see
        ``_preflight``): at reserve(), and at a stage into a set that maps nothing yet.
        None otherwise, so a stage into a set that holds memory pays nothing."""
        if not self.options.preflight or (not reserve and bufset.pool.arenas):
            return None
        with self._cond:
            held = [s for s in self._sets if s.pool.arenas]
        return engine_hook(
            self.options,
            self._pinner,
            reserve=reserve,
            held_bytes=sum(s.pool.host_bytes for s in held),
            held_sets=len(held),
        )

    def _select(
        self, sig: Any, lease: bool, cancel: threading.Event | None
    ) -> tuple[BufferSet, Lease[Any] | None]:
        """A buffer set no result of which is reachable or leased (``BufferSet.held``)
        and that no stage is writing; a new one while fewer than ``max_buffer_sets``
        exist; otherwise waits (cancellably) for one to be dropped or released.

        The wait polls (nothing signals that a result became unreachable), from 1 ms
        up to 50 ms, with one garbage collection first (a result in a reference cycle
        is unreachable but not yet freed). It logs a warning after a few seconds and
        raises BuffersHeldError after ``options.buffer_wait_timeout`` seconds, so a
        stage whose own caller holds every set cannot hang silently.
        """
        timeout = self.options.buffer_wait_timeout
        t0 = time.monotonic()
        delay = 0.001
        collected = warned = False
        while True:
            with self._cond:
                if self.closed:
                    raise ClosedError("the stager is closed")
                if cancel is not None and cancel.is_set():
                    raise Cancelled()
                pick = self._pick(sig)
                if pick is not None:
                    pick.busy = True
                    if not lease:
                        return pick, None
                    pick.leases += 1
                    return pick, Lease(functools.partial(self._give_back, pick))
                held = self._describe_held()
            waited = time.monotonic() - t0
            if timeout is not None and waited >= timeout:
                raise BuffersHeldError(
                    f"no buffer set became free within {timeout:g} s: all {len(self._sets)} "
                    f"(max_buffer_sets={self.options.max_buffer_sets}) are held ({held}). "
                    "Drop staged results you no longer need (del staged), release leases, "
                    "or raise max_buffer_sets or buffer_wait_timeout"
                )
            if not warned and waited >= min(_WARN_AFTER, (timeout or _WARN_AFTER) / 2):
                warned = True
                _log.warning(
                    "stage has waited %.1f s for a buffer set: all %d are held (%s); it "
                    "goes on when a staged result is dropped or a lease released",
                    waited,
                    len(self._sets),
                    held,
                )
            if not collected:
                collected = True
                gc.collect()
                continue
            with self._cond:
                # Releases and finished stages notify; unreachable results do not.
                self._cond.wait(delay)
            delay = min(delay * 2, 0.05)

    def _pick(self, sig: Any) -> BufferSet | None:
        """Under the lock: the free set to write into (one with a plan for ``sig``
        first, then the most recent), or a new one, or None."""
        cands = [s for s in self._sets if not s.leases and not s.busy]
        cands.sort(key=lambda s: (sig not in s.plans, s is not self._recent))
        for s in cands:
            if not s.held():
                return s
        if len(self._sets) < self.options.max_buffer_sets:
            s = BufferSet(len(self._sets), shared=self.options.share_memory, pinner=self._pinner)
            self._sets.append(s)
            return s
        return None

    def _describe_held(self) -> str:
        parts = []
        for s in self._sets:
            if s.busy:
                parts.append(f"set {s.index}: being written")
            elif s.leases:
                parts.append(f"set {s.index}: {s.leases} lease(s)")
            else:
                parts.append(f"set {s.index}: a staged result is still reachable")
        return "; ".join(parts)

    def _enqueue(
        self,
        bufset: BufferSet,
        plan: Plan,
        leaves: list[torch.Tensor],
        captures: dict[torch.device, Any],
        tick: Callable[[], None],
    ) -> tuple[list[Completion], list[torch.device]]:
        """Enqueue every program's copies; returns the completions and, pairwise, the
        device each belongs to (CPU programs finish inside and have none).

        Ordering: each device's copies wait (on the device) for its capture; the CPU
        program's host copies wait (in this thread) for every capture, since a pinned
        CPU leaf may still be filled by a ``non_blocking`` copy queued before the call.
        So the CPU program goes last: the device copies are already enqueued while it
        waits."""
        completions: list[Completion] = []
        devices: list[torch.device] = []
        # Kept for _copy_error, which orders its copies the same way.
        self._stage_captures: dict[torch.device, Any] | None = captures
        programs = sorted(plan.programs, key=lambda p: p.device.type == "cpu")
        with torch.no_grad():
            for prog in programs:
                copier = self._copier(prog.device)
                srcs_all: list[torch.Tensor] = []
                try:
                    # Hazard: from begin() to end() the copier may hold a stream context
                    # on this thread; end() must run whatever happens.
                    copier.begin(order_after(prog.device, captures))
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
        self._stage_captures = None
        return completions, devices

    def _copy_error(
        self, sd: Any, plan: Plan, leaves: list[torch.Tensor], bufset: BufferSet, cause: BaseException
    ) -> StagingError:
        """Find which unit's copy fails, for an error that names its path: each unit is
        copied again on its own, through its device's copier (the failed batch may have
        mixed many tensors). The copies are those of a stage: ordered after the stage's
        captures, their sources protected from the allocator, their completions in
        flight in the set and the latest of their device (for ``fence``)."""
        captures = getattr(self, "_stage_captures", None) or {}
        self._stage_captures = None
        with torch.no_grad(), _no_torch_function():
            for unit in plan.units:
                copier = self._copier(unit.device)
                srcs: list[torch.Tensor] = []
                try:
                    copier.begin(order_after(unit.device, captures))
                    srcs = sources([unit], leaves)
                    copier.copy([unit.dst], srcs)
                except RuntimeError as e:
                    err = CopyError(f"copying this tensor failed: {e}", path=path_of_leaf(sd, unit.rep))
                    err.__cause__ = e
                    return err
                finally:
                    try:
                        copier.protect(srcs)
                    finally:
                        done = copier.end()
                        if done is not None:
                            self.latest[unit.device] = done
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

    def _give_back(self, bufset: BufferSet) -> None:
        """One lease on ``bufset`` ends; called only by ``Lease.release`` (once)."""
        with self._cond:
            if bufset.leases > 0:
                bufset.leases -= 1
            self._cond.notify_all()

    def fence(self) -> Callable[[], None]:
        """Caller's thread, at the call: read the caller's current stream of every
        device (as ``capture`` does); returns the function (any thread, once the last
        submitted stage has enqueued its copies) that makes each of those streams wait
        for the latest copies enqueued on its device (by whichever stage: a later stage
        that failed validation or was a reserve() must not hide an earlier one's copies
        still in flight). Raises UnsupportedError if one of the streams is capturing a
        CUDA graph."""
        devices = dict.fromkeys(self.backend.known_devices())
        devices.update(dict.fromkeys(d for d in list(self._copiers) if d.type != "cpu"))
        for d in devices:
            if self.backend.capturing(d):
                raise graph_capture_error("fence()", d)
        points = {d: self._copier(d).fence_point() for d in devices}

        def apply() -> None:
            for d, c in list(self.latest.items()):
                # A device first used after the call (no point read): the current
                # stream of the thread applying the fence.
                self._copier(d).fence(c, points.get(d))

        return apply

    def observe_bandwidth(self, devices: Sequence[torch.device], nbytes: int, seconds: float) -> None:
        """A stage's ``nbytes`` bytes of copies on ``devices`` completed ``seconds``
        after they were enqueued: fold that into each device's bandwidth estimate (an
        exponential moving average; the first observation sets it)."""
        if seconds <= 0 or not nbytes:
            return
        seen = nbytes / max(seconds, 1e-6)
        for d in devices:
            old = self.bandwidth.get(d)
            self.bandwidth[d] = seen if old is None else 0.7 * old + 0.3 * seen

    def shared_arenas(self) -> list[Arena]:
        """Every open shared-memory arena of every buffer set (for ``export_shared``),
        read under the engine's lock."""
        with self._cond:
            sets = list(self._sets)
        return [a for s in sets for a in list(s.pool.arenas) if a.shared and a.fd >= 0]

    @property
    def host_bytes(self) -> int:
        """Host memory (bytes) mapped by every buffer set."""
        return sum(s.pool.host_bytes for s in list(self._sets))

    @property
    def buffer_sets(self) -> int:
        return len(self._sets)

    def trim(self) -> int:
        """Return host memory no result uses (worker thread, between stages): in each
        buffer set that is neither leased, busy nor holding a reachable result, drop
        the cache entries of dead sources and release every arena left without a
        block. Returns the bytes released. Held sets are left as they are."""
        released = 0
        with self._cond:
            for s in self._sets:
                if s.busy or s.held():
                    continue
                s.wait_inflight()
                if s.cache.sweep():
                    s.forget_plans()
                released += s.pool.trim()
                s.watch()
        return released

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


def _no_torch_function() -> Any:
    """Tensor subclasses' ``__torch_function__`` overrides off (this thread) while the
    engine inspects and copies their data: staging copies the bytes as they are, and an
    override that raises or redirects must not break or bend that."""
    return torch._C.DisableTorchFunctionSubclass()


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
