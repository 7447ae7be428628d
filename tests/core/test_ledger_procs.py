"""The node ledger across real processes: 4 processes reserving and releasing in a loop
never show more than the budget (a sampler reads the ledger all along), a SIGKILLed
holder's bytes are reclaimed and the others go on, a forked child keeping a dead
parent's lock does not keep its bytes, and unequal requests and timings all get served
(each process's longest wait is printed; ``-s`` shows them).

The children load the ledger without the package's ``__init__`` (which imports torch,
seconds per process on a small machine): ``ledger.py`` needs only ``errors.py``. The
stress versions (more rounds, more processes) are behind the ``stress`` marker.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import async_stager
from async_stager._core.memory.ledger import NodeLedger
from async_stager.errors import NodeBudgetError

pytestmark = pytest.mark.timeout(120)

PKG = os.path.dirname(async_stager.__file__)

CHILD = textwrap.dedent(
    """
    import json, os, sys, time, types
    # The ledger without the package's __init__ (no torch): stub the packages.
    for name, sub in (("async_stager", ""), ("async_stager._core", "_core"),
                      ("async_stager._core.memory", "_core/memory")):
        m = types.ModuleType(name)
        m.__path__ = [os.path.join(PKG, sub)]
        sys.modules[name] = m
    from async_stager._core.memory.ledger import NodeLedger

    path, budget, role, *args = sys.argv[1:]
    ledger = NodeLedger.open(int(budget), path=path)
    if role == "hold":
        ledger.reserve(int(args[0]), timeout=30, what="held until killed")
        if len(args) > 1 and args[1] == "fork":
            if os.fork() == 0:  # the child keeps the lock of the parent's slot
                time.sleep(600)
                os._exit(0)
        print("held", flush=True)
        time.sleep(600)
    elif role == "loop":
        rounds, sizes, holds = int(args[0]), [int(s) for s in args[1].split(",")], [float(h) for h in args[2].split(",")]
        worst = total = 0.0
        for i in range(rounds):
            t0 = time.monotonic()
            r = ledger.reserve(sizes[i % len(sizes)], timeout=60, what=f"pid {os.getpid()} round {i}")
            waited = time.monotonic() - t0
            worst, total = max(worst, waited), total + waited
            time.sleep(holds[i % len(holds)])
            r.release()
        print(json.dumps({"pid": os.getpid(), "rounds": rounds, "max_wait": worst, "total_wait": total}), flush=True)
    ledger.close()
    """
).replace("PKG", repr(PKG))


def spawn(path: str, budget: int, *args: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, path, str(budget), *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def sample_until_done(
    led: NodeLedger, procs: list[subprocess.Popen[str]], budget: int, bound: float = 100.0
) -> tuple[int, int]:
    """Read the ledger until every process has exited: no sample shows more than the
    budget. Returns (samples, the most reserved in one sample). The children are
    killed if it fails."""
    samples = most = 0
    deadline = time.monotonic() + bound
    try:
        while any(p.poll() is None for p in procs):
            assert time.monotonic() < deadline, "children did not finish"
            u = led.usage()
            assert u.reserved <= budget, u
            assert sum(u.by_pid.values()) == u.reserved
            samples += 1
            most = max(most, u.reserved)
            time.sleep(0.001)
    except BaseException:
        for p in procs:
            p.kill()
            p.communicate()
        raise
    return samples, most


def results(procs: list[subprocess.Popen[str]]) -> list[dict[str, float]]:
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=30)
        assert p.returncode == 0, stderr
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def run_loops(
    path: str, budget: int, plans: list[tuple[int, str, str]], bound: float = 100.0
) -> list[dict[str, float]]:
    with NodeLedger.open(budget, path=path) as led:
        procs = [spawn(path, budget, "loop", *plan) for plan in plans]
        samples, most = sample_until_done(led, procs, budget, bound)
        res = results(procs)
        assert led.usage().reserved == 0 and led.usage().peak <= budget
    for plan, r in zip(plans, res, strict=True):
        assert r["rounds"] == plan[0]
        print(
            f"sizes {plan[1]:>12} holds {plan[2]:>14}: max wait {r['max_wait'] * 1e3:7.1f} ms, "
            f"total {r['total_wait'] * 1e3:8.1f} ms over {plan[0]} rounds"
        )
    print(f"{samples} samples, most reserved at once {most} of {budget}")
    return res


def test_four_processes_unequal_sizes_and_timings_never_exceed_and_none_starves(tmp_path: Path) -> None:
    """Sizes from a tenth to nine tenths of the budget, holds from 0 to 3 ms: every
    process gets through all its rounds (a big request is not starved by the small
    ones, nor the small ones by the big), and the sampler never sees the budget passed."""
    plans = [
        (40, "900", "0.002"),
        (80, "100,300", "0,0.001"),
        (80, "200", "0.003"),
        (60, "500,100", "0.001,0"),
    ]
    run_loops(str(tmp_path / "led"), 1000, plans)


@pytest.mark.stress
@pytest.mark.timeout(600)
def test_stress_eight_processes_many_rounds(tmp_path: Path) -> None:
    plans = [(150, "900", "0.001")] + [(400, f"{50 * k},{100 * k}", f"0,{0.0005 * k}") for k in range(1, 8)]
    run_loops(str(tmp_path / "led"), 1000, plans, bound=500)


def wait_reclaimed(led: NodeLedger, pid: int, bound: float = 20.0) -> float:
    t0 = time.monotonic()
    while pid in led.usage().by_pid:
        assert time.monotonic() - t0 < bound, f"pid {pid}'s bytes not reclaimed in {bound} s"
        time.sleep(0.001)
    return time.monotonic() - t0


def test_a_sigkilled_holder_is_reclaimed_and_the_others_go_on(tmp_path: Path) -> None:
    path, budget = str(tmp_path / "led"), 1000
    with NodeLedger.open(budget, path=path) as led:
        holder = spawn(path, budget, "hold", 700)
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        # Two others need 400 each: they queue behind the holder's 700.
        loops = [spawn(path, budget, "loop", 20, "400", "0.001") for _ in range(2)]
        deadline = time.monotonic() + 30
        while len(led.usage().waiting) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        assert led.usage().reserved == 700
        os.kill(holder.pid, signal.SIGKILL)
        holder.communicate(timeout=10)
        took = wait_reclaimed(led, holder.pid)
        print(f"reclaimed {took * 1e3:.1f} ms after the SIGKILL")
        sample_until_done(led, loops, budget)
        assert all(r["rounds"] == 20 for r in results(loops))
        assert led.usage().reserved == 0


def test_a_forked_child_keeping_a_dead_parents_lock_does_not_keep_its_bytes(tmp_path: Path) -> None:
    """The parent (which reserved) is SIGKILLed; its forked child lives on holding the
    slot's lock: the pid's start time in /proc tells the slot is dead."""
    path, budget = str(tmp_path / "led"), 1000
    with NodeLedger.open(budget, path=path) as led:
        parent = spawn(path, budget, "hold", 600, "fork")
        assert parent.stdout is not None and parent.stdout.readline().strip() == "held"
        kids = [int(p) for p in Path(f"/proc/{parent.pid}/task/{parent.pid}/children").read_text().split()]
        assert len(kids) == 1
        try:
            os.kill(parent.pid, signal.SIGKILL)
            parent.wait(10)  # reaped: the pid no longer runs
            assert led.usage().reserved == 0  # reclaimed by this very read
            assert led.try_reserve(1000) is not None
        finally:
            os.kill(kids[0], signal.SIGKILL)
            parent.communicate(timeout=10)  # the pipes close with the child


def test_a_damaged_slot_of_another_live_process_keeps_its_bytes_until_it_dies(tmp_path: Path) -> None:
    """Another process holds 700 of 1000 and sits idle; its slot file is damaged (a byte
    flipped, then truncated). This process's scans keep it and count it as holding all
    the rest (nothing is granted, the wait's error says why); once the holder is
    SIGKILLed, its damaged slot is a dead process's and is reclaimed at once."""
    path, budget = str(tmp_path / "led"), 1000
    with NodeLedger.open(budget, path=path) as led:
        holder = spawn(path, budget, "hold", 700)
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
            [slot] = [p for p in Path(path).glob(f"slot-{holder.pid}-*")]
            data = bytearray(slot.read_bytes())
            data[40] ^= 0x01
            slot.write_bytes(bytes(data))
            assert led.try_reserve(400) is None and led.try_reserve(1) is None
            u = led.usage()
            assert u.damaged == (holder.pid,) and u.reserved == budget
            slot.write_bytes(bytes(data[:10]))  # truncated
            with pytest.raises(NodeBudgetError, match="damaged"):
                led.reserve(300, timeout=0.3)
            assert slot.exists()
        finally:
            os.kill(holder.pid, signal.SIGKILL)
            holder.communicate(timeout=10)
        wait_reclaimed(led, holder.pid)
        assert led.usage().damaged == () and not slot.exists()
        led.reserve(budget, timeout=5).release()
