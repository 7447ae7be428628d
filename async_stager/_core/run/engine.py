"""The staging engine: walk, reserve host blocks, enqueue copies. Synchronous.

Both public APIs sit on this: the async Stager (``aio.stager``) and the seed's
DefaultStager (``_dcp.default_stager``), each made by ``make.build_engine``. ``capture`` runs on the caller's thread at the call;
``run`` runs on the stager's worker thread; ``settle`` may run anywhere.

A stage's steps (``Engine._run``): take a free buffer set, build the result, enqueue
the copies. Fast path (``_reuse``, the common case: one walk): the state dict is
walked once with the host tensors of the plan that matches its signature; if every
leaf's fingerprint (see ``_layout.FINGERPRINT``) equals the plan's, or the leaves are
new tensors of its layout whose predecessors died (``take_over``), the plan's copy
program runs as is. Otherwise the slow path (``_replan``) validates every leaf,
groups leaves by source storage, looks each storage up in the storage cache
(allocating exact-size blocks for misses), makes a new plan and walks again to build
the result around it. ``_copy`` enqueues either.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from async_stager._core.checksum.digest import Checksums
from async_stager._core.copy.copiers import ScratchCopier
from async_stager._core.copy.device import Backend, Completion, Copier, graph_capture_error
from async_stager._core.interp import gc_paused, gil_interval
from async_stager._core.memory.arena import Arena, Pinner, pinning_skipped
from async_stager._core.memory.buffer_sets import BufferSet, BufferSets
from async_stager._core.memory.lease import Lease
from async_stager._core.memory.ledger import NodeLedger
from async_stager._core.memory.preflight import engine_hook
from async_stager._core.options import StagerOptions
from async_stager._core.plan.build import make_plan
from async_stager._core.plan.layout import Plan, signature_of
from async_stager._core.plan.reuse import hosts_intact, plan_holds, take_over
from async_stager._core.run.enqueue import diagnose_copy_error, enqueue, no_torch_function
from async_stager._core.run.lanes import Lanes
from async_stager._core.run.records import Cancelled, Captures, StageRecord
from async_stager._core.walk.objects import GeneratorStates, check_state_dict, generator_states
from async_stager._core.walk.tree import Walk, tensorless_copy
from async_stager.errors import ClosedError, StagingError

__all__ = ["CancelCheck", "Engine"]


_log = logging.getLogger("async_stager")


#: ``Engine.capture``'s default: no state dict given (only torch's default generators
#: are looked at).
_NO_STATE: Any = object()


class _PlanStale(Exception):
    """Internal: the fast path's copy failed; retry on the slow path."""


@dataclass(eq=False)
class _Built:
    """What a stage's walk built: the result around ``plan``'s host tensors, the
    leaves it read (what the copies read), whether the plan was reused (``fast``), and
    the storage cache's hits and misses."""

    result: Any
    leaves: list[torch.Tensor]
    plan: Plan
    fast: bool
    hits: int
    misses: int


@dataclass(eq=False)
class _Tensorless:
    """What a stage's walk built when the state dict holds no tensor: the whole staged
    copy, which needs no buffer set."""

    result: Any


def _nothing_to_give_back() -> None:
    """The release of a lease on a stage that took no buffer set."""


class Engine:
    """Host buffers, caches, plans and copiers of one stager."""

    def __init__(
        self,
        options: StagerOptions,
        *,
        backend: Backend,
        pinner: Pinner | None,
        ledger: NodeLedger | None = None,
        owns_ledger: bool = False,
    ) -> None:
        """Made by ``build_engine`` (options resolved against ``backend``, ``pinner``
        the one it pins with, None when not pinning; ``ledger``: the node budget, closed
        with the engine when ``owns_ledger``)."""
        self.options = options
        self.backend = backend
        self._pinner = pinner
        self.sets: BufferSets[Plan] = BufferSets(
            max_sets=options.max_buffer_sets,
            shared=options.share_memory,
            pinner=self._pinner,
            wait_timeout=options.buffer_wait_timeout,
            ledger=ledger,
            owns_ledger=owns_ledger,
        )
        self._copiers: dict[torch.device, Copier] = {}
        self._copiers_lock = threading.Lock()
        #: The latest completion enqueued per device, by any stage (also one that
        #: failed or was cancelled after enqueueing part of its copies): what fence()
        #: must order after.
        self.latest: dict[torch.device, Completion] = {}
        #: Measured bytes/second of device-to-host copies, per device (for polling).
        self.bandwidth: dict[torch.device, float] = {}
        #: Copiers and rings of budgeted saves through this stager, kept between saves.
        self.lanes = Lanes(backend, pinner)

    # -- caller thread ----------------------------------------------------------------

    def capture(self, sd: Any = _NO_STATE) -> Captures:
        """Snapshot point: an event on the caller's current stream of every device a
        source may live on (every CUDA device with a context, the caller's current one
        first, and every device staged from before). The leaves are not known before
        the walk, so all of them: an event record each, microseconds. Also the states
        of the generators at the top levels of ``sd`` (the state dict being staged) and
        of torch's default generators (``generator_states``): a generator advances on
        the host, unordered by any stream, so it is read now, not when the worker walks.

        Raises UnsupportedError if one of those streams is capturing a CUDA graph, and
        InvalidStateDictError for an ``sd`` that is not a state dict (``check_state_dict``)."""
        if self.closed:
            raise ClosedError("the stager is closed")
        if sd is not _NO_STATE:
            check_state_dict(sd)
        devices = dict.fromkeys(self.backend.known_devices())
        devices.update(dict.fromkeys(d for d in list(self._copiers) if d.type != "cpu"))
        # Checked before anything is made or recorded on a device (a capturing stream
        # would take an event record into its graph).
        for d in devices:
            if self.backend.capturing(d):
                raise graph_capture_error("stage()", d)
        points = {d: self._copier(d).capture() for d in devices}
        return Captures(points, generator_states(None if sd is _NO_STATE else sd))

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
        such device: none (see ``_skips_pinning``)."""
        devs = [d for d in captures if d.type == "cuda"] or [
            d for d in list(self._copiers) if d.type == "cuda"
        ]
        if devs:
            return self.backend.device_guard(devs[0])
        return contextlib.nullcontext()

    def _skips_pinning(self, captures: dict[torch.device, Any]) -> bool:
        """A stage pins no new host memory with a pinner that needs a device context
        (``Pinner.needs_context``: CudaPinner) when no accelerator device is in use: no
        device was captured at the call (the real backend captures every CUDA device
        with a context, and a CUDA tensor implies one), so every source is on the host
        (a CPU-only state dict on a machine that has not used CUDA yet). Pinning would
        create a CUDA context (about 0.5 GiB of device memory, on some GPU) for memory
        that no device copy reads or writes. Arenas made so stay unpinned; a later stage
        from a device takes new, pinned ones (``HostPool.allocate``)."""
        return (
            self._pinner is not None and bool(getattr(self._pinner, "needs_context", False)) and not captures
        )

    # -- worker thread ----------------------------------------------------------------

    def run(
        self,
        sd: Any,
        captures: dict[torch.device, Any],
        *,
        lease: bool = False,
        cancel: threading.Event | None = None,
        copy: bool = True,
        checksums: bool = False,
    ) -> StageRecord:
        """Stage ``sd`` into a free buffer set; returns once the copies are enqueued
        (on the CPU: done, and with ``checksums`` hashed). Raises StagingError
        subclasses, or Cancelled."""
        unpinned = pinning_skipped() if self._skips_pinning(captures) else contextlib.nullcontext()
        try:
            with gil_interval(self.options.yield_interval), self._device_context(captures), unpinned:
                try:
                    return self._run(sd, captures, lease, cancel, copy, checksums, allow_fast=True)
                except _PlanStale:
                    pass
                # A leaf changed in a way the fingerprint does not see: the plan is gone;
                # the slow path checks everything. Retried outside the except block, so the
                # failed attempt's frame (and the result it built) is gone: a stale result
                # alive now would skew the buffer set's reachability baseline.
                return self._run(sd, captures, lease, cancel, copy, checksums, allow_fast=False)
        finally:
            if isinstance(captures, Captures):
                # Used by the walks only: not kept (with its generators and their state
                # tensors) for as long as whoever holds the captures lives.
                captures.generators = {}

    def _run(
        self,
        sd: Any,
        captures: dict[torch.device, Any],
        lease: bool,
        cancel: threading.Event | None,
        copy: bool,
        checksums: bool,
        *,
        allow_fast: bool,
    ) -> StageRecord:
        """One attempt at a stage, in its steps: take a buffer set, build the result
        (``_reuse``: the set's plan for this signature still holds, one walk; else
        ``_replan``: a new plan, two walks), then enqueue the copies (``_copy``).

        A state dict that holds no tensor takes no set (``_setless``): it never waits
        for one, never makes one, and a set it took while one was free is given back
        untouched (no plan, no cache entry, not marked the most recent)."""
        t0 = time.perf_counter()
        tick = CancelCheck(cancel, self)
        # Generator states taken at the call (``capture``); none: read as the walk goes.
        gens: GeneratorStates | None = getattr(captures, "generators", None)
        sig = signature_of(sd)
        found: list[Any] = []

        def spare() -> bool:
            # Asked only when no existing set is free: walks up to the first tensor.
            empty, result = tensorless_copy(sd, tick=tick, generators=gens)
            if empty:
                found.append(result)
            return empty

        bufset, held = self.sets.select(sig, lease, tick.check_cancelled, spare)
        if bufset is None:
            return self._setless(found.pop(), lease, checksums and copy, t0)
        succeeded = False
        try:
            bufset.wait_inflight()
            plan = bufset.plan_for(sig) if allow_fast else None
            reused = self._reuse(plan, sd, bufset, tick, gens) if plan is not None else None
            built = (
                reused if reused is not None else self._replan(sd, sig, bufset, tick, gens, captures, copy)
            )
            del reused
            if isinstance(built, _Tensorless):
                if held is not None:
                    held.release()
                return self._setless(built.result, lease, checksums and copy, t0)
            tick()
            completions, devices, digests = self._copy(
                built, sd, sig, bufset, captures, tick, copy, checksums
            )
            succeeded = True
            plan = built.plan
            return StageRecord(
                result=built.result,
                bufset=bufset,
                completions=completions,
                lease=held,
                tensors=len(built.leaves),
                storages=plan.storages,
                nbytes=plan.nbytes,
                hits=built.hits,
                misses=built.misses,
                fast_path=built.fast,
                worker_seconds=time.perf_counter() - t0,
                devices=devices,
                checksums=digests,
            )
        except BaseException:
            if held is not None:
                held.release()
            raise
        finally:
            self.sets.done_writing(bufset, succeeded=succeeded)

    def _setless(self, result: Any, lease: bool, checksums: bool, t0: float) -> StageRecord:
        """The record of a stage that copied no tensor: its result is the walk's copy
        of the structure, in no buffer set; a lease on it holds nothing."""
        return StageRecord(
            result=result,
            bufset=None,
            completions=[],
            lease=Lease(_nothing_to_give_back) if lease else None,
            tensors=0,
            storages=0,
            nbytes=0,
            hits=0,
            misses=0,
            fast_path=False,
            worker_seconds=time.perf_counter() - t0,
            devices=[],
            checksums=Checksums() if checksums else None,
        )

    def _reuse(
        self, plan: Plan, sd: Any, bufset: BufferSet[Plan], tick: CancelCheck, gens: GeneratorStates | None
    ) -> _Built | None:
        """The common case, one walk: the result built around ``plan``'s host tensors,
        if its leaves still have the plan's fingerprint (``plan_holds``) or are new
        tensors of its layout whose predecessors died (``take_over``); else None (and
        nothing built stays alive: the caller then re-watches the set)."""
        with no_torch_function():
            if not hosts_intact(plan, tick):
                return None  # a caller changed a tensor of an earlier result in place
        walk = Walk(plan.hosts, validate=False, tick=tick, generators=gens)
        result = walk.rebuild(sd)
        leaves = walk.leaves
        with no_torch_function():
            if plan_holds(plan, leaves, tick):
                return _Built(result, leaves, plan, True, plan.storages, 0)
        # New tensors of the plan's layout, their predecessors dead (a full state dict
        # rebuilt every checkpoint): they take the memory over. gc paused: it makes an
        # object per storage, as make_plan does.
        with gc_paused(), no_torch_function():
            if take_over(plan, leaves, bufset.cache, bufset.pool, tick):
                return _Built(result, leaves, plan, True, plan.storages, 0)
        return None

    def _replan(
        self,
        sd: Any,
        sig: Any,
        bufset: BufferSet[Plan],
        tick: CancelCheck,
        gens: GeneratorStates | None,
        captures: dict[torch.device, Any],
        copy: bool,
    ) -> _Built | _Tensorless:
        """The slow path, two walks: the first collects and validates every leaf, a new
        plan is made from them (storage cache lookups, allocation), the second builds
        the result around the new plan's host tensors. Raises StagingError if the state
        dict changed between the walks. A state dict with no tensor: the first walk's
        copy is the whole result (``_Tensorless``), and the set is left as it was."""
        # The cyclic GC paused for the whole slow path, not only make_plan: the walks
        # and checks make objects per leaf too, and collections scanning a heap that
        # grows with every plan doubled the first stage of 20k tensors in a process
        # already holding other plans.
        with gc_paused():
            collect = Walk((), validate=True, tick=tick, generators=gens)
            collected = collect.rebuild(sd)
            if not collect.leaves:
                return _Tensorless(collected)
            del collected
            with no_torch_function():
                plan, hits, misses = make_plan(
                    self._copier,
                    self.options,
                    bufset,
                    sig,
                    collect.leaves,
                    tick,
                    prefault=not copy,
                    preflight=self._preflight(
                        bufset, reserve=not copy, pinned=not self._skips_pinning(captures)
                    ),
                    device_of=self.backend.device_of if self.backend.places_tensors else None,
                )
            # Remembered and watched before the walk below builds the result: the
            # baseline of ``held`` must count the stager's references only.
            bufset.remember(plan)
            bufset.watch()
            walk = Walk(plan.hosts, validate=False, tick=tick, generators=gens)
            result = walk.rebuild(sd)
            leaves = walk.leaves
            # Hazard: the copies read the second walk's leaves into the plan of the
            # first. Their memory may differ (an object's __getstate__ may make new
            # tensors each call), their layout may not: another thread may have
            # changed the state dict between the walks (a (1,)-tensor swapped in for a
            # (4,)-tensor would even broadcast silently), and then the stage is refused.
            with no_torch_function():
                holds = plan_holds(plan, leaves, tick, planned=collect.leaves, pool=bufset.pool)
            if not holds:
                del result, walk
                bufset.forget_plan(sig)
                bufset.watch()
                raise StagingError(
                    "the state dict changed while it was being staged: do not mutate it until stage() returns"
                )
            return _Built(result, leaves, plan, False, hits, misses)

    def _copy(
        self,
        built: _Built,
        sd: Any,
        sig: Any,
        bufset: BufferSet[Plan],
        captures: dict[torch.device, Any],
        tick: CancelCheck,
        copy: bool,
        checksums: bool,
    ) -> tuple[list[Completion], list[torch.device], Checksums | None]:
        """Enqueue the copies of ``built`` (none for a reserve: ``copy`` False) and
        track their completions in ``bufset``. Raises _PlanStale when a reused plan's
        copy fails (the caller retries on the slow path), else the diagnosed
        CopyError."""
        track = functools.partial(self.sets.track, bufset)
        completions: list[Completion] = []
        devices: list[torch.device] = []
        digests = Checksums() if checksums and copy else None
        plan, leaves = built.plan, built.leaves
        if copy:
            try:
                with no_torch_function():
                    completions, devices = enqueue(
                        self._copier,
                        plan,
                        leaves,
                        captures,
                        tick,
                        self.latest,
                        track,
                        digests,
                        first=built.misses > 0,
                    )
            except RuntimeError as e:
                if built.fast:
                    # Nothing built may stay alive when the set is re-watched.
                    built.result = None
                    bufset.forget_plan(sig)
                    bufset.watch()
                    raise _PlanStale() from None
                err = diagnose_copy_error(self._copier, sd, plan, leaves, captures, e, self.latest, track)
                raise err from err.__cause__
        track(completions)
        return completions, devices, digests

    def _preflight(
        self, bufset: BufferSet[Plan], *, reserve: bool, pinned: bool = True
    ) -> Callable[[list[int]], None] | None:
        """The pre-flight check ``make_plan`` runs before it allocates (see
        ``_preflight``): at reserve(), and at a stage into a set that maps nothing yet.
        None otherwise, so a stage into a set that holds memory pays nothing.
        ``pinned``: whether this stage's new memory is pinned (``_skips_pinning``)."""
        if not self.options.preflight or (not reserve and bufset.pool.arenas):
            return None
        with self.sets.cond:
            held = [s for s in self.sets.all() if s.pool.arenas]
        return engine_hook(
            self.options,
            self._pinner if pinned else None,
            reserve=reserve,
            held_bytes=sum(s.pool.host_bytes for s in held),
            held_sets=len(held),
            ledger=self.sets.ledger,
        )

    # -- any thread -------------------------------------------------------------------

    def settle(self, staged: StageRecord) -> None:
        """The stage's completions have been observed: the set has nothing in flight."""
        if staged.bufset is not None:
            self.sets.settle(staged.bufset, staged.completions)

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
        """Every open shared-memory arena of every buffer set (for ``export_shared``)."""
        return self.sets.shared_arenas()

    @property
    def host_bytes(self) -> int:
        """Host memory (bytes) mapped by every buffer set."""
        return self.sets.host_bytes

    @property
    def buffer_sets(self) -> int:
        return len(self.sets)

    @property
    def closed(self) -> bool:
        return self.sets.closed

    def begin_close(self) -> None:
        """Any thread: stop taking stages (a running walk stops at its next tick, a
        stage waiting for a buffer set raises ClosedError); ``close`` then releases."""
        self.sets.mark_closed()

    def trim(self) -> int:
        """Return host memory no result uses (worker thread, between stages): see
        ``BufferSets.trim``. Returns the bytes released; held sets are left as they
        are; idle budget lanes drop their rings (they keep their streams)."""
        return self.sets.trim() + self.lanes.trim()

    def close(self) -> None:
        """Wait for copies in flight, release every arena and stream; idempotent."""
        with self._device_context({}):
            errors = self.sets.close()
        self.latest.clear()
        lanes_error = self.lanes.close()
        if lanes_error is not None:
            errors.append(lanes_error)
        for c in list(self._copiers.values()):
            try:
                c.close()
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        self._copiers.clear()
        if errors:
            raise StagingError(f"closing released everything but reported: {errors[0]!r}") from errors[0]


class CancelCheck:
    """A job's cancellation check, called every few hundred leaves by the walk and
    between copy chunks (the ``tick`` they take): raises Cancelled for a cancelled job
    and ClosedError once the stager is closed, so such a job stops before its copies
    start (or between chunks)."""

    __slots__ = ("cancel", "engine")

    def __init__(self, cancel: threading.Event | None, engine: Engine) -> None:
        self.cancel = cancel
        self.engine = engine

    def __call__(self) -> None:
        self.check_cancelled()
        if self.engine.closed:
            raise ClosedError("the stager was closed during the stage")

    def check_cancelled(self) -> None:
        """Raises Cancelled if the job was cancelled (the closed stager is checked by
        whoever calls this under its own lock)."""
        if self.cancel is not None and self.cancel.is_set():
            raise Cancelled()
