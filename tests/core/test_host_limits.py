"""The limits reader (``HostLimits.read``) on fake layouts under a temporary root,
through its seam: /proc/meminfo, cgroup v2 (nested, ``max``, a container's host path)
and v1, /dev/shm (a fake statvfs, and a tiny tmpfs where one can be mounted), and the
checks each feeds."""

from __future__ import annotations

import subprocess
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest
import torch

from async_stager import HostLimitError, Stager
from async_stager._core.memory import preflight as preflight_mod
from async_stager._core.memory.host_limits import CgroupLimit, HostLimits
from async_stager._core.memory.preflight import Need, check, set_bytes

pytestmark = pytest.mark.timeout(60)

StatVFS = namedtuple("StatVFS", "f_bavail f_frsize")


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def _no_rlimits(which: int) -> tuple[int, int]:
    return (-1, -1)


_NO_RLIMITS: dict[str, Any] = {"getrlimit": _no_rlimits}


def test_meminfo(tmp_path: Path) -> None:
    _write(tmp_path, {"/proc/meminfo": "MemTotal:  100 kB\nMemAvailable:    2048 kB\n"})
    limits = HostLimits.read(str(tmp_path), **_NO_RLIMITS)
    assert limits.mem_available == 2 << 20 and limits.cgroup is None
    assert limits.memlock is None and limits.nofile is None and limits.fsize is None
    report = check(Need(per_set=set_bytes([4 << 20]), sets=2), limits)
    assert not report.fits
    with pytest.raises(HostLimitError, match=r"MemAvailable.*2 x 4 MiB.*2 MiB left"):
        report.raise_if_short()


def _v2(tmp_path: Path, levels: dict[str, tuple[str, int, int]]) -> HostLimits:
    files = {
        "/proc/self/cgroup": "0::/kubepods/pod1/ctr\n",
        "/proc/self/mountinfo": "30 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
        "/sys/fs/cgroup/cgroup.controllers": "cpu memory\n",
    }
    for level, (mx, current, inactive) in levels.items():
        d = f"/sys/fs/cgroup/{level}".rstrip("/")
        files[f"{d}/memory.max"] = f"{mx}\n"
        files[f"{d}/memory.current"] = f"{current}\n"
        files[f"{d}/memory.stat"] = f"anon 5\ninactive_file {inactive}\nactive_file 9\n"
    _write(tmp_path, files)
    return HostLimits.read(str(tmp_path), **_NO_RLIMITS)


def test_cgroup_v2_nested_the_tightest_ancestor_wins(tmp_path: Path) -> None:
    gib = 1 << 30
    limits = _v2(
        tmp_path,
        {
            "kubepods": ("max", 50 * gib, 0),
            "kubepods/pod1": (str(8 * gib), 6 * gib, gib),  # 3 GiB left
            "kubepods/pod1/ctr": (str(16 * gib), 6 * gib, gib),  # 11 GiB left
        },
    )
    cg = limits.cgroup
    assert cg is not None and cg.version == 2 and cg.path.endswith("kubepods/pod1")
    assert (cg.limit, cg.usage, cg.headroom) == (8 * gib, 5 * gib, 3 * gib)
    need = Need(per_set=2 * gib, sets=2)
    with pytest.raises(HostLimitError) as info:
        check(need, limits).raise_if_short()
    e = info.value
    assert e.resource == "cgroup v2 memory.max" and e.limit == 3 * gib and e.need == 4 * gib
    assert "8 GiB at" in e.fix and "--memory" in e.fix and "max_buffer_sets (now 2)" in e.fix
    assert check(Need(per_set=2 * gib, sets=1), limits).fits


def test_cgroup_v2_max_everywhere_is_no_limit(tmp_path: Path) -> None:
    limits = _v2(tmp_path, {"": ("max", 1, 0), "kubepods": ("max", 1, 0), "kubepods/pod1/ctr": ("max", 1, 0)})
    assert limits.cgroup is None


def test_cgroup_v2_host_path_in_a_container_reads_the_mount(tmp_path: Path) -> None:
    # No cgroup namespace: /proc/self/cgroup shows the host's path, the mount is ours.
    _write(
        tmp_path,
        {
            "/proc/self/cgroup": "0::/system.slice/docker-abc.scope\n",
            "/proc/self/mountinfo": "30 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
            "/sys/fs/cgroup/memory.max": "1073741824\n",
            "/sys/fs/cgroup/memory.current": "0\n",
        },
    )
    cg = HostLimits.read(str(tmp_path), **_NO_RLIMITS).cgroup
    assert cg is not None and cg.limit == 1 << 30 and cg.headroom == 1 << 30


def test_cgroup_v1(tmp_path: Path) -> None:
    mib = 1 << 20
    _write(
        tmp_path,
        {
            "/proc/self/cgroup": "5:devices:/x\n4:memory:/docker/abc\n0::/\n",
            "/proc/self/mountinfo": (
                "31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n"
                "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
            ),
            "/sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",
            "/sys/fs/cgroup/memory/docker/memory.limit_in_bytes": "9223372036854771712\n",
            "/sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes": f"{512 * mib}\n",
            "/sys/fs/cgroup/memory/docker/abc/memory.usage_in_bytes": f"{300 * mib}\n",
            "/sys/fs/cgroup/memory/docker/abc/memory.stat": f"cache 1\ntotal_inactive_file {100 * mib}\n",
        },
    )
    cg = HostLimits.read(str(tmp_path), **_NO_RLIMITS).cgroup
    assert cg == CgroupLimit(1, str(tmp_path / "sys/fs/cgroup/memory/docker/abc"), 512 * mib, 200 * mib)
    with pytest.raises(HostLimitError, match=r"cgroup v1 memory.limit_in_bytes: staging needs 2 x 256 MiB"):
        check(Need(per_set=256 * mib, sets=2), HostLimits(cgroup=cg)).raise_if_short()
    # Unlimited (the kernel's huge number) is no limit.
    (tmp_path / "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert HostLimits.read(str(tmp_path), **_NO_RLIMITS).cgroup is None


def test_this_machine_reads_without_error() -> None:
    limits = HostLimits.read()
    assert limits.mem_available is None or limits.mem_available > 0
    assert limits.open_fds > 0


# -- /dev/shm -------------------------------------------------------------------------


def test_dev_shm_through_the_seam(tmp_path: Path) -> None:
    fake = StatVFS(f_bavail=16, f_frsize=4096)  # 64 KiB free
    limits = HostLimits.read(str(tmp_path), statvfs=lambda p: fake, memfd=False, **_NO_RLIMITS)
    assert limits.shm_free == 64 * 1024 and not limits.memfd
    need = Need(per_set=set_bytes([10]), shared=True)
    with pytest.raises(HostLimitError) as info:
        check(need, limits).raise_if_short()
    assert info.value.resource == "shared memory (/dev/shm)" and "--shm-size" in info.value.fix
    # A memfd is not limited by /dev/shm: no such row.
    with_memfd = HostLimits.read(str(tmp_path), statvfs=lambda p: fake, memfd=True, **_NO_RLIMITS)
    assert check(need, with_memfd).rows == ()


def test_dev_shm_on_a_tiny_tmpfs(tmp_path: Path) -> None:
    shm = tmp_path / "dev" / "shm"
    shm.mkdir(parents=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(shm)], capture_output=True, check=False
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        limits = HostLimits.read(str(tmp_path), memfd=False, **_NO_RLIMITS)
        assert limits.shm_free == 256 * 1024
        report = check(Need(per_set=set_bytes([10]), shared=True), limits)
        assert not report.fits and report.rows[0].limit == 256 * 1024
    finally:
        subprocess.run(["umount", str(shm)], check=False)


@pytest.mark.anyio
async def test_reserve_reads_a_fake_cgroup_through_the_seam(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """End to end: a stager whose limits come from a fake cgroup v2 layout refuses a
    state over the pod's limit, naming the cgroup, and allocates nothing."""
    mib = 1 << 20
    _v2(tmp_path, {"kubepods/pod1": (str(8 * mib), 2 * mib, 0), "kubepods/pod1/ctr": ("max", 2 * mib, 0)})
    monkeypatch.setattr(preflight_mod, "read_limits", lambda: HostLimits.read(str(tmp_path), **_NO_RLIMITS))
    async with Stager(max_buffer_sets=2) as stager:
        with pytest.raises(HostLimitError) as info:
            await stager.reserve({"w": torch.zeros(mib)})  # 2 x 4 MiB, 6 MiB left
        assert info.value.resource == "cgroup v2 memory.max" and "kubepods/pod1" in info.value.fix
        assert stager.host_bytes == 0
        await stager.reserve({"w": torch.zeros(mib // 2)})  # 2 x 2 MiB fits
        assert stager.host_bytes == 2 * mib
