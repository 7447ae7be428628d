"""Buffer sets: generations of host buffers, and which one a stage writes into.

A BufferSet is one generation of host buffers: its own arenas (HostPool), its storage
cache and its plans. A stage writes into exactly one set; a set that is leased (a
consumer holds its result), still reachable from a result, or still has copies in
flight is never written. ``BufferSets`` picks the set for a stage (or waits for one),
and owns the lock that guards the sets' bookkeeping.

Node budget: with a node ledger (``node_budget_bytes``), every arena a set maps is
reserved from it first (waiting at most ``wait_timeout`` seconds, in the node's ticket
order) and given back when unmapped; cached sets stay counted between checkpoints, and
``trim()``/``close()`` give their bytes back.
"""

from __future__ import annotations

import functools
import gc
import itertools
import logging
import operator
import os
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import torch

from async_stager._core.memory.arena import Arena, Block, HostPool, Pinner
from async_stager._core.memory.lease import Lease
from async_stager._core.memory.sharing import moves
from async_stager._core.memory.storage_cache import StorageCache
from async_stager.errors import BuffersHeldError, ClosedError, CopyError

if TYPE_CHECKING:
    from async_stager._core.memory.ledger import NodeLedger, Reservation

__all__ = ["MAX_PLANS", "BufferSet", "BufferSets", "InFlight", "Layout"]

_log = logging.getLogger("async_stager")

#: References held to a StorageImpl (tensors viewing it, Python storage objects).
_use_count = torch._C._storage_Use_Count

#: Plans kept per buffer set (several state dicts staged in turn, e.g. model and optim).
MAX_PLANS = 4


#: Objects checked per GIL hold by ``BufferSet.held`` (a slice: a fraction of a ms).
_HELD_SLICE = 4096


class Layout(Protocol):
    """What a buffer set needs of the plans it keeps (``plan.layout.Plan``, in the
    layer above): the key they are found by and the host tensors they hand out."""

    @property
    def signature(self) -> Any: ...

    @property
    def hosts(self) -> list[Any]: ...


class InFlight(Protocol):
    """Copies into a set not yet landed (a ``copy.device.Completion``, in the layer
    above): a set is not written again before ``query()`` is True."""

    def query(self) -> bool: ...


P = TypeVar("P", bound=Layout)


class BufferSet(Generic[P]):
    """One generation of host buffers (see module doc). Fields are guarded by the
    condition variable of the ``BufferSets`` that holds the set, except ``cache``/``plans``, which only the worker
    thread touches while the set is selected."""

    def __init__(
        self,
        index: int,
        *,
        shared: bool,
        pinner: Pinner | None,
        reserve: Callable[[int, Callable[[], int]], Reservation] | None = None,
    ) -> None:
        self.index = index
        self.pool = HostPool(shared=shared, pinner=pinner, reserve=reserve)
        self.cache = StorageCache(self.pool)
        self.plans: OrderedDict[Any, P] = OrderedDict()
        self.leases = 0
        self.busy = False  # selected by a stage that has not finished enqueueing
        self.inflight: list[InFlight] = []
        # Baseline of ``held`` (see ``watch``).
        self._watch_objects: list[Any] = []
        self._watch_refs: list[int] = []
        self._watch_storages: list[int] = []
        self._watch_uses: list[int] = []
        #: ``sharing.moves()`` when this set last looked for blocks moved out of its
        #: arenas, and those found and not yet dropped (``note_moves``).
        self._moves_seen = moves()
        self._moved: list[Block] = []

    def held(self) -> bool:
        """True while a result built from this set may still be reachable: a lease on
        it, a host tensor of one of its plans referenced from outside the stager (the
        staged dict, a tensor taken out of it), or any other reference into one of its
        blocks (a view, ``untyped_storage()``, a numpy array).

        Hazard: exact only against a baseline taken by ``watch`` while no result of
        this set existed; every change to the set's plans or cache must be followed by
        ``watch`` before the stage builds its result. Cost: two C-speed maps (no Python
        per tensor), paid only when a stage considers this set.
        """
        if self.leases:
            return True
        if self.inflight:
            # Copies that have landed are no longer in flight; a copier may hold the
            # destination tensors until it sees that (the fake one does).
            self.inflight = [c for c in self.inflight if not c.query()]
        # Hazard (the GIL): one map over tens of thousands of objects holds the GIL for
        # milliseconds, and the event loop's timers fire that late; in slices with a
        # GIL release between them (``time.sleep(0)``), the loop runs in between. The
        # slices are taken from one iterator (``islice``), never copied into lists: a
        # copy would hold one more reference to every object and read as "held".
        for fn, watched, baseline in (
            (sys.getrefcount, self._watch_objects, self._watch_refs),
            (_use_count, self._watch_storages, self._watch_uses),
        ):
            items, base = iter(watched), iter(baseline)
            for _ in range(0, len(watched), _HELD_SLICE):
                if any(map(operator.gt, map(fn, itertools.islice(items, _HELD_SLICE)), base)):
                    return True
                time.sleep(0)
        return False

    def watch(self) -> None:
        """Take the baseline ``held`` compares with: the references the stager itself
        holds to this set's host tensors and block storages, as Python objects (the
        staged dict, a tensor or ``untyped_storage()`` held) and as C++ references
        (views, numpy arrays over a view)."""
        blocks = self.cache.blocks()
        self._watch_objects = [h for p in self.plans.values() for h in p.hosts]
        self._watch_objects += [b.storage for b in blocks]
        # StorageImpl addresses: stable while the blocks (and their storages) live.
        self._watch_storages = [b.storage._cdata for b in blocks]
        self._watch_refs = list(map(sys.getrefcount, self._watch_objects))
        self._watch_uses = list(map(_use_count, self._watch_storages))

    def note_moves(self) -> None:
        """Under the sets' lock: if torch moved a storage out of an arena of this process
        since this set last looked (``sharing.moves()``), find this set's blocks that
        left (``StorageCache.moved``) and stop watching them and the host tensors on
        them: they view other memory now, so holding them holds nothing of this set.
        The other watched objects keep their baselines (this set's own references have
        not changed). ``drop_moved`` then drops them, once the set is free.

        Costs nothing while nothing moved; one pass over the blocks (and the watched
        objects, when some moved) per move otherwise."""
        seen = moves()
        if seen == self._moves_seen:
            return
        self._moves_seen = seen
        known = {id(b) for b in self._moved}
        new = [b for b in self.cache.moved() if id(b) not in known]
        if not new:
            return
        self._moved += new
        gone = {b.storage._cdata for b in new}
        keep = [
            i
            for i, o in enumerate(self._watch_objects)
            if (o._cdata if isinstance(o, torch.UntypedStorage) else o.untyped_storage()._cdata) not in gone
        ]
        self._watch_objects = [self._watch_objects[i] for i in keep]
        self._watch_refs = [self._watch_refs[i] for i in keep]
        kept = [i for i, c in enumerate(self._watch_storages) if c not in gone]
        self._watch_storages = [self._watch_storages[i] for i in kept]
        self._watch_uses = [self._watch_uses[i] for i in kept]

    def drop_moved(self) -> None:
        """The set is free (not held) and being taken: forget the blocks that moved out
        of its arenas (their bytes go back to the pool) and every plan (their host
        tensors may view a moved storage; the next stage makes a new plan, its cache
        hits kept), and take the baseline again."""
        if not self._moved:
            return
        moved, self._moved = self._moved, []
        self.cache.drop(moved)
        self.forget_plans()
        self.watch()

    def plan_for(self, signature: Any) -> P | None:
        plan = self.plans.get(signature)
        if plan is not None:
            self.plans.move_to_end(signature)
        return plan

    def forget_plans(self) -> None:
        """Drop every plan of this set (their blocks may be handed out again)."""
        self.plans.clear()

    def forget_plan(self, signature: Any) -> None:
        """Drop the plan for ``signature``, if any (it no longer holds)."""
        self.plans.pop(signature, None)

    def remember(self, plan: P) -> None:
        self.plans[plan.signature] = plan
        self.plans.move_to_end(plan.signature)
        while len(self.plans) > MAX_PLANS:
            self.plans.popitem(last=False)

    def wait_inflight(self, timeout: float | None = None) -> None:
        """Block (worker thread) until copies still in flight into this set finish.

        Bounded (``HOST_WAIT_SECONDS`` by default): a wedged device raises CopyError
        saying what is stuck instead of hanging every thread that waits behind it.
        """
        for c in list(self.inflight):
            wait_bounded(c, "copies into a buffer set", HOST_WAIT_SECONDS if timeout is None else timeout)
        self.inflight.clear()

    def close(self) -> None:
        self.wait_inflight()
        self._watch_objects = []
        self.plans.clear()
        self.cache.clear()
        self.pool.close()


#: Seconds a host wait for device copies may last before it fails (a healthy device
#: copies far more than the largest state dict in this time).
HOST_WAIT_SECONDS = 600.0


def wait_bounded(c: InFlight, what: str, timeout: float) -> None:
    """Wait for ``c`` on the host, at most ``timeout`` seconds; CopyError names ``what``.

    Polls ``query()`` with a sleep that doubles up to 10 ms: a blocking synchronize
    cannot be given a bound.
    """
    deadline = time.monotonic() + timeout
    delay = 0.0001
    while not c.query():
        if time.monotonic() >= deadline:
            raise CopyError(
                f"{what} still not finished after {timeout:.0f} s: the device looks wedged "
                "(a kernel that never ends, an Xid error); see nvidia-smi"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.01)


#: Seconds a stage waits for a buffer set before it logs a warning.
WARN_AFTER = 5.0


class BufferSets(Generic[P]):
    """Every buffer set of one stager, and the choice of the one a stage writes into.

    One condition variable guards the sets' ``leases``/``busy``/``inflight`` fields and
    the list itself; releases and finished stages notify it. ``closed`` is set once, by
    ``close``; a waiting stage then raises ClosedError.
    """

    def __init__(
        self,
        *,
        max_sets: int,
        shared: bool,
        pinner: Pinner | None,
        wait_timeout: float | None,
        ledger: NodeLedger | None = None,
        owns_ledger: bool = False,
    ) -> None:
        """``ledger``: the node budget every arena is reserved from (None: none);
        ``owns_ledger``: close it at ``close()``."""
        self.max_sets = max_sets
        self.ledger = ledger
        self._owns_ledger = owns_ledger
        self.shared = shared
        self.pinner = pinner
        self.wait_timeout = wait_timeout
        self.cond = threading.Condition()
        self._sets: list[BufferSet[P]] = []
        self.recent: BufferSet[P] | None = None
        self.closed = False
        #: Counts the events that may free a set and notify ``cond`` (a lease given
        #: back, a stage done writing): a waiting stage that saw it change since its
        #: last look goes round again at once instead of sleeping through the notice.
        self._events = 0

    def all(self) -> list[BufferSet[P]]:
        """The sets, as a new list (read without the lock: the list is only replaced
        or appended to)."""
        return list(self._sets)

    def __len__(self) -> int:
        return len(self._sets)

    def largest_free_bytes(self) -> int:
        """Host bytes mapped by the biggest set that is neither leased nor selected by a
        stage (0 if none): what a stage could write into now without mapping more. Read
        without the lock: a hint, which a concurrent stage may make stale at once."""
        return max((s.pool.host_bytes for s in self.all() if not s.leases and not s.busy), default=0)

    def select(
        self,
        sig: Any,
        lease: bool,
        stop: Callable[[], None],
        spare: Callable[[], bool] | None = None,
    ) -> tuple[BufferSet[P] | None, Lease[Any] | None]:
        """A buffer set no result of which is reachable or leased (``BufferSet.held``)
        and that no stage is writing, marked busy; a new one while fewer than
        ``max_sets`` exist; otherwise waits for one to be dropped or released. With
        ``lease``, also a Lease on it (its one release path).

        ``spare``: asked once (outside the lock, before a new set is made or a wait
        begins) whether this stage can do without a set (one that copies no tensor);
        when it says True, no set is taken: ``(None, None)``. It is not asked while an
        existing set is free, so a stage that finds one pays nothing for the question.

        ``stop`` is called under the lock on every round and raises to end the wait
        (a cancelled job). A lease given back (from any thread) or a stage done
        writing wakes the wait at once; nothing signals that a plain result became
        unreachable, so the wait also polls, from 1 ms up to 50 ms, with one garbage
        collection first (a result in a reference cycle is unreachable but not yet
        freed). It logs a warning after a few seconds and raises BuffersHeldError
        after ``wait_timeout`` seconds, so a stage whose own caller holds every set
        cannot hang silently.
        """
        timeout = self.wait_timeout
        t0 = time.monotonic()
        delay = 0.001
        collected = warned = False
        asked = spare is None
        while True:
            with self.cond:
                if self.closed:
                    raise ClosedError("the stager is closed")
                stop()
                pick = self._pick(sig, make=asked)
                if pick is not None:
                    pick.busy = True
                    if not lease:
                        return pick, None
                    pick.leases += 1
                    return pick, Lease(functools.partial(self._give_back, pick))
                seen = self._events
                held = self._describe_held()
            if not asked:
                assert spare is not None
                asked = True
                if spare():
                    return None, None
                t0 = time.monotonic()  # the question was no wait
                continue
            waited = time.monotonic() - t0
            expired = timeout is not None and waited >= timeout
            # The warning comes first, also when the wait ends at once in an error (a
            # garbage collection slower than half the timeout, on a loaded machine).
            if not warned and (expired or waited >= min(WARN_AFTER, (timeout or WARN_AFTER) / 2)):
                warned = True
                _log.warning(
                    "stage has waited %.1f s for a buffer set: all %d are held (%s); it "
                    "goes on when a staged result is dropped or a lease released",
                    waited,
                    len(self._sets),
                    held,
                )
            if expired:
                raise BuffersHeldError(
                    f"no buffer set became free within {timeout:g} s: all {len(self._sets)} "
                    f"(max_buffer_sets={self.max_sets}) are held ({held}). "
                    "Drop staged results you no longer need (del staged), release leases, "
                    "or raise max_buffer_sets or buffer_wait_timeout"
                )
            if not collected:
                collected = True
                gc.collect()
                continue
            with self.cond:
                # Releases and finished stages notify; unreachable results do not. One
                # that came between the look above and this wait is not slept through.
                if self._events == seen:
                    self.cond.wait(delay)
            delay = min(delay * 2, 0.05)

    def _pick(self, sig: Any, *, make: bool = True) -> BufferSet[P] | None:
        """Under the lock: the free set to write into (one with a plan for ``sig``
        first, then the most recent), or a new one (with ``make``), or None."""
        cands = [s for s in self._sets if not s.leases and not s.busy]
        cands.sort(key=lambda s: (sig not in s.plans, s is not self.recent))
        for s in cands:
            s.note_moves()
            if not s.held():
                s.drop_moved()
                return s
        if make and len(self._sets) < self.max_sets:
            reserve = None if self.ledger is None else functools.partial(self._reserve, len(self._sets))
            new: BufferSet[P] = BufferSet(
                len(self._sets), shared=self.shared, pinner=self.pinner, reserve=reserve
            )
            self._sets.append(new)
            return new
        return None

    def _reserve(self, index: int, nbytes: int, trim_own: Callable[[], int]) -> Reservation:
        """Worker thread, for a new arena of set ``index``: ``nbytes`` of the node
        budget, waiting at most ``wait_timeout`` seconds (NodeBudgetError after; at
        once for more than the budget). A close ends the wait (ClosedError).

        When the bytes are not to be had at once, this stager first gives back what it
        holds and no result uses (``trim_own``: the set's own empty arenas; then every
        other set ``trim`` may release), so that its own idle cache never makes it wait
        (with one process, that wait could only end in the timeout: nothing else would
        release), and the node gets the bytes back before this rank queues."""
        assert self.ledger is not None
        what = f"a {nbytes}-byte host arena of buffer set {index} (pid {os.getpid()})"
        got = self.ledger.try_reserve(nbytes, what)
        if got is not None:
            return got
        released = trim_own() + self.trim()
        if released:
            _log.info("node budget short: released %d bytes of idle staging memory before waiting", released)

        def stop() -> None:
            if self.closed:
                raise ClosedError("the stager was closed while a stage waited for the node budget")

        return self.ledger.reserve(nbytes, timeout=self.wait_timeout, what=what, stop=stop)

    def _describe_held(self) -> str:
        parts = []
        for s in self._sets:
            if s.busy:
                parts.append(f"set {s.index}: being written")
            elif s.leases:
                parts.append(f"set {s.index}: {s.leases} lease(s)")
            else:
                parts.append(
                    f"set {s.index}: a staged result is still reachable (a stage() result, or "
                    "a tensor, view or array taken out of a released lease's copy)"
                )
        return "; ".join(parts)

    def done_writing(self, bufset: BufferSet[P], *, succeeded: bool) -> None:
        """The stage that selected ``bufset`` has enqueued its copies (``succeeded``:
        the set is the most recent, picked first next time) or failed: the set is no
        longer busy."""
        with self.cond:
            bufset.busy = False
            if succeeded:
                self.recent = bufset
            self._events += 1
            self.cond.notify_all()

    def track(self, bufset: BufferSet[P], completions: Sequence[InFlight]) -> None:
        """Copies into ``bufset`` in flight (kept reserved until they are observed)."""
        with self.cond:
            bufset.inflight.extend(completions)

    def settle(self, bufset: BufferSet[P], completions: Sequence[InFlight]) -> None:
        """``completions`` have been observed: no longer in flight in ``bufset``."""
        with self.cond:
            for c in completions:
                try:
                    bufset.inflight.remove(c)
                except ValueError:
                    pass

    def _give_back(self, bufset: BufferSet[P]) -> None:
        """One lease on ``bufset`` ends; called only by ``Lease.release`` (once)."""
        with self.cond:
            if bufset.leases > 0:
                bufset.leases -= 1
            self._events += 1
            self.cond.notify_all()

    def shared_arenas(self) -> list[Arena]:
        """Every open shared-memory arena of every set, read under the lock."""
        with self.cond:
            sets = list(self._sets)
        return [a for s in sets for a in list(s.pool.arenas) if a.shared and a.fd >= 0]

    @property
    def host_bytes(self) -> int:
        """Host memory (bytes) mapped by every set."""
        return sum(s.pool.host_bytes for s in list(self._sets))

    def trim(self) -> int:
        """Return the host memory of every set that holds no result: neither leased,
        busy, nor holding a reachable result (``BufferSet.held``). Such a set drops its
        plans and its whole storage cache, and every arena of it is released (unpinned,
        unmapped); the next stage into it is a first stage again. Returns the bytes
        released. Worker thread, between stages (no stage is selecting a set then).

        Why the whole cache: an entry maps a source storage to its block for as long
        as the source lives, and a model's storages live for the whole run; dropping
        only the entries of dead sources would keep every block, and so every arena,
        allocated (trim would return 0 with nothing held)."""
        # Hazard: waiting for copies in flight while holding ``cond`` would block the
        # event loop's releases (they notify it) for as long as the device takes. The
        # sets are marked busy under the lock (no stage selects them), waited for and
        # trimmed outside it, then handed back.
        with self.cond:
            for s in self._sets:
                if not s.busy:
                    s.note_moves()
            picked = [s for s in self._sets if not (s.busy or s.held())]
            for s in picked:
                s.busy = True
                s.drop_moved()
        released = 0
        try:
            for s in picked:
                s.wait_inflight()
                s.forget_plans()
                s.cache.clear()
                released += s.pool.trim()
                s.watch()
        finally:
            with self.cond:
                for s in picked:
                    s.busy = False
                self.cond.notify_all()
        return released

    def mark_closed(self) -> None:
        """From now on no stage selects a set: a waiting one raises ClosedError."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def close(self) -> list[BaseException]:
        """Mark closed (waiting stages raise ClosedError), wait for copies in flight and
        release every set's arenas; returns the errors met (every set is released)."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
            sets, self._sets = self._sets, []
            self.recent = None
        errors: list[BaseException] = []
        for s in sets:
            try:
                s.close()
            except Exception as e:  # noqa: BLE001 - keep releasing the rest
                errors.append(e)
        if self._owns_ledger and self.ledger is not None:
            # After the arenas: their reservations were given back as they were
            # unmapped; what a staged tensor a user still holds views stops counting.
            try:
                self.ledger.close()
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        return errors
