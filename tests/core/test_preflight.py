"""Pre-flight: every limit it reads, the estimate, the error, and that a state that
cannot fit fails before anything is allocated (the stager staying usable).

Real limits are set with ``resource.setrlimit`` in a subprocess (RLIMIT_MEMLOCK,
RLIMIT_NOFILE, RLIMIT_FSIZE), each also cross-checked against what really fails with
the check off; the reader of cgroups, /proc/meminfo and /dev/shm is tested in
test_host_limits.py.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from async_stager import (
    CheckpointStagerConfig,
    DefaultStager,
    HostAllocationError,
    HostLimitError,
    Stager,
    StagingError,
)
from async_stager._core.memory import preflight as preflight_mod
from async_stager._core.memory.arena import MIN_ARENA_BYTES
from async_stager._core.memory.host_limits import CgroupLimit, HostLimits
from async_stager._core.memory.preflight import Need, check, human, set_bytes
from async_stager.testing import FakePinner

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter importing this checkout; fails the test on error."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=100
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r


# -- sizes and the estimate ---------------------------------------------------------


def test_human_sizes() -> None:
    assert human(0) == "0 B"
    assert human(1023) == "1023 B"
    assert human(64 * 1024) == "64 KiB"
    assert human(int(37.2 * 2**30)) == "37.2 GiB"
    assert human(3 * 2**40) == "3 TiB"


def test_set_bytes_aligns_like_the_arena() -> None:
    assert set_bytes([]) == 0
    assert set_bytes([0, 0]) == 0
    assert set_bytes([1]) == MIN_ARENA_BYTES  # one arena, at least 1 MiB
    big = 3 * MIN_ARENA_BYTES
    # Each block rounds up to 64 bytes.
    assert set_bytes([big + 1, 1]) == big + 128


# -- the real reserve path: the estimate is exact, the boundary is the limit --------


def _aliased_state() -> dict[str, Any]:
    base = torch.arange(300_000, dtype=torch.float32)  # 1.2 MB storage
    other = torch.ones(100_000, dtype=torch.float64)
    return {
        "w": base,
        "view": base[10:20],  # same storage: counted once
        "again": base,  # the same tensor twice
        "o": other,
        "s": torch.tensor(3),
        "meta": {"step": 5},
    }


def _limits(**kw: Any) -> HostLimits:
    return HostLimits(**{"mem_available": None, "nofile": None, "fsize": None, **kw})


@pytest.mark.anyio
async def test_reserve_estimate_is_exact_and_refuses_one_byte_short(monkeypatch: pytest.MonkeyPatch) -> None:
    sd = _aliased_state()
    st = {
        t.untyped_storage()._cdata: t.untyped_storage().nbytes()
        for t in sd.values()
        if isinstance(t, torch.Tensor)
    }
    per_set = set_bytes(st.values())
    limit = {"bytes": 2 * per_set - 1}
    monkeypatch.setattr(preflight_mod, "read_limits", lambda: _limits(mem_available=limit["bytes"]))
    async with Stager(max_buffer_sets=2) as stager:
        with pytest.raises(HostLimitError) as info:
            await stager.reserve(sd)
        e = info.value
        assert e.resource == "host memory (MemAvailable)"
        assert (e.need, e.limit, e.unit) == (2 * per_set, 2 * per_set - 1, "bytes")
        assert f"2 x {human(per_set)}" in str(e) and "max_buffer_sets" in e.fix
        assert "nothing was allocated" in str(e) and "preflight=False" in str(e)
        assert isinstance(e, HostAllocationError) and isinstance(e, StagingError)
        back = pickle.loads(pickle.dumps(e))  # crosses processes whole
        assert (str(back), back.resource, back.need, back.fix) == (str(e), e.resource, e.need, e.fix)
        assert back.report.rows == e.report.rows
        # Nothing was allocated, and the stager stays usable.
        assert stager.host_bytes == 0 and stager.stats is None
        limit["bytes"] = 2 * per_set
        stats = await stager.reserve(sd)
        assert stats.host_bytes == stager.host_bytes == per_set  # one set mapped, as estimated
        staged = await stager.stage(sd)
        assert torch.equal(staged["w"], sd["w"]) and staged["meta"] == {"step": 5}


@pytest.mark.anyio
async def test_reserve_counts_what_the_stager_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    sd = {"w": torch.zeros(1 << 20)}  # 4 MiB
    per_set = set_bytes([4 << 20])
    # Room for exactly one more set once one is held.
    monkeypatch.setattr(preflight_mod, "read_limits", lambda: _limits(mem_available=per_set))
    async with Stager(max_buffer_sets=2, preflight=False) as stager:
        await stager.reserve(sd)
    async with Stager(max_buffer_sets=2) as stager:
        with pytest.raises(HostLimitError):
            await stager.reserve(sd)  # 2 sets, nothing held
    async with Stager(max_buffer_sets=1) as stager:
        await stager.reserve(sd)
        await stager.reserve(sd)  # again: the set holds it, nothing new


@pytest.mark.anyio
async def test_cold_stage_checks_and_warm_stage_reads_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    sd = {"w": torch.ones(1 << 18)}
    reads: list[int] = []
    avail = {"bytes": 1000}

    def read() -> HostLimits:
        reads.append(1)
        return _limits(mem_available=avail["bytes"])

    monkeypatch.setattr(preflight_mod, "read_limits", read)
    async with Stager(max_buffer_sets=2) as stager:
        with pytest.raises(HostLimitError) as info:
            await stager.stage(sd)
        assert "1 MiB" in str(info.value)  # a stage checks one set: the one it fills
        assert stager.host_bytes == 0
        avail["bytes"] = 1 << 40
        staged = await stager.stage(sd)
        n = len(reads)
        del staged
        for _ in range(3):
            staged = await stager.stage(sd)  # cached: into the set that holds memory
            del staged
        assert len(reads) == n
    async with Stager(preflight=False) as stager:
        avail["bytes"] = 0
        n = len(reads)
        await stager.reserve(sd)
        await stager.stage(sd)
        assert len(reads) == n


def test_preflight_option_is_validated_and_default_stager_takes_it() -> None:
    from async_stager import InvalidOptionTypeError

    with pytest.raises(InvalidOptionTypeError, match="preflight"):
        Stager(preflight="yes")  # type: ignore[arg-type]
    config = CheckpointStagerConfig(use_async_staging=False)
    with DefaultStager(config, preflight=False) as stager:
        staged = stager.stage({"a": torch.ones(2)})
        assert isinstance(staged, dict) and staged["a"].sum() == 2
    assert Stager().options.preflight is True


# -- pinned memory through the seam (no CUDA needed) --------------------------------


class ChargedFakePinner(FakePinner):
    """A FakePinner whose pages count against RLIMIT_MEMLOCK, like mlock()."""

    charges_memlock = True


@pytest.mark.anyio
async def test_pinned_bytes_against_memlock_through_the_seam(monkeypatch: pytest.MonkeyPatch) -> None:
    sd = {"w": torch.ones(1 << 20)}
    per_set = set_bytes([4 << 20])
    low = _limits(memlock=64 * 1024, locked=0, ipc_lock=False)
    monkeypatch.setattr(preflight_mod, "read_limits", lambda: low)
    pinner = ChargedFakePinner()
    async with Stager(pinner=pinner, non_blocking=False) as stager:
        assert stager.options.pin_memory
        with pytest.raises(HostLimitError) as info:
            await stager.reserve(sd)
        e = info.value
        assert e.resource == "pinned memory (RLIMIT_MEMLOCK)" and e.limit == 64 * 1024
        assert f"needs 2 x {human(per_set)}" in str(e) and "64 KiB" in str(e)
        assert "ulimit -l" in e.fix and "pin_memory=False" in e.fix
        assert pinner.total_registrations == 0 and stager.host_bytes == 0
    # A pinner that is not charged (CUDA's): the row is shown, not enforced.
    plain = FakePinner()
    async with Stager(pinner=plain, non_blocking=False) as stager:
        await stager.reserve(sd)
        assert plain.total_registrations == 1
    report = check(Need(per_set=per_set, sets=2, pinned=True), low)
    (row,) = report.rows
    assert not row.fits and not row.enforced and row.verdict == "not enforced" and report.fits
    assert "not charged" in report.format()
    # CAP_IPC_LOCK lifts the limit for mlock too.
    capable = check(
        Need(per_set=per_set, pinned=True, charges_memlock=True), _limits(memlock=1, ipc_lock=True)
    )
    assert capable.fits


_MLOCK_PINNER = """
import ctypes, resource
from async_stager import PinningError
libc = ctypes.CDLL(None, use_errno=True)

def drop_ipc_lock():
    # CAP_IPC_LOCK (root here) lifts RLIMIT_MEMLOCK: take it out of this process.
    class Hdr(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
    class Data(ctypes.Structure):
        _fields_ = [("eff", ctypes.c_uint32), ("perm", ctypes.c_uint32), ("inh", ctypes.c_uint32)]
    h, d = Hdr(0x20080522, 0), (Data * 2)()
    if libc.capget(ctypes.byref(h), d) == 0:
        d[0].eff &= ~(1 << 14); d[0].perm &= ~(1 << 14)
        libc.capset(ctypes.byref(h), d)

class MlockPinner:
    charges_memlock = True
    def __init__(self):
        self.locked = {}
    def register(self, ptr, nbytes):
        if libc.mlock(ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes)) != 0:
            raise PinningError(f"mlock of {nbytes} bytes failed: errno {ctypes.get_errno()}")
        self.locked[ptr] = nbytes
    def unregister(self, ptr):
        libc.munlock(ctypes.c_void_p(ptr), ctypes.c_size_t(self.locked.pop(ptr)))
"""


def test_memlock_set_in_a_subprocess_with_a_real_mlock_pinner() -> None:
    r = _run(
        _MLOCK_PINNER
        + """
import asyncio, torch
from async_stager import HostLimitError, Stager
from async_stager._core.memory.host_limits import HostLimits
drop_ipc_lock()
resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 * 1024, resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]))
limits = HostLimits.read()
assert limits.memlock == 64 * 1024 and not limits.ipc_lock, limits
sd = {"w": torch.ones(1 << 20)}

async def main():
    pinner = MlockPinner()
    async with Stager(pinner=pinner, non_blocking=False) as s:
        try:
            await s.reserve(sd)
        except HostLimitError as e:
            assert e.resource == "pinned memory (RLIMIT_MEMLOCK)" and "64 KiB" in str(e), e
            print("refused:", e)
        assert s.host_bytes == 0 and not pinner.locked
    # The check off: the same reserve really fails, in mlock.
    async with Stager(pinner=MlockPinner(), non_blocking=False, preflight=False) as s:
        try:
            await s.reserve(sd)
        except PinningError as e:
            print("really fails:", e)

asyncio.run(main())
"""
    )
    assert "refused: pre-flight: pinned memory (RLIMIT_MEMLOCK): staging needs 2 x 4 MiB" in r.stdout
    assert "really fails: mlock of" in r.stdout


# -- descriptors and file size, set in a subprocess ---------------------------------


def test_nofile_set_in_a_subprocess() -> None:
    r = _run(
        """
import asyncio, os, resource, torch
from async_stager import HostLimitError, Stager
from async_stager._core.aio.stager import stager_internals
sd = {"w": torch.ones(1000), "v": torch.zeros(7)}

async def main():
    async with Stager(share_memory=True) as s:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        open_now = len(os.listdir("/proc/self/fd")) - 1
        resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + 3, hard))
        try:
            await s.reserve(sd)  # 2 sets x 2 descriptors, 3 left
        except HostLimitError as e:
            # 3 left, or fewer if the runtime opened one meanwhile.
            assert (e.resource, e.need, e.unit) == ("descriptors (RLIMIT_NOFILE)", 4, "descriptors"), e
            assert e.limit <= 3, e
            assert "ulimit -n" in e.fix and "4 descriptors" in str(e)
            print("refused")
        assert s.host_bytes == 0 and stager_internals(s).shared_arenas() == []
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        await s.reserve(sd)
        staged = await s.stage(sd)
        assert staged["w"].sum() == 1000 and len(stager_internals(s).shared_arenas()) == 1
        print("usable")

asyncio.run(main())
"""
    )
    assert r.stdout.split() == ["refused", "usable"]


def test_fsize_set_in_a_subprocess_matches_the_real_failure() -> None:
    r = _run(
        """
import asyncio, resource, torch
from async_stager import HostAllocationError, HostLimitError, Stager
resource.setrlimit(resource.RLIMIT_FSIZE, (512 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
sd = {"w": torch.ones(1000)}  # one arena of 1 MiB, a file over the limit

async def main():
    async with Stager(share_memory=True) as s:
        try:
            await s.stage(sd)
        except HostLimitError as e:
            assert e.resource == "shared arena size (RLIMIT_FSIZE)" and e.limit == 512 * 1024, e
            print("refused")
        assert s.host_bytes == 0
    async with Stager(share_memory=True, preflight=False) as s:
        try:
            await s.stage(sd)
        except HostAllocationError as e:
            print("really fails")

asyncio.run(main())
"""
    )
    assert r.stdout.splitlines() == ["refused", "really fails"]


# -- report ----------------------------------------------------------------------------


def test_report_table_fits_80_columns() -> None:
    limits = HostLimits(
        mem_available=1 << 30,
        cgroup=CgroupLimit(2, "/sys/fs/cgroup/a/very/long/path/of/a/container", 1 << 40, 0),
        memlock=64 * 1024,
        nofile=1024,
        open_fds=10,
        fsize=None,
        shm_free=1 << 30,
        memfd=False,
    )
    report = check(Need(per_set=int(37.2 * 2**30), sets=2, pinned=True, shared=True), limits)
    table = report.format()
    assert all(len(line) <= 80 for line in table.splitlines()), table
    assert [r.resource for r in report.rows] == [
        "host memory (MemAvailable)",
        "cgroup v2 memory.max",
        "pinned memory (RLIMIT_MEMLOCK)",
        "shared memory (/dev/shm)",
        "descriptors (RLIMIT_NOFILE)",
    ]
    assert "2 x 37.2 GiB" in table and "NO" in table and not report.fits


def test_no_descriptor_left_reads_as_all_in_use() -> None:
    _run(
        """
import os, resource
from async_stager._core.memory.host_limits import HostLimits
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
fds = []
resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
try:
    while True:
        fds.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
limits = HostLimits.read()
assert limits.nofile == 64 and limits.open_fds == 64, limits
"""
    )
