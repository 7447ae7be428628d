"""The node ledger: one host-memory budget (bytes) shared by the processes of a machine.

Every rank of a job on one node opens the same ledger and reserves host bytes from it
before it maps or pins them (``NodeLedger.reserve``), and gives them back when it
unmaps them (``Reservation.release``). No server and no extra process: the ledger is a
directory of small files on node-local storage, and every update is made under a
``flock`` that the kernel drops when its holder dies.

Where: ``path`` when given; else ``/dev/shm`` (the temp dir where there is none), in a
directory named from the job's identity: an explicit ``job=`` string first, then
``TORCHELASTIC_RUN_ID`` (torchrun's rendezvous id, the same on every node of the job;
``none``, what its static rendezvous gives every job, is no id), then ``MASTER_ADDR:MASTER_PORT``; with none of these, opening is an error (a guessed
name would silently give each process its own budget). The user id is in the name too,
so two users' jobs never meet.

Format (``FORMAT``), all under that directory:

- ``lock``: empty; ``flock(LOCK_EX)`` on it is the node mutex. Every read and write of
  the ledger is made while holding it (after checking that the path still names the
  inode locked: the last process out removes the directory).
- ``budget``: ``{"format": 2, "budget_bytes": N}``, written once (a temporary file
  renamed over it: whole or absent). Opening with another budget is an error; every
  slot records its budget too, so a budget file lost while bytes are held changes
  nothing (the slots decide, and the file is rewritten).
- ``slot-<pid>-<start>-<n>``: one per open ledger: a 260-byte record (``Record``)
  holding its own reserved bytes, its ticket (order, bytes, what for), its budget and a
  CRC. Its owner holds ``flock(LOCK_EX)`` on it for as long as the ledger is open.
- ``peak``: the most bytes the ledger ever granted at once (a record with a CRC).

Crash rules. The state is rebuilt from the slot files at every update; no file holds a
total that a death could leave wrong. A slot whose lock can be taken belongs to a dead
process (the kernel drops a dead process's locks at once); so does one whose pid no
longer runs with the start time recorded (``/proc/<pid>/stat``: a forked child may keep
the lock of a dead parent alive). Either way the next update removes it: its bytes and
its ticket are reclaimed within one poll (milliseconds), never leaked. A process killed
in the middle of writing its own slot leaves a record that fails its CRC, but it is dead
and its slot is ignored anyway; a live process's slot is written only by itself, whole,
under the node lock, so readers never see it torn: a live slot that cannot be read was
damaged from outside, and counts as holding every byte the others leave (never
forgotten) until its owner, which checks its own slot at every update, rewrites it. A
new slot is written and locked
under a temporary name and then renamed: it is never seen unlocked. The sum of the slots
is checked against the budget before a slot grows, under the node lock: the ledger never
shows more than the budget, under any interleaving.

Admission is FIFO: a request that does not fit (or that finds others waiting) takes a
ticket, one above every live ticket; bytes are granted only to the oldest ticket, when
it fits. So a small request never overtakes a big one (the big one is not starved), and
every ticket is served once the bytes ahead of it are released (the small one is not
starved). A waiter that itself holds bytes others wait for can hold the queue until its
bound: every wait is bounded, and its NodeBudgetError says who holds what. A request
bigger than the whole budget is refused at once. Waiters poll (0.5 ms up to 20 ms):
nothing lets a process wake another without a server.

With one process the ledger is a plain per-process budget: the same checks, no waits
but its own.

Thread-safety: a NodeLedger may be used from any thread; one thread of it waits at a
time (the others wait for their turn behind it, in the same bound). Never call
``reserve`` from an event loop thread: it blocks (callers run it in a worker thread).
A release that comes while this thread holds the node lock (an arena finalizer run by a
garbage collection) is deferred and applied before the lock is dropped.

Errors of the ledger's files (a full disk above all) are HostAllocationErrors naming
the directory and the budget, the OSError chained.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from async_stager._core.memory.ledger_files import (
    FORMAT,
    Record,
    check_budget,
    default_path,
    defer_until_released,
    holds_node_lock,
    job_identity,
    ledger_io,
    node_section,
    read_peak,
    scan,
    start_time,
    write_peak,
)
from async_stager.errors import ClosedError, InvalidOptionError, NodeBudgetError

__all__ = ["FORMAT", "LedgerUsage", "NodeLedger", "Reservation", "Ticket", "default_path", "job_identity"]

#: Poll interval of a waiter (seconds): from _POLL_MIN, doubling, up to _POLL_MAX.
_POLL_MIN = 0.0005
_POLL_MAX = 0.02

_instances = itertools.count(1)


#: A slot record's fields with no ticket (``NodeLedger._store``).
_NO_TICKET: dict[str, Any] = {"ticket": 0, "ticket_bytes": 0, "since": 0.0, "what": ""}

_log = logging.getLogger("async_stager")

#: Seconds a reservation waits before it logs a warning (or half its bound, if less).
WARN_AFTER = 5.0


@dataclass(frozen=True)
class Ticket:
    """A waiter: ``pid`` waits for ``nbytes`` bytes (``what`` for) since ``waited`` seconds;
    ``order`` is its place (lowest first)."""

    pid: int
    nbytes: int
    what: str
    waited: float
    order: int


@dataclass(frozen=True)
class LedgerUsage:
    """The ledger as of one read (bytes): ``budget``, ``reserved`` (granted now, every
    live process), ``by_pid`` (pid -> bytes it holds, pids holding nothing left out),
    ``waiting`` (tickets, oldest first), ``peak`` (the most granted at once, ever) and
    ``damaged`` (pids of live processes whose slot could not be read: each is counted
    as holding every byte the readable slots leave, until its owner rewrites it)."""

    budget: int
    reserved: int
    by_pid: Mapping[int, int] = field(default_factory=dict)
    waiting: tuple[Ticket, ...] = ()
    peak: int = 0
    damaged: tuple[int, ...] = ()

    @property
    def free(self) -> int:
        return max(0, self.budget - self.reserved)


class Reservation:
    """``nbytes`` bytes of a node budget, held until ``release()`` (idempotent, any
    thread; also at the end of a ``with`` block). Whoever maps the memory owns it and
    releases it when the memory is unmapped."""

    def __init__(self, ledger: NodeLedger, nbytes: int, what: str) -> None:
        self._ledger: NodeLedger | None = ledger
        self.nbytes = nbytes
        self.what = what

    @property
    def released(self) -> bool:
        return self._ledger is None

    def release(self) -> None:
        ledger, self._ledger = self._ledger, None
        if ledger is not None:
            ledger._give_back(self.nbytes)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"Reservation({self.nbytes} bytes for {self.what!r}, {state})"


class NodeLedger:
    """One process's handle on a node ledger (see the module doc); ``open`` makes it."""

    def __init__(self, path: str, budget_bytes: int, *, _fd: int, _slot: str, _record: Record) -> None:
        self.path = path
        self.budget = budget_bytes
        self._slot_fd = _fd
        self._slot = _slot
        self._rec = _record
        self._pid = os.getpid()
        self._key = os.path.realpath(path)  # the ledger's identity in this process
        # Guards _rec and the node lock within this process. Re-entrant because a GC run
        # may call an arena's finalizer (Reservation.release) in a thread that holds it.
        self._mutex = threading.RLock()
        # Bytes released while this thread held this ledger's node lock (through any
        # handle): a second flock of this process on the lock file would wait for itself,
        # so such a release waits here until the section ends (see _give_back).
        self._deferred: deque[int] = deque()
        self._turn = threading.Lock()  # one waiting thread at a time (see the module doc)
        self._closed = False
        #: Seconds this handle's reservations waited in all, and how many had to wait
        #: (for stats: what the node budget cost this process).
        self.wait_seconds = 0.0
        self.waits = 0

    # -- opening -----------------------------------------------------------------------

    @classmethod
    def open(
        cls, budget_bytes: int, *, path: str | os.PathLike[str] | None = None, job: str | None = None
    ) -> NodeLedger:
        """Open (creating it if needed) the ledger of this job on this node with a
        budget of ``budget_bytes`` bytes: at ``path`` (a directory), else the
        ``default_path`` of the job (``job_identity(job)``). Raises InvalidOptionError
        for a budget below 1, for no job identity, or for a ledger that holds another
        budget (every rank must give the same one)."""
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 1:
            raise InvalidOptionError(f"node_budget_bytes must be an integer >= 1, got {budget_bytes!r}")
        if isinstance(path, os.PathLike):
            path = os.fspath(path)
        if path is None:
            ident = job_identity(job)
            if ident is None:
                raise InvalidOptionError(
                    "node_budget_bytes needs the job's identity to find the ledger the ranks of this "
                    "node share: none of TORCHELASTIC_RUN_ID, MASTER_ADDR/MASTER_PORT is set; pass "
                    "node_budget_job='<a name every rank of the job gives>' or node_budget_path='<dir>'"
                )
            path = default_path(ident)
        with ledger_io(path, budget_bytes, "be opened"):
            return cls._open(path, budget_bytes)

    @classmethod
    def _open(cls, path: str, budget_bytes: int) -> NodeLedger:
        os.makedirs(path, mode=0o700, exist_ok=True)
        pid = os.getpid()
        rec = Record(pid=pid, start=start_time(pid), budget=budget_bytes)
        slot = os.path.join(path, f"slot-{pid}-{rec.start}-{next(_instances)}")
        with node_section(path, os.path.realpath(path)):
            # No live slot: whatever the directory holds is a finished job's (the same
            # identity run again): its budget and peak go.
            check_budget(path, budget_bytes, scan(path, ""))
            # Written and locked under a temporary name, then renamed: a scan never sees
            # the slot unlocked (it would take it for a dead process's).
            tmp = slot + ".new"
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.pwrite(fd, rec.pack(), 0)
                os.rename(tmp, slot)
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        return cls(path, budget_bytes, _fd=fd, _slot=slot, _record=rec)

    # -- reserving ---------------------------------------------------------------------

    def try_reserve(self, nbytes: int, what: str = "host memory") -> Reservation | None:
        """``nbytes`` bytes now if they fit and nobody waits ahead; else None (no
        ticket is left behind). NodeBudgetError if ``nbytes`` exceeds the budget."""
        self._check_request(nbytes, what)
        if not self._turn.acquire(blocking=False):
            return None  # a thread of this process waits ahead
        try:
            with self._locked() as others:
                if self._grant(nbytes, others):
                    return Reservation(self, nbytes, what)
            return None
        finally:
            self._turn.release()

    def reserve(
        self,
        nbytes: int,
        *,
        timeout: float | None,
        what: str = "host memory",
        stop: Callable[[], None] | None = None,
    ) -> Reservation:
        """``nbytes`` bytes of the budget, waiting in ticket order (FIFO across the node)
        at most ``timeout`` seconds (None: no bound). Blocking: call it from a worker
        thread, never from an event loop. ``stop`` is called every poll round and may
        raise to end the wait (the ticket is withdrawn, the error propagates).

        Raises NodeBudgetError at once for ``nbytes`` above the whole budget, and after
        ``timeout`` seconds naming ``what``, the bytes each pid holds and the waiters."""
        self._check_request(nbytes, what)
        t0 = time.monotonic()
        deadline = None if timeout is None else t0 + timeout
        if not self._turn.acquire(timeout=-1 if deadline is None else max(0.0, timeout or 0.0)):
            raise self._timeout(nbytes, what, time.monotonic() - t0, self.usage())
        warn_at = t0 + (WARN_AFTER if timeout is None else min(WARN_AFTER, timeout / 2))
        waited = False
        try:
            delay = _POLL_MIN
            try:
                while True:
                    with self._locked() as others:
                        if self._closed:
                            raise ClosedError(f"the node ledger at {self.path} was closed during the wait")
                        if self._grant(nbytes, others):
                            if waited:
                                self.waits += 1
                                self.wait_seconds += time.monotonic() - t0
                            return Reservation(self, nbytes, what)
                        waited = True
                        if not self._rec.ticket:
                            self._store(
                                ticket=1 + max((r.ticket for r in others.values()), default=0),
                                ticket_bytes=nbytes,
                                since=time.time(),
                                what=what,
                            )
                    if stop is not None:
                        stop()
                    now = time.monotonic()
                    if deadline is not None and now >= deadline:
                        self.waits += 1
                        self.wait_seconds += now - t0
                        raise self._timeout(nbytes, what, now - t0, self.usage())
                    if now >= warn_at:
                        warn_at = float("inf")
                        u = self.usage()
                        _log.warning(
                            "%s has waited %.1f s for %d bytes of the node budget: %d of %d are held (%s), "
                            "%d waiter(s); it goes on when ranks ahead release theirs",
                            what,
                            now - t0,
                            nbytes,
                            u.reserved,
                            self.budget,
                            ", ".join(f"pid {p}: {n}" for p, n in sorted(u.by_pid.items())) or "nobody",
                            len(u.waiting),
                        )
                    time.sleep(delay if deadline is None else min(delay, max(0.0, deadline - now)))
                    delay = min(delay * 2, _POLL_MAX)
            finally:
                if self._rec.ticket and not self._closed:
                    with self._locked():
                        self._store(**_NO_TICKET)
        finally:
            self._turn.release()

    def usage(self) -> LedgerUsage:
        """The ledger now (reclaiming dead processes' slots on the way)."""
        with self._locked() as others:
            recs = [self._rec, *others.values()] if not self._closed else list(others.values())
            by_pid: dict[int, int] = {}
            for r in recs:
                if r.reserved:
                    by_pid[r.pid] = by_pid.get(r.pid, 0) + r.reserved
            damaged = tuple(sorted({r.pid for r in recs if r.damaged}))
            if damaged:
                # Their bytes are unknown: they hold all the rest, as far as anyone can tell.
                rest = max(0, self.budget - sum(by_pid.values()))
                for pid in damaged:
                    by_pid[pid] = by_pid.get(pid, 0) + rest
                    rest = 0
            now = time.time()
            waiting = sorted(
                (
                    Ticket(r.pid, r.ticket_bytes, r.what, max(0.0, now - r.since), r.ticket)
                    for r in recs
                    if r.ticket
                ),
                key=lambda t: t.order,
            )
            return LedgerUsage(
                self.budget, sum(by_pid.values()), by_pid, tuple(waiting), read_peak(self.path), damaged
            )

    def close(self) -> None:
        """Give back everything this process holds of the ledger and drop its slot;
        idempotent. The last process out removes the ledger's directory. Reservations
        still held become no-ops."""
        with self._mutex:
            if self._closed:
                return
            self._closed = True
            self._deferred.clear()  # the slot goes with everything it holds
            if os.getpid() != self._pid:  # a forked child: the slot is the parent's
                os.close(self._slot_fd)
                return
            try:
                with (
                    ledger_io(self.path, self.budget, "drop this process's slot"),
                    node_section(self.path, self._key, remove_if_last=self._slot),
                    contextlib.suppress(FileNotFoundError),
                ):
                    os.unlink(self._slot)
            finally:
                os.close(self._slot_fd)

    def __enter__(self) -> NodeLedger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"NodeLedger({self.path!r}, budget={self.budget}, held={self._rec.reserved})"

    # -- internals ---------------------------------------------------------------------

    @property
    def held(self) -> int:
        """Bytes this handle holds now."""
        return self._rec.reserved

    def _check_request(self, nbytes: int, what: str) -> None:
        if self._closed:
            raise ClosedError(f"the node ledger at {self.path} is closed")
        if os.getpid() != self._pid:
            raise InvalidOptionError("a node ledger cannot be used in a forked child; open one there")
        if nbytes < 0:
            raise InvalidOptionError(f"cannot reserve {nbytes} bytes")
        if nbytes > self.budget:
            raise NodeBudgetError(
                f"{what} needs {nbytes} bytes, more than the whole node budget "
                f"(node_budget_bytes={self.budget}): it can never be granted",
                need=nbytes,
                limit=self.budget,
                fix="raise node_budget_bytes (every rank the same), or stage less at once",
                what=what,
            )

    def _grant(self, nbytes: int, others: dict[str, Record]) -> bool:
        """Under the node lock: give ``nbytes`` to this handle if they fit and no older
        ticket waits (FIFO); record the peak. Clears this handle's ticket on success."""
        mine = self._rec.ticket
        if any(
            r.ticket and (not mine or (r.ticket, name) < (mine, self._slot)) for name, r in others.items()
        ):
            return False
        if any(r.damaged for r in others.values()):
            return False  # a live process's bytes are unknown: it may hold all the rest
        total = self._rec.reserved + sum(r.reserved for r in others.values())
        if total + nbytes > self.budget:
            return False
        self._store(reserved=self._rec.reserved + nbytes, **_NO_TICKET)
        if total + nbytes > read_peak(self.path):
            try:
                write_peak(self.path, total + nbytes)
            except OSError as e:
                # The grant is recorded (the slot); the peak is a statistic: a full disk
                # leaves it behind rather than failing what was granted.
                _log.warning("the node ledger's peak at %s was not updated: %s", self.path, e)
        return True

    def _give_back(self, nbytes: int) -> None:
        """A reservation ends (``Reservation.release``). Called while this thread holds
        this ledger's node lock (an arena finalizer in a GC run, inside a section of
        this handle or of another handle on the same ledger), it is deferred: applied
        when that section ends. Nothing here may wait for a lock then: another thread
        holding this handle's mutex may itself wait for the node lock this thread holds."""
        if self._closed or os.getpid() != self._pid:
            return
        self._deferred.append(nbytes)  # atomic: a finalizer may run between any two steps
        if holds_node_lock(self._key):
            defer_until_released(self._key, self)
            return
        self.flush_deferred()

    def flush_deferred(self) -> None:
        """Apply the releases deferred so far (a section of its own); called when a
        section of this ledger ends in the thread that deferred them."""
        with self._mutex:
            if self._deferred and not self._closed:
                with self._locked():
                    pass  # the section applies what was deferred

    def _apply_deferred(self) -> None:
        """Under the node lock: apply the releases deferred so far to this slot."""
        freed = 0
        while True:
            try:
                freed += self._deferred.popleft()
            except IndexError:
                break
        if freed and not self._closed:
            try:
                self._store(reserved=max(0, self._rec.reserved - freed))
            except BaseException:
                self._deferred.append(freed)  # still held on disk: the next update retries
                raise

    def _store(self, **changes: Any) -> None:
        """Under the node lock: this slot's record with ``changes``, written to its file
        first and kept only once written (a failed write, a full disk, leaves both as
        they were). One pwrite of the whole record: readers never see it torn (a death
        in the middle leaves a slot that is reclaimed, whatever it holds)."""
        if self._closed:
            return
        rec = dataclasses.replace(self._rec, **changes)
        data = rec.pack()
        if os.pwrite(self._slot_fd, data, 0) != len(data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._slot)  # a short write: no room
        self._rec = rec

    def _timeout(self, nbytes: int, what: str, waited: float, usage: LedgerUsage) -> NodeBudgetError:
        holders = ", ".join(f"pid {p}: {n}" for p, n in sorted(usage.by_pid.items())) or "nobody"
        ahead = [t for t in usage.waiting if t.pid != self._pid]
        queue = "; ".join(f"pid {t.pid} waits for {t.nbytes} ({t.what})" for t in ahead[:8]) or "none"
        damaged = ""
        if usage.damaged:
            damaged = (
                f" The slot of live pid(s) {', '.join(map(str, usage.damaged))} in {self.path} was "
                "damaged by something other than its owner (truncated or changed): its bytes are "
                "unknown, so it counts as holding the rest of the budget until that process next "
                "updates the ledger (which rewrites it)."
            )
        return NodeBudgetError(
            f"{what} waited {waited:.1f} s for {nbytes} bytes of the node budget and did not get "
            f"them: {usage.reserved} of {self.budget} bytes are held ({holders}); other waiters: "
            f"{queue}.{damaged} Ranks that keep staging memory between checkpoints hold it: trim() "
            "or close idle stagers, raise node_budget_bytes or buffer_wait_timeout, or stage less "
            "at once",
            need=nbytes,
            limit=max(0, self.budget - usage.reserved),
            fix="raise node_budget_bytes or the wait's timeout, or trim() idle stagers",
            what=what,
            waited=waited,
            holders=dict(usage.by_pid),
        )

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, Record]]:
        """The node lock (and this process's mutex), yielding every other live slot by
        file name; dead ones are removed on the way. This handle's own slot is checked
        first and rewritten if something else damaged or removed it. Releases deferred
        while the lock was held (see ``_give_back``) are applied before it is dropped,
        and any that come while it is being dropped, in another round."""
        with self._mutex, ledger_io(self.path, self.budget, "be updated"):
            # Never re-entered by this thread's finalizers (they defer): a nested section
            # would take the flock twice and wait for itself.
            assert not holds_node_lock(self._key), "the node ledger's lock section was re-entered"
            with node_section(self.path, self._key):
                self._heal()
                try:
                    yield scan(self.path, self._slot)
                finally:
                    self._apply_deferred()
            # A GC run while the node lock was dropped may have deferred more.
            while self._deferred and not self._closed:
                with node_section(self.path, self._key):
                    self._apply_deferred()

    def _heal(self) -> None:
        """Under the node lock: this handle's slot holds its record. Only its owner writes
        a slot, so anything else there (truncated, a byte changed, the file removed or
        replaced) is damage from outside: rewrite it, and say so."""
        if self._closed:
            return
        try:
            same = os.stat(self._slot).st_ino == os.fstat(self._slot_fd).st_ino
        except FileNotFoundError:
            same = False
        want = self._rec.pack()
        if same:
            if os.pread(self._slot_fd, len(want) + 1, 0) == want:
                return
            _log.warning("the node ledger slot %s was damaged by something else: rewritten", self._slot)
            os.ftruncate(self._slot_fd, 0)
            os.pwrite(self._slot_fd, want, 0)
            return
        # Removed (or replaced): a new file, locked, renamed into place (never seen unlocked).
        _log.warning("the node ledger slot %s was removed by something else: made again", self._slot)
        tmp = self._slot + ".new"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.pwrite(fd, want, 0)
            os.rename(tmp, self._slot)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        old, self._slot_fd = self._slot_fd, fd
        os.close(old)
