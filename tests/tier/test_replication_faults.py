"""Replication's faults, and two torchrun launches as two nodes (issue 45, section 3).

Each "node" is its own agent (its own runtime folder) and its ranks (``replica_child``):
- a node lost in the middle of a replica: the torn replica never restores, the one
  before it does (the lost node's rank from the other node's replica);
- the peer's agent lost: after a process crash the other node's rank restores from its
  own agent and the lost agent's rank from its replica; replication goes on once the
  agent is back;
- both nodes lost (agents too): the folder's newest commit;
- the peer's memory bound: the replica is not held, a warning says why, it is counted;
- two ``torchrun --nnodes 2`` launches of 2 ranks each on a c10d rendezvous on
  localhost: one node killed whole (launcher, ranks, agent) and the job started again,
  that node with an empty agent; it resumes from the replicas, bit-exact, with no step
  lost (each step waits for its replica here).
Heavy process tests: CI's second call (slow). The lean one is test_replication.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.tier.helpers_tier import child_env, short_base
from tests.tier.replica_job import CHILD, WAIT, Proc, agent, free_port, rank

pytestmark = pytest.mark.slow


def _pair(tmp: Path, a: str, b: str, steps: int, mode: str, **env: str) -> tuple[Proc, Proc]:
    port = free_port()
    return rank(tmp, "rep", a, steps, mode, 0, 2, port, **env), rank(
        tmp, "rep", b, steps, mode, 1, 2, port, **env
    )


def _wait(pred: object, procs: list[Proc], what: str) -> None:
    end = time.monotonic() + WAIT
    while not pred():  # type: ignore[operator]
        for p in procs:
            assert p.proc.poll() is None, f"exited before {what}: {p.lines}"
        assert time.monotonic() < end, f"no {what}: {[p.lines for p in procs]}"
        time.sleep(0.01)


@pytest.mark.timeout(300)
def test_a_node_lost_mid_replication_restores_the_replica_before(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    with short_base() as ba, short_base() as bb:
        aa, ab = agent("rep", ba), agent("rep", bb)
        # Rank 1's replica: 17 MiB in chunks of 4 MiB paced to 4 MB/s: node B dies
        # while one is on the wire.
        r0, r1 = _pair(ckpt, ba, bb, 10**6, "mid", RATE="4000000", BIG="1")
        try:

            def sending_after_one() -> bool:
                done = r1.replicated()
                last = r1.last("REPLICATING")
                return done is not None and last is not None and int(last[0]) > done

            _wait(sending_after_one, [r0, r1], "a replica in flight after one verified")
            verified = r1.replicated()
            sending = r1.last("REPLICATING") or ["0"]
            torn = int(sending[0])
            # in_flight() and status_line() show the replica on the wire.
            assert f"step {torn}: memory-replicating" in " ".join(sending), sending
            for p in (r1, ab, r0):
                p.kill()
            ab = agent("rep", bb)
            r0, r1 = _pair(ckpt, ba, bb, 0, "sync")
            r0.wait_for("DONE", r1)
            r1.wait_for("DONE", r0)
            assert r1.restored() == (verified, "peer"), (verified, torn, r1.lines)
            assert r0.restored() == (verified, "memory"), r0.lines
            assert verified is not None and verified < torn
        finally:
            for p in (r0, r1, aa, ab):
                p.kill()


@pytest.mark.timeout(300)
def test_the_peer_agent_lost(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    with short_base() as ba, short_base() as bb:
        aa, ab = agent("rep", ba), agent("rep", bb)
        r0, r1 = _pair(ckpt, ba, bb, 3, "sync")
        try:
            r0.wait_for("DONE", r1)
            r1.wait_for("DONE", r0)
            ab.kill()  # node B's agent alone: its rank's snapshots are gone, its replicas too
            # A process crash of the job: rank 0's own snapshots serve it; rank 1's
            # replica on node A serves rank 1.
            r0.kill()
            r1.kill()
            r0, r1 = _pair(ckpt, ba, bb, 5, "sync")
            r0.wait_for("RESTORED", r1)
            r1.wait_for("RESTORED", r0)
            assert r0.restored() == (3, "memory"), r0.lines
            assert r1.restored() == (3, "peer"), r1.lines
            # No agent on node B: rank 1's memory tier is off (it retries 30 s later), so
            # the job's common step stays and no replica is decided; none is verified.
            done0 = r0.wait_for("DONE", r1)
            assert "replicated=0" in done0, done0
            r0.kill()
            r1.kill()
            ab = agent("rep", bb)  # the agent is back: replication resumes
            r0, r1 = _pair(ckpt, ba, bb, 8, "sync")
            r0.wait_for("DONE", r1)
            r1.wait_for("DONE", r0)
            assert r0.restored()[0] == 3 and r1.restored()[0] == 3, (r0.lines, r1.lines)
            assert r0.replicated() == r1.replicated() == 8, (r0.lines, r1.lines)
        finally:
            for p in (r0, r1, aa, ab):
                p.kill()


@pytest.mark.timeout(300)
def test_both_nodes_lost_restore_from_disk(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    with short_base() as ba, short_base() as bb:
        aa, ab = agent("rep", ba), agent("rep", bb)
        r0, r1 = _pair(ckpt, ba, bb, 5, "sync", PERSIST="2")
        try:
            r0.wait_for("DONE", r1)
            r1.wait_for("DONE", r0)
            for p in (r0, r1, aa, ab):
                p.kill()
            aa, ab = agent("rep", ba), agent("rep", bb)
            r0, r1 = _pair(ckpt, ba, bb, 5, "sync", PERSIST="2")
            r0.wait_for("DONE", r1)
            r1.wait_for("DONE", r0)
            assert r0.restored() == r1.restored() == (4, "disk"), (r0.lines, r1.lines)
        finally:
            for p in (r0, r1, aa, ab):
                p.kill()


@pytest.mark.timeout(300)
def test_the_peer_memory_bound(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    with short_base() as ba, short_base() as bb:
        # Node B's agent holds rank 1's own snapshots (1 MiB arenas), never rank 0's
        # 17 MiB replica.
        aa, ab = agent("rep", ba), agent("rep", bb, "--max-bytes", "12MiB")
        r0, r1 = _pair(ckpt, ba, bb, 3, "sync", BIG="0")
        try:
            done0 = r0.wait_for("DONE", r1)
            done1 = r1.wait_for("DONE", r0)
            assert "replicated=0" in done0 and "skipped=3" in done0, done0
            assert "replicated=3" in done1 and "skipped=0" in done1, done1
            err = (tmp_path / "rank0.err").read_text()
            assert "has reached its memory bound" in err and "replication of step 1 skipped" in err, err
        finally:
            for p in (r0, r1, aa, ab):
                p.kill()


# -- two torchrun launches, two nodes of two ranks -------------------------------------


def _tree(pid: int) -> list[int]:
    """``pid`` and every process below it (torchrun starts its workers in sessions of
    their own: a process group kill would miss them)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
            children.setdefault(ppid, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _kill_tree(p: Proc) -> None:
    for pid in _tree(p.proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.kill()


def _node(ckpt: Path, base: str, port: int, host: bool, steps: int) -> Proc:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes",
        "--rdzv-conf", f"is_host={int(host)}", "--max-restarts", "3", "--monitor-interval", "0.2",
        str(CHILD), str(ckpt), "rep", base, str(steps), "sync",
    ]  # fmt: skip
    with open(ckpt.parent / f"node{'A' if host else 'B'}.err", "a") as err:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=dict(child_env(), OMP_NUM_THREADS="1"),
            start_new_session=True,
        )  # fmt: skip
    return Proc(proc).start_reading()


def _of(node: Proc, r: int, word: str, last: bool = False) -> list[str] | None:
    lines = [ln.split()[1:] for ln in list(node.lines) if ln.startswith(f"R{r} ")]
    found = [ln[1:] for ln in lines if ln[:1] == [word]]
    return (found[-1] if last else found[0]) if found else None


@pytest.mark.timeout(600)
def test_two_torchrun_nodes_one_lost_whole(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    port = free_port()
    with short_base() as ba, short_base() as bb:
        aa, ab = agent("rep", ba), agent("rep", bb)
        na = _node(ckpt, ba, port, True, 3)
        time.sleep(1.0)  # node A hosts the rendezvous store
        nb = _node(ckpt, bb, port, False, 3)
        try:
            _wait(
                lambda: all(_of(n, r, "DONE") for n, r in ((na, 0), (na, 1), (nb, 2), (nb, 3))),
                [na, nb],
                "DONE",
            )
            assert all(
                _of(n, r, "REPLICATED", last=True) == ["3"] for n, r in ((na, 0), (na, 1), (nb, 2), (nb, 3))
            )
            # Node B lost whole: its launcher, its ranks, its agent. The job is restarted
            # (node A's launcher hosted the rendezvous: both launchers start again, as a
            # scheduler's requeue does); node A's agent stays, node B's is fresh and empty.
            _kill_tree(nb)
            _kill_tree(ab)
            _kill_tree(na)
            ab = agent("rep", bb)
            port = free_port()
            na = _node(ckpt, ba, port, True, 3)
            time.sleep(1.0)
            nb = _node(ckpt, bb, port, False, 3)
            _wait(
                lambda: all(_of(n, r, "DONE") for n, r in ((na, 0), (na, 1), (nb, 2), (nb, 3))),
                [na, nb],
                "DONE",
            )
            got = {r: _of(n, r, "RESTORED") for n, r in ((na, 0), (na, 1), (nb, 2), (nb, 3))}
            assert got == {0: ["3", "memory"], 1: ["3", "memory"], 2: ["3", "peer"], 3: ["3", "peer"]}, got
        finally:
            for p in (na, nb):
                _kill_tree(p)
            for p in (aa, ab):
                p.kill()
