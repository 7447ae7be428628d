"""Host-to-host copies on several threads, in pieces the threads claim as they go.

Why not torch's own parallel copy: ``_foreach_copy_`` on the CPU copies tensor after
tensor, each in its own OpenMP region whose threads split that tensor statically and
meet at a barrier. Whenever anything else runs (the event loop waking up, a data
loader), the thread it displaces is late for that barrier and every other copy thread
waits, and many tensors copy markedly slower than one ``copy_`` of the same bytes
while an asyncio loop ticks. Here the stage's worker and ``threads - 1`` helper
threads each copy single-threaded, claiming pieces of about ``PIECE_BYTES`` from one
list until it is empty (see ``CopyJob`` for how many at a time), so a displaced thread
delays only its own piece. docs/benchmarks.md has the numbers (``large1g`` against
the one-buffer bound).

Hazards:
- OpenMP: each thread's team size must be 1, or every piece copy would start its own
  team (threads x threads on the cores). It is set per thread (``_openmp``). Without
  a reachable OpenMP runtime, no helpers are used.
- The GIL: a thread holds it only to claim pieces and enter torch (which releases it
  for the copy); the views are built by the worker before the helpers start.
- Priority: helpers take the priority of the thread that creates them (the worker's
  niceness), as an OpenMP team would. Not SCHED_IDLE: a helper starved while holding
  the GIL would stall the event loop (for seconds, under CPU hogs).
- Ownership: every piece has finished when ``run`` returns, error or not, so no copy
  writes into a host buffer after the engine thinks it is done.
- Interpreter exit: helpers are daemon threads; one still inside torch when the
  interpreter finalizes aborts the process (see ``_interp``). An exit hook (after the
  workers' hook) closes every pool, waiting for a ``run`` in progress, and joins the
  helpers.
- ``os.fork()``: helpers do not exist in a child. A pool's lock (held for a whole
  ``run``) is made anew there and its dead helpers forgotten, so ``close`` (and a
  later ``run``) cannot hang on a parent's thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from async_stager._core import interp as _interp
from async_stager._core.checksum.digest import PIECE_BYTES as DIGEST_PIECE_BYTES, Checksums, HashTask, hasher
from async_stager._core.copy.openmp import helpers_supported, omp_threads, runtime

__all__ = [
    "FUSE_BYTES",
    "MIN_POOL_BYTES",
    "PIECE_BYTES",
    "CopyPool",
    "Schedule",
    "Tasks",
    "hashed_pieces",
    "pieces",
    "schedule",
    "set_thread_priority",
]

#: Bytes per piece: each is one torch copy (a fixed cost small against the copying
#: of this many bytes), and the last ones decide how evenly the threads end. Of the
#: sizes compared side by side (guided claims, a ticking loop), 8 MiB came closest to
#: the bound, smaller pieces lower (see docs/benchmarks.md).
PIECE_BYTES = DIGEST_PIECE_BYTES
#: Copies of fewer bytes than this run on the calling thread alone (a pool hand-off
#: costs tens of microseconds).
MIN_POOL_BYTES = 2 * PIECE_BYTES
#: At most this many tensors per ``_foreach_copy_`` call, here and in the engine's
#: batched copies: torch parses the tensor lists holding the GIL, a cost per tensor
#: (one call for tens of thousands of tensors held it for milliseconds).
GROUP_MAX = 1024
#: Bytes copied then hashed at a time within a cut piece when checksumming: the source
#: and destination parts (twice this) stay within a core's 2 MiB L2, so the hash reads
#: cached bytes. Measured side by side in a stager, transformer workload, one copy
#: thread, medians of 9 interleaved leases (2026-12-03): 2 MiB +74-81% of staging,
#: 1 MiB +66%, 512 KiB +42-50%, 256 KiB +51% (more calls per byte).
FUSE_BYTES = 512 << 10


@dataclass(frozen=True)
class Schedule:
    """How one list of destinations is cut into pieces (made once per plan).

    ``items``: ``(lo, hi, parts)``; ``parts == 0``: destinations ``lo:hi`` copied by one
    ``_foreach_copy_``; otherwise destination ``lo`` (contiguous) cut into ``parts``
    pieces of ``piece`` bytes (the last one the rest). ``nbytes``: the destinations'
    total bytes.
    """

    items: tuple[tuple[int, int, int], ...]
    nbytes: int
    #: Bytes per cut piece.
    piece: int = PIECE_BYTES
    #: Bytes of the destinations cut into pieces (big tensors).
    cut_bytes: int = 0


def schedule(dsts: Sequence[torch.Tensor], piece: int = PIECE_BYTES) -> Schedule:
    """Cut ``dsts`` (host tensors, fixed for a plan) into pieces of about ``piece`` bytes."""
    items: list[tuple[int, int, int]] = []
    lo = 0
    acc = 0
    total = 0
    cut = 0
    for i, d in enumerate(dsts):
        n = d.numel() * d.element_size()
        total += n
        if n >= 2 * piece and d.is_contiguous():
            if lo < i:
                items.append((lo, i, 0))
            items.append((i, i + 1, -(-n // piece)))
            cut += n
            lo, acc = i + 1, 0
            continue
        acc += n
        if acc >= piece or i + 1 - lo >= GROUP_MAX:
            items.append((lo, i + 1, 0))
            lo, acc = i + 1, 0
    if lo < len(dsts):
        items.append((lo, len(dsts), 0))
    return Schedule(tuple(items), total, piece, cut)


Work = list[tuple[list[torch.Tensor], list[torch.Tensor]]]
#: Per piece of a Work, per pair of that piece, what to hash once it has landed (see
#: ``_digest``).
Tasks = list[list[list[HashTask]]]


def pieces(sched: Schedule, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> Work:
    """The concrete pieces of one stage (see ``hashed_pieces``)."""
    return hashed_pieces(sched, dsts, srcs, None)[0]


def hashed_pieces(
    sched: Schedule,
    dsts: Sequence[torch.Tensor],
    srcs: Sequence[torch.Tensor],
    checksums: Checksums | None,
) -> tuple[Work, Tasks | None]:
    """The concrete pieces of one stage: ``(dsts, srcs)`` lists, one copy call each,
    and (with ``checksums``) what each piece's thread hashes as it copies it.

    A destination cut by the schedule is cut the same way in its source only when that
    source is contiguous too (a leaf's layout can differ between stages); else the pair
    is copied whole, as one piece. Cuts fall every ``sched.piece`` bytes (the last
    piece is the rest); at the digest's piece size each cut piece is one hashed piece,
    hashed by the thread that copies it. Destinations given no task here are left to
    ``Checksums.hash_now`` once every piece has landed.
    """
    out: Work = []
    tasks: Tasks | None = None if checksums is None else []
    for lo, hi, parts in sched.items:
        if parts == 0:
            out.append((list(dsts[lo:hi]), list(srcs[lo:hi])))
            if tasks is not None and checksums is not None:
                tasks.append([checksums.tasks(d) for d in dsts[lo:hi]])
            continue
        d, s = dsts[lo], srcs[lo]
        # Same shape, or copy_ must see the pair whole: a pair whose shapes differ
        # (which the plan's fingerprint should already have refused) still reaches
        # copy_'s own shape check instead of being flattened into the wrong layout.
        es = d.element_size()
        if not s.is_contiguous() or s.dtype != d.dtype or s.shape != d.shape or sched.piece % es:
            out.append(([d], [s]))
            if tasks is not None and checksums is not None:
                tasks.append([checksums.tasks(d)])
            continue
        df, sf = d.view(-1), s.view(-1)
        step = sched.piece // es
        aligned = checksums is not None and checksums.piece_bytes == sched.piece
        cut = checksums.tasks(d) if aligned and checksums is not None else []
        for i, a in enumerate(range(0, df.numel(), step)):
            out.append(([df[a : a + step]], [sf[a : a + step]]))
            if tasks is not None:
                tasks.append([cut[i : i + 1]])
    return out, tasks


def _copy(d: list[torch.Tensor], s: list[torch.Tensor]) -> None:
    if len(d) == 1:
        d[0].copy_(s[0])
    elif d:
        torch._foreach_copy_(d, s)  # type: ignore[arg-type]


def _fusable(d: torch.Tensor, s: torch.Tensor) -> bool:
    return d.is_contiguous() and s.is_contiguous() and d.dtype == s.dtype and d.shape == s.shape


def _copy_hashing(d: torch.Tensor, s: torch.Tensor, task: HashTask) -> None:
    """Copy the bytes of ``task`` (a range of contiguous ``d``) from ``s`` in parts of
    ``FUSE_BYTES``, hashing each part as it lands, while it is in this core's cache."""
    h = hasher().xxh3_64()
    es = d.element_size()
    df, sf = d.view(-1), s.view(-1)
    first = (task.ptr - d.data_ptr()) // es
    end = first + task.nbytes // es
    step = max(1, FUSE_BYTES // es)
    for a in range(first, end, step):
        b = min(a + step, end)
        df[a:b].copy_(sf[a:b])
        h.update(
            memoryview((ctypes.c_char * ((b - a) * es)).from_address(task.ptr + (a - first) * es)).cast("B")
        )
    task.out[task.index] = int(h.intdigest())


def _copy_and_hash(dsts: list[torch.Tensor], srcs: list[torch.Tensor], todo: list[list[HashTask]]) -> None:
    """Copy one piece's pairs and hash them as they land: a big pair part by part
    (``_copy_hashing``), small ones in batches of about ``FUSE_BYTES`` (one
    ``_foreach_copy_`` each, then their hashes), so the hash reads bytes this core
    just wrote and small tensors still cost one copy call per batch."""
    bd: list[torch.Tensor] = []
    bs: list[torch.Tensor] = []
    bt: list[HashTask] = []
    acc = 0

    def flush() -> None:
        nonlocal acc
        _copy(bd, bs)
        for task in bt:
            task.run()
        bd.clear()
        bs.clear()
        bt.clear()
        acc = 0

    for d, s, ts in zip(dsts, srcs, todo):
        n = d.numel() * d.element_size()
        if ts and n > FUSE_BYTES and _fusable(d, s):
            flush()
            for task in ts:
                _copy_hashing(d, s, task)
            continue
        bd.append(d)
        bs.append(s)
        bt.extend(ts)
        acc += n
        if acc >= FUSE_BYTES:
            flush()
    flush()


class CopyJob:
    """One ``run``: the pieces, the next unclaimed index, the first error.

    Claims are guided (as OpenMP's ``schedule(guided)``): a thread takes the remaining
    pieces divided by twice the thread count, at least one, and copies them with one
    ``_foreach_copy_`` call. Early claims are big, so few GIL round trips (with one
    claim per piece, small pieces were much slower: the copy threads queue for the
    GIL); the last ones are single pieces, so the threads finish
    together.
    """

    def __init__(self, work: Work, helpers: int, tasks: Tasks | None = None) -> None:
        self.work = work
        #: With checksums: per piece, what its thread hashes right after copying it.
        self.tasks = tasks
        self._pos = 0
        self._div = 2 * (helpers + 1)
        self.stop = False
        self.error: BaseException | None = None
        # Only helpers check out: the calling thread waits for them, whatever happened
        # to it (even if it never got to copy).
        self._left = helpers
        self._lock = threading.Lock()
        self.finished = threading.Event()
        if helpers == 0:
            self.finished.set()

    def _claim(self) -> tuple[int, int]:
        with self._lock:
            lo = self._pos
            hi = min(len(self.work), lo + max(1, (len(self.work) - lo) // self._div))
            self._pos = hi
            return lo, hi

    def drain(self, tick: Callable[[], None] | None = None) -> None:
        """Claim and copy pieces until none is left (or one failed, or ``tick``
        raised: a cancelled stage). Errors are kept for the calling thread."""
        work = self.work
        try:
            # Hazard: grad mode and torch-function overrides are per thread. The
            # engine turns both off on the worker; a helper must too, or copying a
            # source that requires grad records autograd history into the host
            # buffers (or fails on views made in no-grad mode), and a tensor
            # subclass's override would run on the helper.
            with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
                while not self.stop:
                    if tick is not None:
                        tick()
                    lo, hi = self._claim()
                    if lo >= hi:
                        break
                    if self.tasks is not None:
                        self._copy_and_hash(lo, hi)
                        continue
                    if hi == lo + 1:
                        _copy(*work[lo])
                        continue
                    # One call for the claim, but never over GROUP_MAX tensors: torch
                    # parses the lists holding the GIL (ten thousand small tensors
                    # merged into one call stalled the event loop for milliseconds).
                    d: list[torch.Tensor] = []
                    s: list[torch.Tensor] = []
                    for dd, ss in work[lo:hi]:
                        if d and len(d) + len(dd) > GROUP_MAX:
                            _copy(d, s)
                            d, s = [], []
                        d += dd
                        s += ss
                    _copy(d, s)
        except BaseException as e:  # noqa: BLE001 - handed to the calling thread
            self.stop = True
            with self._lock:
                if self.error is None:
                    self.error = e

    def _copy_and_hash(self, lo: int, hi: int) -> None:
        """Copy pieces ``lo:hi`` one at a time, hashing as they land."""
        assert self.tasks is not None
        for p in range(lo, hi):
            d, s = self.work[p]
            _copy_and_hash(d, s, self.tasks[p])

    def check_out(self) -> None:
        """A helper is done with this job."""
        with self._lock:
            self._left -= 1
            if self._left == 0:
                self.finished.set()


def set_thread_priority(nice: int) -> None:
    """Set the calling thread's niceness (Linux: per thread), best effort: without
    ``os.setpriority``, or without the privilege (a negative value), nothing changes."""
    if hasattr(os, "setpriority"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)


def thread_priority() -> int | None:
    """The calling thread's niceness; None where it cannot be read."""
    if hasattr(os, "getpriority"):
        with contextlib.suppress(OSError):
            return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    return None


def _helper(inbox: queue.SimpleQueue[CopyJob | None], priority: int | None) -> None:
    # A module function holding only its inbox: the thread must not keep the pool
    # (and through it the stager) alive.
    try:
        _serve(inbox, priority)
    finally:
        with _registry_lock:
            _live_helpers.discard(threading.current_thread())


def _serve(inbox: queue.SimpleQueue[CopyJob | None], priority: int | None) -> None:
    try:
        if priority is not None:
            set_thread_priority(priority)
        torch.get_num_threads()  # torch's lazy per-thread setup first (see omp_threads)
        omp = runtime()
        if omp is not None:
            omp.set(1)
    except Exception:  # noqa: BLE001 - a helper that copies slower still copies
        pass
    while True:
        job = inbox.get()
        if job is None:
            return
        try:
            job.drain()
        finally:
            job.check_out()
        del job


def _stop_helpers(inboxes: list[queue.SimpleQueue[CopyJob | None]]) -> None:
    for q in inboxes:
        q.put(None)


#: Every pool (weakly: a hook must not keep a stager alive) and every helper thread
#: running in this process.
_pools: weakref.WeakSet[CopyPool] = weakref.WeakSet()
_live_helpers: set[threading.Thread] = set()
_registry_lock = threading.Lock()


def _exit_hook() -> None:
    with _registry_lock:
        pools = list(_pools)
    for pool in pools:
        pool._close(lock_timeout=_interp.EXIT_JOIN_SECONDS, join_timeout=_interp.EXIT_JOIN_SECONDS)
    del pools
    with _registry_lock:
        helpers = list(_live_helpers)
    for t in helpers:
        # Helpers of pools already collected end on their own (the pool's finalizer).
        if t is not threading.current_thread():
            t.join(_interp.EXIT_JOIN_SECONDS)


def _after_fork_in_child() -> None:
    global _registry_lock
    _registry_lock = threading.Lock()
    _live_helpers.clear()
    for pool in list(_pools):
        pool._forget_threads()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class CopyPool:
    """The calling thread plus ``helpers`` helper threads, started on first use.

    Not reentrant: one ``run`` at a time (the engine's worker is the only caller).
    """

    def __init__(self, helpers: int) -> None:
        self.helpers = helpers if helpers_supported() else 0
        self._threads: list[threading.Thread] = []
        self._inboxes: list[queue.SimpleQueue[CopyJob | None]] = []
        self._lock = threading.Lock()
        self._closed = False
        # Helpers end when the pool is closed or collected (a stager dropped unclosed).
        self._finalizer = weakref.finalize(self, _stop_helpers, self._inboxes)
        with _registry_lock:
            _pools.add(self)

    def _forget_threads(self) -> None:
        """In a forked child: the helpers (and whoever held the lock) are gone."""
        self._lock = threading.Lock()
        del self._threads[:]
        del self._inboxes[:]

    def _start(self) -> None:
        prio = thread_priority()
        # A helper that is gone (it never is, short of close) would never check out.
        live = [(t, q) for t, q in zip(self._threads, self._inboxes) if t.is_alive()]
        self._threads[:] = [t for t, _ in live]
        self._inboxes[:] = [q for _, q in live]
        while len(self._threads) < self.helpers:
            q: queue.SimpleQueue[CopyJob | None] = queue.SimpleQueue()
            t = threading.Thread(
                target=_helper,
                args=(q, prio),
                name=f"async-stager-copy-{len(self._threads) + 1}",
                daemon=True,
            )
            _interp.at_exit(_exit_hook, order=1)
            with _registry_lock:
                _live_helpers.add(t)
            try:
                t.start()
            except BaseException:
                with _registry_lock:
                    _live_helpers.discard(t)
                raise
            self._inboxes.append(q)
            self._threads.append(t)

    def run(
        self,
        work: Work,
        tick: Callable[[], None] | None = None,
        tasks: Tasks | None = None,
        helpers: int | None = None,
    ) -> None:
        """Copy every piece of ``work`` (and hash what ``tasks`` says, see
        ``hashed_pieces``); returns, or raises the first copy error (or what ``tick``,
        called by this thread between its pieces, raised), only once no piece is being
        copied any more. ``helpers``: at most this many of the pool's helpers join
        (None: all). Blocks the calling thread."""
        if not work:
            return
        with self._lock:
            limit = self.helpers if helpers is None else min(self.helpers, helpers)
            helpers = 0 if self._closed else min(limit, len(work) - 1)
            if helpers > 0:
                self._start()
            job = CopyJob(work, helpers, tasks)
            for q in self._inboxes[:helpers]:
                q.put(job)
            try:
                with omp_threads(1):
                    job.drain(tick)
            finally:
                # The helpers' pieces must land before this returns, whatever happened.
                job.finished.wait()
            if job.error is not None:
                err, job.error = job.error, None
                raise err

    def close(self) -> None:
        """Stop the helper threads (idempotent)."""
        self._close(lock_timeout=None, join_timeout=5.0)

    def _close(self, *, lock_timeout: float | None, join_timeout: float) -> None:
        # The lock is held for a whole run: closing waits for one in progress.
        if not self._lock.acquire(timeout=-1 if lock_timeout is None else lock_timeout):
            return
        try:
            self._closed = True
            self._finalizer()
            threads, self._threads = self._threads, []
        finally:
            self._lock.release()
        for t in threads:
            if t is not threading.current_thread():
                t.join(timeout=join_timeout)
