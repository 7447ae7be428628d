"""What this process may use on this machine, read once: the pre-flight's limits.

``HostLimits.read()`` reads, all as of the call:

- ``/proc/meminfo`` ``MemAvailable`` (the kernel's estimate of memory a new allocation
  can get without swapping);
- the memory cgroup of this process: v2 (``memory.max``, ``memory.current``,
  ``memory.stat`` ``inactive_file``) or v1 (``memory.limit_in_bytes``,
  ``memory.usage_in_bytes``, ``memory.stat`` ``total_inactive_file``), found through
  ``/proc/self/cgroup`` and ``/proc/self/mountinfo``, every ancestor up to the mount
  included: the tightest headroom (limit minus usage not counting reclaimable page
  cache) wins;
- ``RLIMIT_MEMLOCK`` with what is locked already (``VmLck``) and whether the process
  has ``CAP_IPC_LOCK`` (then the limit does not apply), ``RLIMIT_NOFILE`` with the
  descriptors open now, ``RLIMIT_FSIZE`` (a shared arena is a file of that size);
- free space in ``/dev/shm`` (``statvfs``) and whether ``memfd_create`` exists (a memfd
  is not limited by ``/dev/shm``).

The seam: every path is under ``root`` (tests point it at a fake layout), and
``getrlimit``, ``statvfs`` and ``memfd`` can be passed in. A value that cannot be read
is None: unknown, and not checked. Linux only in substance; elsewhere most are None.
"""

from __future__ import annotations

import errno
import os
import resource
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["CgroupLimit", "HostLimits"]

#: cgroup v1 writes "no limit" as a huge number (PAGE_COUNTER_MAX pages, ~2^63 bytes).
_V1_UNLIMITED = 1 << 60
#: Bit of CAP_IPC_LOCK in /proc/self/status CapEff.
_CAP_IPC_LOCK = 14


@dataclass(frozen=True)
class CgroupLimit:
    """The tightest memory cgroup level of this process: its ``limit`` and ``usage``
    (bytes, usage without reclaimable page cache) and where it is (``path``, the
    cgroup directory; ``version`` 1 or 2)."""

    version: int
    path: str
    limit: int
    usage: int

    @property
    def headroom(self) -> int:
        """Bytes this cgroup can still charge before its limit."""
        return max(0, self.limit - self.usage)

    @property
    def file(self) -> str:
        return "memory.max" if self.version == 2 else "memory.limit_in_bytes"


@dataclass(frozen=True)
class HostLimits:
    """Limits of this process, as read by ``read`` (None: unknown or unlimited, see
    each field). Sizes are bytes."""

    #: ``MemAvailable`` (None: no /proc/meminfo).
    mem_available: int | None = None
    #: The tightest memory cgroup level with a limit (None: no limit found).
    cgroup: CgroupLimit | None = None
    #: ``RLIMIT_MEMLOCK`` soft limit (None: unlimited) and bytes locked now (``VmLck``).
    memlock: int | None = None
    locked: int = 0
    #: The process has CAP_IPC_LOCK: ``mlock`` ignores RLIMIT_MEMLOCK.
    ipc_lock: bool = False
    #: ``RLIMIT_NOFILE`` soft limit (None: unlimited) and descriptors open now.
    nofile: int | None = None
    open_fds: int = 0
    #: ``RLIMIT_FSIZE`` soft limit (None: unlimited): the largest file, a shared arena too.
    fsize: int | None = None
    #: Free bytes in /dev/shm for an unprivileged user (None: no /dev/shm).
    shm_free: int | None = None
    #: ``memfd_create`` exists (shared arenas are memfds, not files in /dev/shm).
    memfd: bool = True

    @classmethod
    def read(
        cls,
        root: str = "/",
        *,
        getrlimit: Callable[[int], tuple[int, int]] = resource.getrlimit,
        statvfs: Callable[[str], Any] = os.statvfs,
        memfd: bool | None = None,
    ) -> HostLimits:
        """The limits now, reading files under ``root`` (see the module doc)."""
        status = _keyed(_read(_under(root, "/proc/self/status")), ":")
        caps = status.get("CapEff")
        try:
            ipc_lock = caps is not None and bool(int(caps, 16) >> _CAP_IPC_LOCK & 1)
        except ValueError:
            ipc_lock = False
        nofile = _rlimit(getrlimit, resource.RLIMIT_NOFILE)
        return cls(
            mem_available=_kib(_keyed(_read(_under(root, "/proc/meminfo")), ":").get("MemAvailable")),
            cgroup=_cgroup(root),
            memlock=_rlimit(getrlimit, resource.RLIMIT_MEMLOCK),
            locked=_kib(status.get("VmLck")) or 0,
            ipc_lock=ipc_lock,
            nofile=nofile,
            open_fds=_count_fds(root, nofile),
            fsize=_rlimit(getrlimit, resource.RLIMIT_FSIZE),
            shm_free=_free_space(statvfs, _under(root, "/dev/shm")),
            memfd=hasattr(os, "memfd_create") if memfd is None else memfd,
        )


def _under(root: str, path: str) -> str:
    return os.path.join(root, path.lstrip("/"))


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _keyed(text: str, sep: str) -> dict[str, str]:
    """``key<sep> value`` lines (``/proc/meminfo``; ``key value`` for memory.stat)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(sep)
        if value:
            out[key.strip()] = value.strip()
    return out


def _kib(value: str | None) -> int | None:
    """``"123 kB"`` as bytes."""
    if not value:
        return None
    try:
        return int(value.split()[0]) * 1024
    except ValueError:
        return None


def _int(text: str) -> int | None:
    try:
        return int(text.strip())
    except ValueError:
        return None


def _rlimit(getrlimit: Callable[[int], tuple[int, int]], which: int) -> int | None:
    try:
        soft, _hard = getrlimit(which)
    except (OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY or soft < 0 else int(soft)


def _count_fds(root: str, nofile: int | None) -> int:
    try:
        # listdir opens one descriptor of its own while it reads: not counted.
        return max(0, len(os.listdir(_under(root, "/proc/self/fd"))) - 1)
    except OSError as e:
        # No descriptor left even to list them: every one is in use.
        return nofile if e.errno == errno.EMFILE and nofile is not None else 0


def _free_space(statvfs: Callable[[str], Any], path: str) -> int | None:
    try:
        st = statvfs(path)
    except OSError:
        return None
    return int(st.f_bavail) * int(st.f_frsize)


def _mounts(root: str) -> tuple[tuple[str, str] | None, tuple[str, str] | None]:
    """(mount point, hierarchy root) of the cgroup v2 and of the v1 memory hierarchy,
    from mountinfo; the usual places when it does not say."""
    v2 = v1 = None
    for line in _read(_under(root, "/proc/self/mountinfo")).splitlines():
        left, _, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if len(fields) < 5 or len(rfields) < 1:
            continue
        fstype = rfields[0]
        if fstype == "cgroup2" and v2 is None:
            v2 = (fields[4], fields[3])
        elif fstype == "cgroup" and len(rfields) >= 3 and "memory" in rfields[2].split(",") and v1 is None:
            v1 = (fields[4], fields[3])
    if v2 is None and os.path.exists(_under(root, "/sys/fs/cgroup/cgroup.controllers")):
        v2 = ("/sys/fs/cgroup", "/")
    if v1 is None and os.path.isdir(_under(root, "/sys/fs/cgroup/memory")):
        v1 = ("/sys/fs/cgroup/memory", "/")
    return v2, v1


def _cgroup(root: str) -> CgroupLimit | None:
    """The tightest memory cgroup level of this process, v2 first (see module doc)."""
    paths: dict[str, str] = {}
    for line in _read(_under(root, "/proc/self/cgroup")).splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") if parts[1] else [""]:
                paths.setdefault(controller, parts[2])
    v2, v1 = _mounts(root)
    found: CgroupLimit | None = None
    if v2 is not None and "" in paths:
        found = _tightest(root, v2, paths[""], 2)
    if found is None and v1 is not None and "memory" in paths:
        found = _tightest(root, v1, paths["memory"], 1)
    return found


def _tightest(root: str, mount: tuple[str, str], path: str, version: int) -> CgroupLimit | None:
    """Walk from the process's cgroup directory up to the mount: the level with the
    least headroom. A path outside the mount's root (a container without a cgroup
    namespace sees the host's path) starts at the mount itself."""
    mountpoint, hroot = mount
    base = _under(root, mountpoint)
    rel = path
    if hroot not in ("", "/"):
        rel = path[len(hroot) :] if path == hroot or path.startswith(hroot.rstrip("/") + "/") else ""
    level = os.path.normpath(_under(base, rel)) if rel.strip("/") else base
    if not os.path.isdir(level):
        level = base
    best: CgroupLimit | None = None
    while True:
        got = _level(level, version)
        if got is not None and (best is None or got.headroom < best.headroom):
            best = got
        if os.path.normpath(level) == os.path.normpath(base):
            return best
        parent = os.path.dirname(level)
        if parent == level:
            return best
        level = parent


def _level(path: str, version: int) -> CgroupLimit | None:
    if version == 2:
        raw = _read(os.path.join(path, "memory.max")).strip()
        if not raw or raw == "max":
            return None
        limit = _int(raw)
        usage = _int(_read(os.path.join(path, "memory.current")))
        cache_key = "inactive_file"
    else:
        limit = _int(_read(os.path.join(path, "memory.limit_in_bytes")))
        if limit is None or limit >= _V1_UNLIMITED:
            return None
        usage = _int(_read(os.path.join(path, "memory.usage_in_bytes")))
        cache_key = "total_inactive_file"
    if limit is None:
        return None
    stat = _keyed(_read(os.path.join(path, "memory.stat")), " ")
    cache = _int(stat.get(cache_key, stat.get("inactive_file", "0"))) or 0
    used = max(0, (usage or 0) - cache)
    return CgroupLimit(version=version, path=path, limit=limit, usage=used)
