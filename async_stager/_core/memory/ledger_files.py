"""The node ledger's files (see ``ledger`` for the design): the slot record, the node
mutex, the scan that reclaims dead processes' slots, the budget and peak files, and how
a job finds its ledger directory. Every function here but ``job_identity``,
``default_path``, ``start_time`` and ``slot_owner`` runs under the node mutex
(``node_lock``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import struct
import tempfile
import threading
import weakref
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from async_stager.errors import HostAllocationError, InvalidOptionError

__all__ = [
    "FORMAT",
    "Record",
    "check_budget",
    "default_path",
    "defer_until_released",
    "holds_node_lock",
    "job_identity",
    "ledger_io",
    "node_lock",
    "node_section",
    "read_peak",
    "scan",
    "slot_owner",
    "start_time",
    "write_peak",
]

#: Version of the on-disk layout (the ``budget`` file's ``format``). 2: every slot
#: records the budget its owner opened with (the budget file is no longer the only copy).
FORMAT = 2

_MAGIC = b"ASLEDG02"
# magic, pid, start time (clock ticks since boot), budget (bytes, as opened), reserved
# bytes, ticket (0: none), ticket bytes, ticket since (time.time()), what (utf-8, padded).
_BODY = struct.Struct("<8sqqqqqqd192s")
_RECORD = _BODY.size + 4  # + CRC32 of the body
_PEAK = struct.Struct("<8sq")

#: Values of TORCHELASTIC_RUN_ID that name no job: ``torchrun --master-port P`` (static
#: rendezvous) sets "none" for every job, so it would put unrelated jobs in one ledger.
_NO_RUN_ID = frozenset({"", "none"})


def job_identity(job: str | None = None) -> str | None:
    """The job's identity on this node: ``job`` if given, else ``TORCHELASTIC_RUN_ID``
    (unless it is ``none``: torchrun's static rendezvous gives every job that id), else
    ``MASTER_ADDR:MASTER_PORT``; None when there is none of these."""
    if job:
        return job
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id.strip().lower() not in _NO_RUN_ID:
        return f"torchelastic-{run_id}"
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port:
        return f"master-{addr}:{port}"
    return None


def default_path(job: str) -> str:
    """The ledger directory of ``job`` on this node: under ``/dev/shm`` where it
    exists (node-local memory; gone at reboot), else the temp dir."""
    root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", job)[:40]
    digest = hashlib.sha256(job.encode()).hexdigest()[:16]
    return os.path.join(root, f"async_stager-ledger-{os.getuid()}-{safe}-{digest}")


def start_time(pid: int) -> int:
    """The start time of ``pid`` (clock ticks since boot, ``/proc/<pid>/stat`` field
    22); -1 when it does not run (or where there is no /proc: 0, not checked)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return -1
    except OSError:
        return 0
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return 0


#: errnos that mean the filesystem holding the ledger has no room left.
_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


@contextlib.contextmanager
def ledger_io(path: str, budget: int, doing: str) -> Iterator[None]:
    """Turn an OSError of the ledger's files into a HostAllocationError that names the
    ledger's directory and the node budget, and says the disk is full when it is (the
    OSError is its cause): a bare ``OSError: [Errno 28]`` says neither where nor why."""
    try:
        yield
    except OSError as e:
        if e.errno in _FULL:
            why = (
                "the disk is full (no space left on the device that holds it: /dev/shm or the "
                "temp dir by default); free space there, or give node_budget_path= a directory "
                "on node-local storage with room"
            )
        else:
            why = f"{e.strerror or e} (errno {e.errno}); check that the directory is writable"
        where = f" ({e.filename})" if e.filename else ""
        raise HostAllocationError(
            f"the node ledger at {path} (node_budget_bytes={budget}) could not {doing}{where}: {why}"
        ) from e


def slot_owner(name: str) -> tuple[int, int] | None:
    """The pid and start time a slot's file name (``slot-<pid>-<start>-<n>``) records,
    None for a name not made that way."""
    parts = name.split("-")
    if len(parts) != 4 or parts[0] != "slot":
        return None
    try:
        return int(parts[1]), int(parts[2])
    except ValueError:
        return None


@dataclass
class Record:
    """One slot: the bytes an open ledger holds (``reserved``), its ticket (``ticket``
    its place, 0: none; ``ticket_bytes`` wanted; ``since``, ``time.time()``; ``what``
    for), the budget it was opened with (``budget``) and its process (``pid``,
    ``start``: its start time, to tell pid reuse). ``pack`` gives the 260 bytes written
    whole; ``unpack`` None for a torn record. ``damaged`` (never written): the slot of a
    live process whose record cannot be read (``scan``)."""

    pid: int
    start: int
    reserved: int = 0
    ticket: int = 0
    ticket_bytes: int = 0
    since: float = 0.0
    what: str = ""
    budget: int = 0
    damaged: bool = False

    def pack(self) -> bytes:
        body = _BODY.pack(
            _MAGIC,
            self.pid,
            self.start,
            self.budget,
            self.reserved,
            self.ticket,
            self.ticket_bytes,
            self.since,
            self.what.encode()[:192],
        )
        return body + struct.pack("<I", zlib.crc32(body))

    @classmethod
    def unpack(cls, data: bytes) -> Record | None:
        if len(data) != _RECORD:
            return None
        body, (crc,) = data[: _BODY.size], struct.unpack("<I", data[_BODY.size :])
        if zlib.crc32(body) != crc:
            return None
        magic, pid, start, budget, reserved, ticket, tbytes, since, what = _BODY.unpack(body)
        if magic != _MAGIC:
            return None
        text = what.rstrip(b"\0").decode(errors="replace")
        return cls(pid, start, reserved, ticket, tbytes, since, text, budget)


@contextlib.contextmanager
def node_lock(path: str, *, remove_if_last: str | None = None) -> Iterator[None]:
    """``flock(LOCK_EX)`` on ``path/lock``, re-opened until the file locked is the one
    the path names (the last process out unlinks it). ``remove_if_last``: this slot is
    leaving; when no other slot remains, remove the ledger's files and directory."""
    lock = os.path.join(path, "lock")
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.stat(lock).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
        except BaseException:
            os.close(fd)
            raise
        if same:
            break
        os.close(fd)
        os.makedirs(path, mode=0o700, exist_ok=True)
    try:
        yield
        if remove_if_last is not None and not scan(path, remove_if_last):
            for name in os.listdir(path):
                if name != "lock":
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(path, name))
            os.unlink(lock)
            with contextlib.suppress(OSError):
                os.rmdir(path)
    finally:
        os.close(fd)  # drops the flock


#: Per thread: the ledgers (by real path) whose node lock this thread holds or is taking,
#: with how many sections deep (``node_section``).
_tls = threading.local()
#: Ledger handles whose releases were deferred because their thread held their ledger's
#: node lock (``NodeLedger._give_back``), by ledger; ``flush_deferred()`` is called on
#: each when a section of it ends. Re-entrant: a finalizer may register while this
#: thread holds it.
_waiting_lock = threading.RLock()
_waiting: dict[str, weakref.WeakSet[Any]] = {}


def _held() -> dict[str, int]:
    held: dict[str, int] | None = getattr(_tls, "held", None)
    if held is None:
        held = _tls.held = {}
    return held


def holds_node_lock(key: str) -> bool:
    """This thread holds (or is taking) the node lock of the ledger ``key`` (its real
    path)."""
    return key in _held()


def defer_until_released(key: str, handle: Any) -> None:
    """Call ``handle.flush_deferred()`` when this thread's section of ``key`` ends."""
    with _waiting_lock:
        _waiting.setdefault(key, weakref.WeakSet()).add(handle)


@contextlib.contextmanager
def node_section(path: str, key: str, *, remove_if_last: str | None = None) -> Iterator[None]:
    """``node_lock(path)``, with this thread marked as holding it (``key``: the ledger's
    real path) from before the flock is taken until after it is dropped: a finalizer run
    by a garbage collection in this thread at any point in between defers its release
    (a second flock of this process would wait for itself). When the outermost section
    ends normally, the releases deferred meanwhile (of any handle) are applied."""
    held = _held()
    held[key] = held.get(key, 0) + 1
    try:
        with node_lock(path, remove_if_last=remove_if_last):
            yield
    finally:
        held[key] -= 1
        if not held[key]:
            del held[key]
    if key not in held:
        with _waiting_lock:
            handles = list(_waiting.pop(key, ()))
        for h in handles:
            h.flush_deferred()


def scan(path: str, own: str) -> dict[str, Record]:
    """Under the node lock: every live slot but ``own``, by file name. A slot whose lock
    can be taken, or whose pid no longer runs with the start time recorded, is a dead
    process's: removed (its bytes and ticket are reclaimed).

    A live slot (its lock held, its owner running with the start time its file name
    records) whose record cannot be read (truncated, a byte changed: something other
    than its owner wrote it) is kept and returned as a ``damaged`` Record: its bytes
    are unknown, so the ledger counts it as holding every byte nobody else holds, until
    its owner rewrites it (at its next update). Forgetting it would let the others take
    bytes it still holds."""
    out: dict[str, Record] = {}
    own_name = os.path.basename(own)
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if name.endswith(".new"):
            # Made and renamed under the node lock we hold: an opener (or a budget
            # writer) that died half-way left it.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(full)
            continue
        if not name.startswith("slot-") or name == own_name:
            continue
        try:
            fd = os.open(full, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            rec = Record.unpack(os.pread(fd, _RECORD, 0))
            dead = False
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                dead = True  # nobody holds it: its owner is gone
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
            owner = slot_owner(name)
            if not dead:
                # A held lock may be a forked child's, or the pid reused: the slot's name
                # (which no write changes) and its record say which process made it.
                made_by = [owner] if owner is not None else []
                if rec is not None:
                    made_by.append((rec.pid, rec.start))
                dead = any(start > 0 and start_time(pid) != start for pid, start in made_by)
            if dead:
                # A dead process's slot (a death mid-write leaves it torn: it is gone
                # all the same): its bytes and ticket are reclaimed.
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(full)
                continue
            if rec is None:
                pid, start = owner if owner is not None else (0, 0)
                rec = Record(pid=pid, start=start, damaged=True)
            out[name] = rec
        finally:
            os.close(fd)
    return out


def check_budget(path: str, budget: int, slots: dict[str, Record]) -> None:
    """Under the node lock: the ledger's budget is ``budget``; another is an
    InvalidOptionError. ``slots``: the live slots (``scan``); none means the ledger is
    fresh (a finished job's files): its budget and peak are written anew.

    Every live slot records the budget its owner opened with, so a budget file that was
    removed or damaged while bytes are held does not let in a process with another
    budget: the slots decide, and the file is rewritten from them. A ledger whose live
    slots are all unreadable and whose budget file is gone cannot be checked: refused."""
    file = os.path.join(path, "budget")
    if not slots:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(path, "peak"))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(file)
    try:
        with open(file) as f:
            held = json.load(f)
        if not (isinstance(held, dict) and isinstance(held.get("format"), int)):
            held = None  # not what any version writes: damaged
        elif held["format"] == FORMAT and not isinstance(held.get("budget_bytes"), int):
            held = None
    except FileNotFoundError:
        held = None
    except (OSError, ValueError):
        held = None  # never left torn by us (renamed into place): damaged, the slots decide
    if held is not None and held.get("format") != FORMAT:
        raise InvalidOptionError(
            f"the node ledger at {path} has format {held.get('format')!r}, this version writes "
            f"{FORMAT}: every rank of a job must run the same async_stager"
        )
    readable = [r for r in slots.values() if not r.damaged]
    if readable:
        known = readable[0].budget
        where = f"pid {readable[0].pid} has it open with {known} bytes"
    elif held is not None:
        known = held.get("budget_bytes")
        where = f"its budget file says {known} bytes"
    elif slots:
        pids = ", ".join(str(r.pid) for r in slots.values())
        raise InvalidOptionError(
            f"the node ledger at {path} is damaged: its budget file is missing or unreadable and "
            f"the slots of the processes that have it open (pid {pids}) cannot be read, so "
            f"node_budget_bytes={budget} cannot be checked against theirs; wait until they "
            "update their slots, or use another node_budget_path/node_budget_job"
        )
    else:
        known = budget
        where = ""
    if known != budget:
        raise InvalidOptionError(
            f"node_budget_bytes={budget} differs from the {known} bytes the node ledger at "
            f"{path} was opened with ({where}): every rank of the node must give the same "
            "budget (or use another node_budget_path/node_budget_job)"
        )
    if held is not None and held.get("budget_bytes") == budget:
        return
    tmp = f"{file}.{os.getpid()}.new"
    data = json.dumps({"format": FORMAT, "budget_bytes": budget}).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        if os.write(fd, data) != len(data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), tmp)  # a short write: no room
    finally:
        os.close(fd)
    os.rename(tmp, file)


def read_peak(path: str) -> int:
    try:
        with open(os.path.join(path, "peak"), "rb") as f:
            data = f.read()
    except OSError:
        return 0
    if len(data) != _PEAK.size + 4 or zlib.crc32(data[: _PEAK.size]) != struct.unpack("<I", data[-4:])[0]:
        return 0
    magic, peak = _PEAK.unpack(data[: _PEAK.size])
    return int(peak) if magic == _MAGIC else 0


def write_peak(path: str, peak: int) -> None:
    body = _PEAK.pack(_MAGIC, peak)
    fd = os.open(os.path.join(path, "peak"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.pwrite(fd, body + struct.pack("<I", zlib.crc32(body)), 0)
    finally:
        os.close(fd)
