"""The node ledger (``_core/memory/ledger.py``) in one process: reserve and release,
refusal of what exceeds the budget, bounded waits and their error, FIFO order, the
budget every opener must agree on, the files on disk and what a dead writer leaves.
Several processes: test_ledger_procs.py."""

from __future__ import annotations

import os
import pickle
import struct
import threading
import time
from pathlib import Path

import pytest

from async_stager._core.memory import ledger_files
from async_stager._core.memory.ledger import LedgerUsage, NodeLedger, default_path, job_identity
from async_stager.errors import ClosedError, HostLimitError, InvalidOptionError, NodeBudgetError

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def where(tmp_path: Path) -> str:
    return str(tmp_path / "ledger")


def wait_until(cond, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def test_reserve_release_and_usage(where: str) -> None:
    with NodeLedger.open(1000, path=where) as a, NodeLedger.open(1000, path=where) as b:
        r1 = a.reserve(300, timeout=1, what="one")
        r2 = b.reserve(500, timeout=1, what="two")
        u = a.usage()
        assert isinstance(u, LedgerUsage)
        assert (u.budget, u.reserved, u.free, u.peak) == (1000, 800, 200, 800)
        assert u.by_pid == {os.getpid(): 800} and u.waiting == ()
        assert b.try_reserve(201) is None  # does not fit; no ticket left behind
        assert a.usage().waiting == ()
        r1.release()
        r1.release()  # idempotent
        assert r1.released and a.held == 0 and b.held == 500
        r3 = b.try_reserve(500, "three")
        assert r3 is not None
        with r3:
            assert a.usage().reserved == 1000
        assert a.usage().reserved == 500
        r2.release()
        assert a.usage().reserved == 0 and a.usage().peak == 1000


def test_one_process_is_a_plain_budget(where: str) -> None:
    """With one process: what fits is granted at once, what does not waits for this
    process's own releases (from another thread), and the sum never passes the budget."""
    with NodeLedger.open(100, path=where) as led:
        held = [led.reserve(40, timeout=1) for _ in range(2)]
        threading.Timer(0.05, held[0].release).start()
        r = led.reserve(60, timeout=20)  # granted once the first 40 come back
        assert led.usage().reserved == 100
        r.release()
        held[1].release()


def test_more_than_the_budget_is_refused_at_once(where: str) -> None:
    with NodeLedger.open(1000, path=where) as led:
        t0 = time.monotonic()
        with pytest.raises(NodeBudgetError) as e:
            led.reserve(1001, timeout=None, what="sd['w']")
        assert time.monotonic() - t0 < 10  # no wait (the bound only catches a hang)
        err = e.value
        assert isinstance(err, HostLimitError)
        assert (err.need, err.limit, err.waited, err.what) == (1001, 1000, 0.0, "sd['w']")
        assert "1001 bytes" in str(err) and "node_budget_bytes=1000" in str(err)
        with pytest.raises(NodeBudgetError):
            led.try_reserve(1001)
        assert led.usage().reserved == 0


def test_a_bounded_wait_raises_what_was_waited_for_and_who_holds(where: str) -> None:
    with NodeLedger.open(1000, path=where) as a, NodeLedger.open(1000, path=where) as b:
        r = a.reserve(700, timeout=1, what="holder")
        with pytest.raises(NodeBudgetError) as e:
            b.reserve(400, timeout=0.05, what="buffer set 1")
        err = e.value
        assert err.need == 400 and err.limit == 300 and err.waited >= 0.05
        assert err.holders == {os.getpid(): 700}
        assert "buffer set 1" in str(err) and f"pid {os.getpid()}: 700" in str(err)
        # The ticket went with the error: nothing waits, the next request is served.
        assert a.usage().waiting == ()
        r.release()
        b.reserve(400, timeout=1).release()
        again = pickle.loads(pickle.dumps(err))
        assert (again.need, again.holders, again.what) == (400, {os.getpid(): 700}, "buffer set 1")


def test_stop_ends_a_wait_and_withdraws_the_ticket(where: str) -> None:
    with NodeLedger.open(100, path=where) as a, NodeLedger.open(100, path=where) as b:
        a.reserve(100, timeout=1)
        calls = []

        def stop() -> None:
            calls.append(1)
            if len(calls) > 3:
                raise ClosedError("closed")

        with pytest.raises(ClosedError):
            b.reserve(10, timeout=None, stop=stop)
        assert a.usage().waiting == ()


def test_fifo_a_small_request_does_not_overtake_a_big_one(where: str) -> None:
    """A holds 60 of 100; B waits for 80 (a ticket); C's 10 would fit but must queue
    behind B; when A releases, B is served first, then C."""
    with (
        NodeLedger.open(100, path=where) as a,
        NodeLedger.open(100, path=where) as b,
        NodeLedger.open(100, path=where) as c,
    ):
        ra = a.reserve(60, timeout=1)
        got: dict[str, float] = {}

        def want(led: NodeLedger, n: int, name: str) -> None:
            led.reserve(n, timeout=30, what=name)
            got[name] = time.monotonic()

        tb = threading.Thread(target=want, args=(b, 80, "big"))
        tb.start()
        wait_until(lambda: [t.nbytes for t in a.usage().waiting] == [80], "the big ticket")
        assert c.try_reserve(10) is None  # fits, but B is ahead
        tc = threading.Thread(target=want, args=(c, 10, "small"))
        tc.start()
        wait_until(lambda: [t.nbytes for t in a.usage().waiting] == [80, 10], "the small ticket")
        u = a.usage()
        assert u.waiting[0].order < u.waiting[1].order and u.waiting[0].what == "big"
        assert "small" not in got
        ra.release()
        tb.join(30)
        tc.join(30)
        assert got["big"] <= got["small"]
        assert a.usage().reserved == 90


def test_threads_of_one_handle_take_turns(where: str) -> None:
    with NodeLedger.open(100, path=where) as led:
        first = led.reserve(100, timeout=1)
        done = []
        threads = [
            threading.Thread(target=lambda: done.append(led.reserve(50, timeout=30))) for _ in range(2)
        ]
        for t in threads:
            t.start()
        wait_until(lambda: len(led.usage().waiting) == 1, "one ticket")
        assert led.try_reserve(1) is None  # a thread of this handle waits ahead
        first.release()
        for t in threads:
            t.join(30)
        assert len(done) == 2 and led.usage().reserved == 100


def test_every_opener_gives_the_same_budget(where: str) -> None:
    with (
        NodeLedger.open(1000, path=where),
        pytest.raises(InvalidOptionError, match="node_budget_bytes=999 differs from the 1000"),
    ):
        NodeLedger.open(999, path=where)
    # Nobody has it open any more: a new job with the same identity starts afresh.
    with NodeLedger.open(999, path=where) as led:
        assert led.usage().budget == 999 and led.usage().peak == 0


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1000"])
def test_budget_must_be_a_positive_integer(where: str, bad: object) -> None:
    with pytest.raises(InvalidOptionError, match="node_budget_bytes"):
        NodeLedger.open(bad, path=where)  # type: ignore[arg-type]


def test_close_gives_everything_back_and_the_last_one_out_removes_the_files(where: str) -> None:
    a = NodeLedger.open(1000, path=where)
    b = NodeLedger.open(1000, path=where)
    r = a.reserve(600, timeout=1)
    a.close()
    a.close()  # idempotent
    r.release()  # a no-op after close
    assert b.usage().reserved == 0 and Path(where).is_dir()
    with pytest.raises(ClosedError):
        a.reserve(1, timeout=1)
    b.close()
    assert not Path(where).exists()


def test_the_files_on_disk(where: str) -> None:
    with NodeLedger.open(1000, path=where) as led:
        led.reserve(123, timeout=1)
        names = sorted(os.listdir(where))
        assert names[:3] == ["budget", "lock", "peak"] and len(names) == 4
        assert names[3].startswith(f"slot-{os.getpid()}-")
        assert Path(where, "budget").read_text() == '{"format": 2, "budget_bytes": 1000}'
        rec = ledger_files.Record.unpack(Path(where, names[3]).read_bytes())
        assert rec is not None and (rec.pid, rec.reserved, rec.ticket) == (os.getpid(), 123, 0)


def test_dead_and_torn_slots_are_reclaimed(where: str) -> None:
    """A slot nobody holds the lock of (its process died), one whose CRC fails (a
    writer killed mid-record), and a half-made one (``.new``) are removed by the next
    update; their bytes never count."""
    with NodeLedger.open(1000, path=where) as led:
        dead = ledger_files.Record(pid=os.getpid(), start=1, reserved=900, ticket=5, ticket_bytes=1)
        Path(where, "slot-1-1-1").write_bytes(dead.pack())
        torn = bytearray(dead.pack())
        torn[20] ^= 0xFF
        Path(where, "slot-2-2-2").write_bytes(bytes(torn))
        Path(where, "slot-3-3-3.new").write_bytes(b"")
        assert led.usage().reserved == 0
        assert led.reserve(1000, timeout=1).nbytes == 1000
        assert [n for n in os.listdir(where) if n.startswith("slot-")] == [os.path.basename(led._slot)]


def test_a_live_slot_with_a_stale_start_time_is_reclaimed(where: str) -> None:
    """A slot whose lock is held but whose pid runs with another start time (the pid
    reused, or a forked child keeping a dead parent's lock) is a dead process's."""
    import fcntl

    with NodeLedger.open(1000, path=where) as led:
        stale = ledger_files.Record(
            pid=os.getpid(), start=ledger_files.start_time(os.getpid()) + 1, reserved=900
        )
        fd = os.open(os.path.join(where, "slot-9-9-9"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.pwrite(fd, stale.pack(), 0)
            fcntl.flock(fd, fcntl.LOCK_EX)
            assert led.usage().reserved == 0
        finally:
            os.close(fd)


def test_the_peak_survives_a_torn_peak_file(where: str) -> None:
    with NodeLedger.open(1000, path=where) as led:
        led.reserve(400, timeout=1).release()
        assert led.usage().peak == 400
        Path(where, "peak").write_bytes(struct.pack("<8sqI", b"ASLEDG01", 999, 0))  # bad CRC
        assert led.usage().peak == 0
        led.reserve(10, timeout=1)
        assert led.usage().peak == 10


def test_job_identity_and_the_default_place(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert job_identity() is None
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert job_identity() == "master-10.0.0.1:29500"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    assert job_identity() == "torchelastic-abc"
    assert job_identity("mine") == "mine"  # an explicit name wins
    p = default_path("torchelastic-abc")
    root = "/dev/shm" if os.path.isdir("/dev/shm") else None
    if root:
        assert os.path.dirname(p) == root
    assert f"-{os.getuid()}-" in os.path.basename(p)
    assert default_path("a/b c") != default_path("a_b_c")  # names are hashed, not only cleaned


def test_no_job_identity_is_an_error_naming_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(InvalidOptionError, match="node_budget_job="):
        NodeLedger.open(1000)


def test_found_by_the_job_name(monkeypatch: pytest.MonkeyPatch) -> None:
    job = f"test-ledger-{os.getpid()}-{time.monotonic_ns()}"
    with NodeLedger.open(1000, job=job) as a, NodeLedger.open(1000, job=job) as b:
        assert a.path == b.path == default_path(job)
        a.reserve(600, timeout=1)
        assert b.try_reserve(600) is None
    assert not os.path.exists(default_path(job))
