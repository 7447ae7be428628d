"""The node ledger's files (see ``ledger`` for the design): the slot record, the node
mutex, the scan that reclaims dead processes' slots, the budget and peak files, and how
a job finds its ledger directory. Every function here but ``job_identity``,
``default_path`` and ``start_time`` runs under the node mutex (``node_lock``).
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
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

from async_stager.errors import InvalidOptionError

__all__ = [
    "FORMAT",
    "Record",
    "check_budget",
    "default_path",
    "job_identity",
    "node_lock",
    "read_peak",
    "scan",
    "start_time",
    "write_peak",
]

#: Version of the on-disk layout (the ``budget`` file's ``format``).
FORMAT = 1

_MAGIC = b"ASLEDG01"
# magic, pid, start time (clock ticks since boot), reserved bytes, ticket (0: none),
# ticket bytes, ticket since (time.time()), what (utf-8, padded).
_BODY = struct.Struct("<8sqqqqqd200s")
_RECORD = _BODY.size + 4  # + CRC32 of the body
_PEAK = struct.Struct("<8sq")


def job_identity(job: str | None = None) -> str | None:
    """The job's identity on this node: ``job`` if given, else ``TORCHELASTIC_RUN_ID``,
    else ``MASTER_ADDR:MASTER_PORT``; None when there is none of these."""
    if job:
        return job
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id:
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


@dataclass
class Record:
    """One slot: the bytes an open ledger holds (``reserved``), its ticket (``ticket``
    its place, 0: none; ``ticket_bytes`` wanted; ``since``, ``time.time()``; ``what``
    for) and its process (``pid``, ``start``: its start time, to tell pid reuse).
    ``pack`` gives the 256 bytes written whole; ``unpack`` None for a torn record."""

    pid: int
    start: int
    reserved: int = 0
    ticket: int = 0
    ticket_bytes: int = 0
    since: float = 0.0
    what: str = ""

    def pack(self) -> bytes:
        body = _BODY.pack(
            _MAGIC,
            self.pid,
            self.start,
            self.reserved,
            self.ticket,
            self.ticket_bytes,
            self.since,
            self.what.encode()[:200],
        )
        return body + struct.pack("<I", zlib.crc32(body))

    @classmethod
    def unpack(cls, data: bytes) -> Record | None:
        if len(data) != _RECORD:
            return None
        body, (crc,) = data[: _BODY.size], struct.unpack("<I", data[_BODY.size :])
        if zlib.crc32(body) != crc:
            return None
        magic, pid, start, reserved, ticket, tbytes, since, what = _BODY.unpack(body)
        if magic != _MAGIC:
            return None
        return cls(pid, start, reserved, ticket, tbytes, since, what.rstrip(b"\0").decode(errors="replace"))


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


def scan(path: str, own: str) -> dict[str, Record]:
    """Under the node lock: every live slot but ``own``, by file name. A slot whose lock
    can be taken, or whose pid no longer runs with the start time recorded, is a dead
    process's: removed (its bytes and ticket are reclaimed)."""
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
            if not dead and rec is not None and rec.start > 0:
                dead = start_time(rec.pid) != rec.start
            if dead or rec is None:
                # A live owner never leaves its slot unreadable (whole writes under this
                # lock); an unreadable one is a dead writer's whatever its lock says.
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(full)
                continue
            out[name] = rec
        finally:
            os.close(fd)
    return out


def check_budget(path: str, budget: int, *, fresh: bool) -> None:
    """Under the node lock: the ledger's budget file says ``budget`` (written now if
    absent or ``fresh``, atomically); another budget is an InvalidOptionError."""
    file = os.path.join(path, "budget")
    if fresh:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(path, "peak"))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(file)
    try:
        with open(file) as f:
            held = json.load(f)
    except FileNotFoundError:
        held = None
    except (OSError, ValueError):
        held = None  # never left torn (renamed into place): treat as absent
    if held is not None:
        if held.get("format") != FORMAT:
            raise InvalidOptionError(
                f"the node ledger at {path} has format {held.get('format')!r}, this version writes "
                f"{FORMAT}: every rank of a job must run the same async_stager"
            )
        if held.get("budget_bytes") != budget:
            raise InvalidOptionError(
                f"node_budget_bytes={budget} differs from the {held.get('budget_bytes')} bytes the "
                f"node ledger at {path} was opened with: every rank of the node must give the same "
                "budget (or use another node_budget_path/node_budget_job)"
            )
        return
    tmp = f"{file}.{os.getpid()}.new"
    with open(tmp, "w") as f:
        json.dump({"format": FORMAT, "budget_bytes": budget}, f)
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
