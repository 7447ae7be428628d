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
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._arena import ALIGN, CudaPinner, Pinner
from ._cache import FINGERPRINT, BufferSet, DeviceProgram, Plan, Run, Unit, fingerprint, signature_of
from ._device import Backend, Completion, Copier, RealBackend
from ._errors import ClosedError, CopyError, StagingError
from ._options import StagerOptions
from ._tree import Walk, path_of_leaf

__all__ = ["Cancelled", "Engine", "Staged"]


class Cancelled(Exception):
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
            else RealBackend(non_blocking=options.non_blocking)
        )
        if pinner is None and options.pin_memory:
            pinner = CudaPinner()
        self._pinner = pinner if options.pin_memory else None
        self._sets: list[BufferSet] = []
        self._cond = threading.Condition()
        self._copiers: dict[torch.device, Copier] = {}
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
        c = self._copiers.get(device)
        if c is None:
            c = self._copiers[device] = self.backend.copier(device)
        return c

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
        tick = _Ticker(self.options.yield_interval, cancel, self)
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
                fast = _plan_holds(plan, leaves, tick)
            if not fast:
                collect = Walk((), validate=True, tick=tick)
                collect.run(sd)
                with _gc_paused():
                    plan, hits, misses = self._make_plan(bufset, sig, collect.leaves, tick, prefault=not copy)
                walk = Walk(plan.hosts, validate=False, tick=tick)
                result = walk.run(sd)
                leaves = walk.leaves
                if len(leaves) != len(collect.leaves):
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
            if copy:
                try:
                    completions = self._enqueue(plan, leaves, captures, tick)
                except RuntimeError:
                    if fast:
                        bufset.plans.pop(sig, None)
                        raise _PlanStale() from None
                    raise self._copy_error(sd, plan, leaves) from None
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
                devices=[p.device for p in plan.programs if completions],
            )
        except BaseException:
            if lease:
                self.release(bufset)
            raise
        finally:
            with self._cond:
                bufset.busy = False
                self._cond.notify_all()

    def _select(
        self, sig: Any, lease: bool, cancel: threading.Event | None
    ) -> BufferSet:
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

    def _make_plan(
        self,
        bufset: BufferSet,
        sig: Any,
        leaves: list[torch.Tensor],
        tick: Callable[[], None],
        *,
        prefault: bool,
    ) -> tuple[Plan, int, int]:
        uniq: list[torch.Tensor] = []
        leaf_u: list[int] = []
        seen: dict[int, int] = {}
        for t in leaves:
            u = seen.get(id(t))
            if u is None:
                u = seen[id(t)] = len(uniq)
                uniq.append(t)
            leaf_u.append(u)
        # Group by source storage: views and aliases share one host storage.
        groups: dict[int, _Group] = {}
        for u, t in enumerate(uniq):
            st = t.untyped_storage()
            g = groups.get(st._cdata)
            if g is None:
                g = groups[st._cdata] = _Group(st, t.device)
            g.members.append(u)
            if not u % 256:
                tick()
        if bufset.cache.sweep():
            # Blocks went back to the arena and may be handed out again: no other plan
            # of this set may keep writing into them.
            bufset.plans.clear()
        missing: list[_Group] = []
        for g in groups.values():
            g.block = bufset.cache.lookup(g.storage, g.device)
            if g.block is None:
                missing.append(g)
        if missing:
            # Smallest first: small storages land adjacent, so a device can move a run
            # of them with one copy.
            missing.sort(
                key=lambda g: g.storage.nbytes() > self.options.small_tensor_bytes
            )
            blocks = bufset.pool.allocate([g.storage.nbytes() for g in missing], prefault=prefault)
            for g, b in zip(missing, blocks):
                g.block = b
                bufset.cache.insert(g.storage, g.device, b)
        tick()
        host_u: list[Any] = [None] * len(uniq)
        units: list[Unit] = []
        whole_checks: list[tuple[int, int, int]] = []
        member_meta: list[tuple[int, tuple[int, ...], tuple[int, ...], int]] = []
        first_leaf = {u: i for i, u in reversed(list(enumerate(leaf_u)))}
        nbytes = 0
        for n, g in enumerate(groups.values()):
            block = g.block
            assert block is not None
            base = block.tensor.untyped_storage()
            for u in g.members:
                t = uniq[u]
                if block.nbytes:
                    h = torch.empty(0, dtype=t.dtype).set_(
                        base, t.storage_offset(), t.size(), t.stride()
                    )
                else:
                    h = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype)
                host_u[u] = h
            size = block.nbytes
            nbytes += size
            rep_u = g.members[0]
            t = uniq[rep_u]
            whole = not (
                len(g.members) == 1
                and t.storage_offset() == 0
                and t.numel() * t.element_size() == size
                and t.is_contiguous()
            )
            if size:
                rep = first_leaf[rep_u]
                units.append(
                    Unit(
                        rep,
                        block.tensor if whole else host_u[rep_u],
                        size,
                        whole,
                        g.device,
                        block,
                    )
                )
                if whole:
                    whole_checks.append((rep, g.storage.data_ptr(), size))
                    for u in g.members:
                        m = uniq[u]
                        member_meta.append(
                            (
                                first_leaf[u],
                                tuple(m.size()),
                                m.stride(),
                                m.storage_offset(),
                            )
                        )
            if not n % 256:
                tick()
        wrapped = [_wrap(uniq[u], host_u[u]) for u in range(len(uniq))]
        hosts = [wrapped[u] for u in leaf_u]
        programs = self._programs(units, uniq, leaves)
        plan = Plan(
            signature=sig,
            hosts=hosts,
            programs=programs,
            units=units,
            fingerprint=fingerprint(leaves),
            whole_checks=whole_checks,
            member_meta=member_meta,
            nbytes=nbytes,
            storages=len(groups),
        )
        return plan, len(groups) - len(missing), len(missing)

    def _programs(
        self, units: list[Unit], uniq: list[torch.Tensor], leaves: list[torch.Tensor]
    ) -> list[DeviceProgram]:
        by_dev: dict[torch.device, DeviceProgram] = {}
        for unit in units:
            prog = by_dev.get(unit.device)
            if prog is None:
                prog = by_dev[unit.device] = DeviceProgram(unit.device)
            prog.direct.append(unit)
        budget = self.options.scratch_bytes
        for prog in by_dev.values():
            copier = self._copier(prog.device)
            if not copier.batch_small:
                continue
            small = [
                u for u in prog.direct if u.nbytes <= self.options.small_tensor_bytes
            ]
            small.sort(key=lambda u: (id(u.block.arena), u.block.offset))
            runs: list[list[Unit]] = []
            for u in small:
                cur = runs[-1] if runs else None
                if (
                    cur is not None
                    and cur[-1].block.arena is u.block.arena
                    and cur[-1].block.offset + _align(cur[-1].nbytes) == u.block.offset
                ):
                    cur.append(u)
                else:
                    runs.append([u])
            batched: set[int] = set()
            for run in runs:
                if len(run) < 2:
                    continue
                start = run[0].block.offset
                end = run[-1].block.offset + run[-1].nbytes
                if end - start > budget:
                    continue
                budget -= end - start
                prog.runs.append(_make_run(copier, run, start, end, leaves))
                batched.update(id(u) for u in run)
            prog.direct = [u for u in prog.direct if id(u) not in batched]
        for prog in by_dev.values():
            prog.freeze()
        return list(by_dev.values())

    def _enqueue(
        self,
        plan: Plan,
        leaves: list[torch.Tensor],
        captures: dict[torch.device, Any],
        tick: Callable[[], None],
    ) -> list[Completion]:
        completions: list[Completion] = []
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
                            srcs = _sources(units, leaves)
                            _copy_chunked(copier, views, srcs, tick)
                            srcs_all.extend(srcs)
                        copier.copy([run.span], [run.scratch])
                    if prog.direct:
                        if prog.direct_whole:
                            srcs = _sources(prog.direct, leaves)
                        elif len(prog.direct_reps) == 1:
                            srcs = [leaves[prog.direct_reps[0]]]
                        else:
                            srcs = list(operator.itemgetter(*prog.direct_reps)(leaves))
                        _copy_chunked(copier, prog.direct_dsts, srcs, tick)
                        srcs_all.extend(srcs)
                    copier.protect(srcs_all)
                finally:
                    done = copier.end()
                if done is not None:
                    completions.append(done)
        return completions

    def _copy_error(
        self, sd: Any, plan: Plan, leaves: list[torch.Tensor]
    ) -> StagingError:
        """Find which unit's copy fails, for an error that names its path."""
        with torch.no_grad():
            for unit in plan.units:
                src = _sources([unit], leaves)[0]
                try:
                    unit.dst.copy_(src)
                except RuntimeError as e:
                    err = CopyError(
                        f"copying this tensor failed: {e}",
                        path=path_of_leaf(sd, unit.rep),
                    )
                    err.__cause__ = e
                    return err
        return CopyError("a batched copy failed, but no single copy did")

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

    def fence(
        self, completions: Sequence[Completion], devices: Sequence[torch.device]
    ) -> None:
        for c, d in zip(completions, devices):
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
        for s in sets:
            try:
                s.close()
            except Exception as e:  # noqa: BLE001 - keep releasing the rest
                errors.append(e)
        for c in list(self._copiers.values()):
            try:
                c.close()
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        self._copiers.clear()
        if errors:
            raise StagingError(
                f"closing released everything but reported: {errors[0]!r}"
            ) from errors[0]


class _Group:
    __slots__ = ("block", "device", "members", "storage")

    def __init__(self, storage: torch.UntypedStorage, device: torch.device) -> None:
        self.storage = storage
        self.device = device
        self.members: list[int] = []
        self.block: Any = None


class _Ticker:
    """Called every few hundred leaves by the walk: hands the GIL to the event loop
    now and then, and aborts a cancelled or closed job before its copies start."""

    __slots__ = ("cancel", "engine", "interval", "last")

    def __init__(
        self, interval: float, cancel: threading.Event | None, engine: Engine
    ) -> None:
        self.interval = interval
        self.cancel = cancel
        self.engine = engine
        self.last = time.perf_counter()

    def __call__(self) -> None:
        now = time.perf_counter()
        if now - self.last >= self.interval:
            # A real (if tiny) sleep: the thread blocked in the event loop takes the GIL
            # while we sleep. time.sleep(0) would often win the GIL straight back.
            time.sleep(1e-5)
            self.last = time.perf_counter()
        self.check()

    def check(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise Cancelled()
        if self.engine.closed:
            raise ClosedError("the stager was closed during the stage")


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


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


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


def _make_run(
    copier: Copier, run: list[Unit], start: int, end: int, leaves: list[torch.Tensor]
) -> Run:
    arena = run[0].block.arena
    span = arena.tensor[start:end]
    scratch = copier.scratch(end - start)
    by_dtype: dict[torch.dtype, tuple[list[torch.Tensor], list[Unit]]] = {}
    for u in run:
        rel = u.block.offset - start
        piece = scratch[rel : rel + u.nbytes]
        if u.whole:
            view = piece
        else:
            t = leaves[u.rep]
            view = piece.view(t.dtype).view(t.size())
        views, members = by_dtype.setdefault(view.dtype, ([], []))
        views.append(view)
        members.append(u)
    return Run(
        span=span, scratch=scratch, groups=list(by_dtype.values()), nbytes=end - start
    )


def _sources(
    units: Sequence[Unit], leaves: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    if not any(u.whole for u in units):
        if len(units) == 1:
            return [leaves[units[0].rep]]
        return list(operator.itemgetter(*[u.rep for u in units])(leaves))
    out = []
    for u in units:
        t = leaves[u.rep]
        if u.whole:
            # The whole source storage, as bytes (made per stage: holding it in the
            # plan would keep the source memory alive).
            t = torch.empty(0, dtype=torch.uint8, device=t.device).set_(
                t.untyped_storage()
            )
        out.append(t)
    return out


def _plan_holds(plan: Plan, leaves: list[torch.Tensor], tick: Callable[[], None]) -> bool:
    """True when ``leaves`` can be copied with ``plan`` unchanged."""
    n = len(leaves)
    if n != len(plan.hosts):
        return False
    # In chunks, ticking between them: each map over all leaves holds the GIL.
    for lo in range(0, n, _FP_CHUNK):
        chunk = leaves[lo : lo + _FP_CHUNK]
        for f, expected in zip(FINGERPRINT, plan.fingerprint):
            if list(map(f, chunk)) != expected[lo : lo + _FP_CHUNK]:
                return False
        tick()
    for i, ptr, nbytes in plan.whole_checks:
        st = leaves[i].untyped_storage()
        if st.data_ptr() != ptr or st.nbytes() != nbytes:
            return False
    for i, size, stride, offset in plan.member_meta:
        t = leaves[i]
        if tuple(t.size()) != size or t.stride() != stride or t.storage_offset() != offset:
            return False
    return True


#: Leaves per fingerprint chunk (about 0.2 ms of GIL-holding work each).
_FP_CHUNK = 512


def _wrap(src: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    """The host tensor as the source's type: Parameter, subclass, requires_grad."""
    cls = type(src)
    if cls is torch.Tensor:
        if src.requires_grad:
            host.requires_grad_(True)
        return host
    if isinstance(src, torch.nn.Parameter):
        return torch.Tensor._make_subclass(cls, host, src.requires_grad)
    out = host.as_subclass(cls)
    if src.requires_grad:
        out.requires_grad_(True)
    return out
