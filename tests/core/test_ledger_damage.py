"""The node ledger against damage and hostile surroundings: a live process's slot file
damaged or removed by something else (its bytes stay counted; its owner rewrites it), a
budget file damaged or removed while bytes are held (the slots still decide the
budget), torchrun's ``TORCHELASTIC_RUN_ID=none`` (no job id), a ledger folder on a full
disk (a typed error naming the folder and the budget), and an arena finalizer run by
the collector while the ledger holds its node lock (deferred, not a self-deadlock)."""

from __future__ import annotations

import errno
import gc
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any
from unittest import mock

import anyio
import pytest
import torch

from async_stager import Checkpointer, InvalidOptionError, Stager
from async_stager._core.memory import ledger as ledger_mod, ledger_files
from async_stager._core.memory.ledger import NodeLedger, job_identity
from async_stager._core.memory.ledger_files import Record
from async_stager.errors import HostAllocationError, NodeBudgetError
from tests.full_disk import full_disk

pytestmark = pytest.mark.timeout(90)

MiB = 1 << 20


@pytest.fixture
def where(tmp_path: Path) -> str:
    return str(tmp_path / "ledger")


def slot_of(led: NodeLedger) -> Path:
    [slot] = [p for p in Path(led.path).glob(f"slot-{os.getpid()}-*") if p.name == Path(led._slot).name]
    return slot


def damage(slot: Path, how: str) -> None:
    data = bytearray(slot.read_bytes())
    if how == "truncated":
        slot.write_bytes(bytes(data[:100]))
    elif how == "emptied":
        slot.write_bytes(b"")
    else:  # one byte flipped, in the bytes-held field
        data[30] ^= 0x01
        slot.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncated", "emptied", "flipped"])
def test_a_damaged_slot_of_a_live_process_keeps_its_bytes(where: str, how: str) -> None:
    """Another process's scan must not delete a live slot it cannot read: its bytes are
    unknown, so they count as everything the readable slots leave, until its owner's
    next update rewrites it (then exactly what it holds)."""
    with NodeLedger.open(4 * MiB, path=where) as a, NodeLedger.open(4 * MiB, path=where) as b:
        held = a.reserve(3 * MiB, timeout=1, what="a's arena")
        damage(slot_of(a), how)
        assert b.try_reserve(2 * MiB) is None  # would be 5 MiB under a 4 MiB budget
        assert b.try_reserve(1) is None  # its bytes are unknown: nothing is free
        u = b.usage()
        assert u.damaged == (os.getpid(),) and u.reserved == 4 * MiB and u.free == 0
        assert slot_of(a).exists()  # kept
        with pytest.raises(NodeBudgetError, match="damaged by something other than its owner") as e:
            b.reserve(MiB, timeout=0.2, what="b's arena")
        assert str(Path(where)) in str(e.value)
        # The owner's next update rewrites its slot: then it counts exactly.
        assert a.usage().reserved == 3 * MiB
        u = b.usage()
        assert u.damaged == () and u.reserved == 3 * MiB
        with b.reserve(MiB, timeout=1):
            assert b.try_reserve(1) is None  # the budget is full, not over
        held.release()
        assert b.usage().reserved == 0


def test_a_damaged_slot_through_two_stagers(where: str) -> None:
    """The issue's case through the public API: stager A holds 3 MiB of a 4 MiB node
    budget; its slot is damaged; stager B's 3 MiB stage must not be granted (6 MiB under
    4 MiB before the fix): it waits its bound and says why."""

    async def main() -> None:
        sd = {"w": torch.rand(3 * MiB // 4)}
        opts: dict[str, Any] = {"node_budget_bytes": 4 * MiB, "node_budget_path": where}
        async with Stager(**opts) as a, Stager(buffer_wait_timeout=0.3, **opts) as b:
            staged = await a.stage(sd)
            recs = {p: Record.unpack(p.read_bytes()) for p in Path(where).glob("slot-*")}
            [slot] = [p for p, r in recs.items() if r is not None and r.reserved]  # a's
            damage(slot, "flipped")
            with pytest.raises(NodeBudgetError, match="damaged"):
                await b.stage({"w": torch.rand(3 * MiB // 4)})
            assert torch.equal(staged["w"], sd["w"])

    anyio.run(main)


def test_a_removed_slot_of_a_live_process_is_made_again_by_its_owner(where: str) -> None:
    with NodeLedger.open(4 * MiB, path=where) as a, NodeLedger.open(4 * MiB, path=where) as b:
        a.reserve(3 * MiB, timeout=1)
        slot = slot_of(a)
        slot.unlink()
        assert a.usage().reserved == 3 * MiB  # its owner's update makes it again, locked
        assert slot.exists()
        assert b.try_reserve(2 * MiB) is None and b.usage().reserved == 3 * MiB


@pytest.mark.parametrize("how", ["removed", "garbage", "empty object", "another budget"])
def test_a_damaged_budget_file_does_not_let_another_budget_in(where: str, how: str) -> None:
    """The budget file is not the only record of the budget: every live slot holds the
    one it was opened with, so a process with another budget is refused whatever
    happened to the file, and the file is rewritten from the slots."""
    with NodeLedger.open(4 * MiB, path=where) as a:
        a.reserve(3 * MiB, timeout=1)
        budget = Path(where, "budget")
        if how == "removed":
            budget.unlink()
        elif how == "garbage":
            budget.write_bytes(b"\x00{not json")
        elif how == "empty object":
            budget.write_text("{}")
        else:
            budget.write_text(json.dumps({"format": 2, "budget_bytes": 64 * MiB}))
        with pytest.raises(
            InvalidOptionError, match=f"node_budget_bytes={64 * MiB} differs from the {4 * MiB}"
        ):
            NodeLedger.open(64 * MiB, path=where)
        with NodeLedger.open(4 * MiB, path=where) as b:  # the same budget is let in
            assert b.usage().reserved == 3 * MiB and b.try_reserve(2 * MiB) is None
        assert json.loads(budget.read_text())["budget_bytes"] == 4 * MiB  # rewritten


def test_unreadable_slots_and_no_budget_file_refuse_to_open(where: str) -> None:
    with NodeLedger.open(4 * MiB, path=where) as a:
        a.reserve(MiB, timeout=1)
        damage(slot_of(a), "truncated")
        Path(where, "budget").unlink()
        with pytest.raises(InvalidOptionError, match="is damaged"):
            NodeLedger.open(64 * MiB, path=where)


@pytest.mark.parametrize("run_id", ["none", "None", " NONE ", ""])
def test_torchelastic_run_id_none_is_no_job_id(monkeypatch: pytest.MonkeyPatch, run_id: str) -> None:
    """``torchrun --master-port P`` sets TORCHELASTIC_RUN_ID=none for every job: it must
    not put unrelated jobs of a node in one ledger."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    assert job_identity() is None
    with pytest.raises(InvalidOptionError, match="node_budget_job="):
        NodeLedger.open(4 * MiB)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29511")
    assert job_identity() == "master-127.0.0.1:29511"  # torchrun's port tells the jobs apart
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "a1b2")
    assert job_identity() == "torchelastic-a1b2"


def test_a_ledger_folder_on_a_full_disk_names_it_and_the_budget(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No bare ``OSError: [Errno 28]``: a HostAllocationError naming the folder and the
    node budget, saying the disk is full, with the OSError as its cause."""
    os.makedirs(where)
    disk = full_disk(monkeypatch, Path(where))
    with pytest.raises(HostAllocationError) as e:
        NodeLedger.open(4 * MiB, path=where)
    msg = str(e.value)
    assert where in msg and f"node_budget_bytes={4 * MiB}" in msg and "disk is full" in msg
    assert isinstance(e.value.__cause__, OSError) and e.value.__cause__.errno == errno.ENOSPC
    assert disk.refused >= 1
    assert not [n for n in os.listdir(where) if n.startswith("slot-")]  # nothing half-made left
    # Through the public API: the Stager's constructor says the same.
    with pytest.raises(HostAllocationError, match="disk is full"):
        Stager(node_budget_bytes=4 * MiB, node_budget_path=where)


def test_a_disk_that_fills_while_the_ledger_is_open(where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with NodeLedger.open(4 * MiB, path=where) as led:
        led.reserve(MiB, timeout=1).release()  # the peak file exists
        full_disk(monkeypatch, Path(where))
        with pytest.raises(HostAllocationError, match="disk is full") as e:
            led.reserve(2 * MiB, timeout=1)
        assert where in str(e.value)
        monkeypatch.undo()
        assert led.usage().reserved == 0  # the refused grant left nothing held
        led.reserve(4 * MiB, timeout=1).release()


def _unshare_ok() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=4k none /tmp"], capture_output=True, timeout=30
    )
    return probe.returncode == 0


def test_a_real_full_tmpfs(tmp_path: Path) -> None:
    """The same on a real full filesystem: a 4 KiB tmpfs mounted in a user namespace
    (skipped where the machine allows none)."""
    if not _unshare_ok():
        pytest.skip("no unprivileged user/mount namespaces here")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    code = textwrap.dedent(
        f"""
        import os, sys
        from async_stager._core.memory.ledger import NodeLedger
        from async_stager.errors import HostAllocationError
        with open("{mnt}/fill", "wb") as f:
            try:
                f.write(b"x" * 65536)
            except OSError:
                pass
        try:
            NodeLedger.open(1 << 22, path="{mnt}/ledger")
        except HostAllocationError as e:
            print("TYPED", e)
        """
    )
    out = subprocess.run(
        [
            "unshare",
            "-rm",
            "sh",
            "-c",
            f'mount -t tmpfs -o size=4k none {mnt} && "{sys.executable}" -c "$0"',
            code,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert "TYPED" in out.stdout, out.stdout + out.stderr
    assert "disk is full" in out.stdout and f"{mnt}/ledger" in out.stdout


def test_a_finalizer_run_while_the_node_lock_is_held_is_deferred(where: str) -> None:
    """An arena's finalizer (``Reservation.release``) that the collector runs in a
    thread inside the ledger's node-lock section must not take the lock again (a
    second flock of the same process waits for itself: every rank of the node would
    block behind it): it is deferred, and applied before the section ends."""
    with NodeLedger.open(4 * MiB, path=where) as led:

        class Arena:
            pass

        import weakref

        r = led.reserve(3 * MiB, timeout=1, what="arena")
        arena = Arena()
        weakref.finalize(arena, r.release)
        cycle: list[Any] = [arena]
        cycle.append(cycle)  # only the collector frees it
        del arena, cycle
        done = threading.Event()
        errors: list[BaseException] = []

        def under_the_lock() -> None:
            try:
                with led._locked():
                    gc.collect()  # the finalizer runs here, in this thread, under the lock
                    assert r.released
                done.set()
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        gc.disable()
        try:
            t = threading.Thread(target=under_the_lock, daemon=True)
            t.start()
            t.join(20)
        finally:
            gc.enable()
        assert not errors, errors
        assert done.is_set(), "the finalizer re-entered the node lock: self-deadlock"
        assert led.usage().reserved == 0  # applied on the way out
        led.reserve(4 * MiB, timeout=1).release()


def test_a_finalizer_of_one_handle_inside_another_handles_section(where: str) -> None:
    """The same across two handles of one ledger in one process (a Checkpointer's ledger
    beside a DefaultStager's): handle A's arena finalizer runs while this thread is in
    handle B's node-lock section (or opening a third handle): the flock is this
    process's already, so A's release is deferred and applied once B's section ends."""
    import weakref

    with NodeLedger.open(4 * MiB, path=where) as a, NodeLedger.open(4 * MiB, path=where) as b:

        class Arena:
            pass

        def garbage(r: Any) -> None:
            arena = Arena()
            weakref.finalize(arena, r.release)
            cycle: list[Any] = [arena]
            cycle.append(cycle)

        outcome: list[Any] = []
        real_scan = ledger_files.scan

        def collecting_scan(path: str, own: str) -> Any:
            gc.collect()  # a collection while the node lock is held (the scan runs under it)
            return real_scan(path, own)

        def run() -> None:
            try:
                garbage(a.reserve(3 * MiB, timeout=1, what="a's arena"))
                with b._locked():
                    gc.collect()  # a's finalizer, inside b's section
                outcome.append(b.usage().reserved)
                garbage(a.reserve(2 * MiB, timeout=1, what="a's arena"))
                with mock.patch.object(ledger_mod, "scan", collecting_scan):
                    c = NodeLedger.open(4 * MiB, path=where)  # a's finalizer runs in its scan
                c.close()
                outcome.append(b.usage().reserved)
            except BaseException as exc:  # noqa: BLE001 - reported below
                outcome.append(exc)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(20)
        assert not t.is_alive(), "a finalizer took the node lock its thread held: self-deadlock"
        assert outcome == [0, 0], outcome
        assert a.held == 0 and b.usage().reserved == 0


def test_finalizers_in_many_threads_give_every_byte_back_once(where: str) -> None:
    """Releases from finalizers, run by collections in any thread (some of them inside
    another thread's node-lock section), while threads reserve: every byte comes back,
    none twice, and the sum never passes the budget."""
    import weakref

    with NodeLedger.open(16 * MiB, path=where) as led:
        stop = threading.Event()
        grants = [0] * 4

        class Box:
            pass

        def churn(i: int) -> None:
            while not stop.is_set() and sum(grants) < 48:
                r = led.try_reserve(MiB)
                if r is None:
                    gc.collect()  # the garbage below holds the budget until collected
                    # A pause: threads spinning on try_reserve would keep taking the
                    # handle's mutex, and a finalizer's release (which needs it) starves.
                    time.sleep(0.001)
                    continue
                grants[i] += 1
                b = Box()
                weakref.finalize(b, r.release)
                loop: list[Any] = [b]
                loop.append(loop)
                del b, loop, r

        threads = [threading.Thread(target=churn, args=(i,), daemon=True) for i in range(4)]
        old = gc.get_threshold()
        gc.set_threshold(50)  # collections often, inside the lock sections too
        try:
            for t in threads:
                t.start()
            # Until the budget went round three times (a count, not a time: collections
            # in a big heap are slow on a loaded machine), within a hang guard.
            deadline = time.monotonic() + 60
            while sum(grants) < 48 and time.monotonic() < deadline:
                time.sleep(0.05)
            stop.set()
            for t in threads:
                t.join(30)
        finally:
            gc.set_threshold(*old)
        gc.collect()
        assert sum(grants) > 16  # the budget was given back and granted again
        assert led.usage().reserved == 0 and led.held == 0


@pytest.mark.anyio
async def test_checkpointer_takes_a_pathlike_node_budget_path(anyio_backend: Any, tmp_path: Path) -> None:
    """``node_budget_path=Path(...)`` as for Stager (the docs say "as for Stager")."""
    where = tmp_path / "led"
    async with Checkpointer(tmp_path / "ck", node_budget_bytes=64 * MiB, node_budget_path=where) as ck:
        assert ck.options.node_budget_path == str(where)
        await ck.save({"w": torch.arange(8.0)}, step=1)
        await ck.wait()
        assert ck.last is not None and ck.last.admission is not None
    with pytest.raises(InvalidOptionError, match="node_budget_path"):
        Checkpointer(tmp_path / "ck", node_budget_bytes=64 * MiB, node_budget_path=3)  # type: ignore[arg-type]
