"""Memory snapshots replicated to the other node's agent (issue 45, sections 1 and 3).

Two "nodes" on this machine, each with its own agent (its own runtime folder) and one
rank (``replica_child.py``): every step is saved to memory and replicated to the other
node. One node is lost whole (its rank and its agent, SIGKILL) and started again with a
fresh, empty agent: both ranks resume from memory, the lost node's rank from the
replica on the other node, at the last step replicated, bit-exact with an uninterrupted
run (the child checks). The faults (a node lost mid-replication, the peer's agent lost,
both nodes lost, the peer's memory bound) and the two torchrun launches are
``test_replication_faults.py`` (slow).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from async_stager._tier.replica import Pacer, Replication, ring
from async_stager.errors import InvalidOptionError
from tests.tier.helpers_tier import short_base
from tests.tier.replica_job import WAIT, InProcessAgent, free_port, rank


def test_ring_places_each_node_on_the_next() -> None:
    a, b, c = ("h1", "/s"), ("h2", "/s"), ("h3", "/s")
    # Two nodes of two ranks: each rank's replica on the same local rank of the other node.
    assert ring([a, a, b, b]) == {0: 2, 1: 3, 2: 0, 3: 1}
    # Three nodes: a ring; a smaller node takes several.
    assert ring([a, b, c]) == {0: 1, 1: 2, 2: 0}
    assert ring([a, a, b]) == {0: 2, 1: 2, 2: 0}
    # One node (every rank on one agent): no replica anywhere.
    assert ring([a, a]) == {}
    # Two agents on one host are two nodes (a node is the agent a rank talks to).
    assert ring([("h", "/x"), ("h", "/y")]) == {0: 1, 1: 0}


def test_pacing_and_its_options() -> None:
    waited: list[float] = []

    class Stop:
        def wait(self, seconds: float) -> bool:
            waited.append(seconds)
            return False

    pacer = Pacer(Replication(share=0.25), Stop())  # type: ignore[arg-type]
    pacer.after(1000, 0.1)  # busy 0.1 s: idle 0.3 s, a quarter of the time on the link
    assert waited == [pytest.approx(0.3)]
    capped = Pacer(Replication(share=1.0, rate=1000.0), Stop())  # type: ignore[arg-type]
    capped.after(500, 0.1)  # 500 bytes at 1000 B/s: 0.5 s in all
    assert waited[-1] == pytest.approx(0.4)
    assert pacer.sent == 1000 and pacer.busy == pytest.approx(0.1)
    for bad in ({"share": 0}, {"share": 1.5}, {"rate": -1.0}, {"chunk_bytes": 0}):
        with pytest.raises(InvalidOptionError):
            Replication(**bad)  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_replicate_needs_an_agent(tmp_path: Path) -> None:
    from async_stager import Checkpointer

    with pytest.raises(InvalidOptionError, match="replicate"):
        Checkpointer(tmp_path, replicate=True)
    with pytest.raises(InvalidOptionError, match="replica_share"):
        Checkpointer(tmp_path, agent="j", replicate=True, replica_share=0.0)


@pytest.mark.timeout(240)
def test_a_lost_node_resumes_from_the_peer_replica(tmp_path: Path) -> None:
    with short_base() as base_a, short_base() as base_b:
        # The agents serve from threads of this process (no process start); the slow
        # tests (test_replication_faults.py) run each as a process and SIGKILL it.
        agent_a, agent_b = InProcessAgent("rep", base_a), InProcessAgent("rep", base_b)
        port = free_port()
        r0 = rank(tmp_path, "rep", base_a, 3, "sync", 0, 2, port)
        r1 = rank(tmp_path, "rep", base_b, 3, "sync", 1, 2, port)
        try:
            done = r1.wait_for("DONE", r0)
            r0.wait_for("DONE", r1)
            assert r0.replicated() == r1.replicated() == 3, (r0.lines, r1.lines)
            assert "peer=0" in done and "replicated=3" in done, done
            # Node B lost whole: its rank and its agent. The job's other rank goes too
            # (its collectives fail); node A's agent stays.
            r1.kill()
            agent_b.kill()
            r0.kill()
            agent_b = InProcessAgent("rep", base_b)  # a fresh, empty agent
            port = free_port()
            r0 = rank(tmp_path, "rep", base_a, 5, "sync", 0, 2, port, EXIT="1")
            r1 = rank(tmp_path, "rep", base_b, 5, "sync", 1, 2, port, EXIT="1")
            r0.wait_for("DONE", r1)
            r1.wait_for("DONE", r0)
            # Both close the Checkpointer (replication ends cleanly on both sides) and exit.
            assert r0.proc.wait(WAIT) == 0 and r1.proc.wait(WAIT) == 0, (r0.lines, r1.lines)
            assert r0.first("CLOSED") is not None and r1.first("CLOSED") is not None
            assert r0.restored() == (3, "memory"), r0.lines
            assert r1.restored() == (3, "peer"), r1.lines
            # Replication goes on after the restore, both ways.
            assert r0.replicated() == r1.replicated() == 5, (r0.lines, r1.lines)
        finally:
            for p in (r0, r1, agent_a, agent_b):
                p.kill()
