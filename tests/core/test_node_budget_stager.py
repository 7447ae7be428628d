"""A Stager with a node budget (``node_budget_bytes``): every host arena is reserved
from the node ledger before it is mapped and given back when unmapped; cached sets stay
counted; ``trim()`` and closing give the bytes back; a stage that cannot get its bytes
in ``buffer_wait_timeout`` raises NodeBudgetError and the stager stays usable; two
Stagers in two processes share one budget; the pre-flight judges the node."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from async_stager import ClosedError, InvalidOptionError, Stager
from async_stager._core.memory import preflight as preflight_mod
from async_stager._core.memory.arena import MIN_ARENA_BYTES
from async_stager._core.memory.host_limits import HostLimits
from async_stager._core.memory.ledger import NodeLedger
from async_stager._core.memory.preflight import Need, check, set_bytes
from async_stager.errors import HostLimitError, InvalidOptionTypeError, NodeBudgetError

pytestmark = pytest.mark.timeout(90)

MiB = 1 << 20


def state(nbytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.rand(nbytes // 8, generator=g), "b": torch.rand(nbytes // 8, generator=g)}


def usage(path: str) -> Any:
    with NodeLedger.open(_budget(path), path=path) as led:
        return led.usage()


def _budget(path: str) -> int:
    import json

    return int(json.loads(Path(path, "budget").read_text())["budget_bytes"])


@pytest.mark.anyio
async def test_arenas_are_reserved_cached_sets_count_and_trim_and_close_give_back(
    anyio_backend: Any, tmp_path: Path
) -> None:
    where = str(tmp_path / "led")
    sd = state(2 * MiB)
    async with Stager(node_budget_bytes=8 * MiB, node_budget_path=where, max_buffer_sets=2) as s:
        assert s.options.node_budget_bytes == 8 * MiB
        staged = await s.stage(sd)
        assert torch.equal(staged["w"], sd["w"])
        assert usage(where).reserved == s.host_bytes == set_bytes([MiB, MiB])
        again = await s.stage(sd)  # the first is still held: a second set
        assert usage(where).reserved == s.host_bytes == 2 * set_bytes([MiB, MiB])
        del staged, again
        # Between checkpoints the cached sets stay mapped, and counted.
        assert usage(where).reserved == s.host_bytes
        released = await s.trim()
        assert released > 0 and s.host_bytes == 0 and usage(where).reserved == 0
        staged = await s.stage(sd)
        assert usage(where).reserved == s.host_bytes > 0
        del staged
    assert not Path(where).exists()  # the stager owned the ledger: closed, last one out


@pytest.mark.anyio
async def test_more_than_the_budget_is_refused_at_once_and_the_stager_stays_usable(
    anyio_backend: Any, tmp_path: Path
) -> None:
    where = str(tmp_path / "led")
    for preflight in (True, False):
        async with Stager(node_budget_bytes=3 * MiB, node_budget_path=where, preflight=preflight) as s:
            with pytest.raises(NodeBudgetError) as e:
                await s.stage(state(4 * MiB))
            assert isinstance(e.value, HostLimitError) and e.value.limit == 3 * MiB
            assert e.value.need >= 4 * MiB and "node budget" in str(e.value)
            assert s.host_bytes == 0
            staged = await s.stage(state(2 * MiB))  # usable: a state that fits
            assert usage(where).reserved == s.host_bytes > 0
            del staged


def test_a_stage_that_cannot_get_its_bytes_in_time_raises_and_the_stager_stays_usable(tmp_path: Path) -> None:
    where = str(tmp_path / "led")

    async def main() -> None:
        with NodeLedger.open(8 * MiB, path=where) as other:
            hog = other.reserve(7 * MiB, timeout=1, what="another rank")
            async with Stager(
                node_budget_bytes=8 * MiB, node_budget_path=where, buffer_wait_timeout=0.2
            ) as s:
                with pytest.raises(NodeBudgetError) as e:
                    await s.stage(state(2 * MiB))
                err = e.value
                assert err.waited >= 0.2 and err.holders == {os.getpid(): 7 * MiB}
                assert "buffer set 0" in err.what and s.host_bytes == 0
                assert other.usage().waiting == ()  # the ticket went with the error
                # Released from another thread while a stage waits: it goes on.
                threading.Timer(0.1, hog.release).start()
                s2 = await Stager(
                    node_budget_bytes=8 * MiB, node_budget_path=where, buffer_wait_timeout=30
                ).__aenter__()
                try:
                    staged = await s2.stage(state(2 * MiB))
                    assert torch.equal(staged["b"], state(2 * MiB)["b"])
                    del staged
                finally:
                    await s2.aclose()
                staged = await s.stage(state(2 * MiB))  # the first stager too
                del staged

    anyio.run(main)


def test_own_idle_sets_are_given_back_before_waiting(tmp_path: Path) -> None:
    """One process whose budget holds one cached set: a stage of a state of another
    layout does not wait for bytes only its own idle set holds (a wait nothing else
    would end): the idle set is trimmed first."""
    where = str(tmp_path / "led")

    async def main() -> None:
        async with Stager(
            node_budget_bytes=5 * MiB, node_budget_path=where, max_buffer_sets=2, buffer_wait_timeout=30
        ) as s:
            staged = await s.stage({"a": torch.ones(MiB // 2)})  # 2 MiB, set 0
            del staged
            t0 = time.monotonic()
            staged = await s.stage({"x": torch.ones(MiB)})  # 4 MiB: set 0's 2 MiB go first
            assert time.monotonic() - t0 < 25  # not the 30 s bound
            assert usage(where).reserved == s.host_bytes == set_bytes([4 * MiB])
            del staged

    anyio.run(main)


def test_close_ends_a_stage_waiting_for_the_budget(tmp_path: Path) -> None:
    where = str(tmp_path / "led")

    async def main() -> None:
        with NodeLedger.open(4 * MiB, path=where) as other:
            other.reserve(4 * MiB, timeout=1)
            s = Stager(node_budget_bytes=4 * MiB, node_budget_path=where, buffer_wait_timeout=60)
            result: list[BaseException] = []

            async def stage() -> None:
                try:
                    await s.stage(state(2 * MiB))
                except BaseException as e:  # noqa: BLE001
                    result.append(e)

            async with anyio.create_task_group() as tg:
                tg.start_soon(stage)
                deadline = time.monotonic() + 30
                while not other.usage().waiting:
                    assert time.monotonic() < deadline
                    await anyio.sleep(0.005)
                await s.aclose()
            assert result and isinstance(result[0], ClosedError), result
            assert other.usage().waiting == ()

    anyio.run(main)


CHILD = textwrap.dedent(
    """
    import sys, anyio, torch
    from async_stager import Stager

    async def main():
        path, budget, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
        async with Stager(node_budget_bytes=budget, node_budget_path=path, max_buffer_sets=1) as s:
            staged = await s.stage({"w": torch.ones(nbytes // 4)})
            del staged
            print("staged", s.host_bytes, flush=True)
            sys.stdin.readline()
            print("trimmed", await s.trim(), flush=True)
            sys.stdin.readline()
        print("closed", flush=True)

    anyio.run(main)
    """
)


def test_two_stagers_in_two_processes_share_one_budget(tmp_path: Path) -> None:
    where, budget = str(tmp_path / "led"), 6 * MiB
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, where, str(budget), str(4 * MiB)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        line = child.stdout.readline().split()
        assert line and line[0] == "staged", child.stderr.read() if child.stderr else ""
        held = int(line[1])
        assert usage(where).by_pid == {child.pid: held}

        async def main() -> None:
            async with Stager(node_budget_bytes=budget, node_budget_path=where, buffer_wait_timeout=0.2) as s:
                # The child's cached set (4 MiB) leaves 2 MiB: a 4 MiB state waits, in vain.
                with pytest.raises(NodeBudgetError) as e:
                    await s.stage(state(4 * MiB))
                assert e.value.holders == {child.pid: held}
                child.stdin.write("\n")  # type: ignore[union-attr]
                child.stdin.flush()  # type: ignore[union-attr]
                assert child.stdout.readline().split() == ["trimmed", str(held)]  # type: ignore[union-attr]
                staged = await s.stage(state(4 * MiB))  # the child's bytes came back
                assert usage(where).by_pid == {os.getpid(): s.host_bytes}
                del staged

        anyio.run(main)
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "closed"
    finally:
        child.communicate(timeout=30)
    assert child.returncode == 0


def test_options_are_checked(tmp_path: Path) -> None:
    with pytest.raises(InvalidOptionError, match="node_budget_bytes"):
        Stager(node_budget_bytes=0, node_budget_path=str(tmp_path))
    with pytest.raises(InvalidOptionTypeError, match="node_budget_bytes"):
        Stager(node_budget_bytes=1.5, node_budget_path=str(tmp_path))  # type: ignore[arg-type]
    with pytest.raises(InvalidOptionError, match="node_budget_path"):
        Stager(node_budget_bytes=MiB, node_budget_path="")
    with pytest.raises(InvalidOptionTypeError, match="node_budget_job"):
        Stager(node_budget_bytes=MiB, node_budget_job=3)  # type: ignore[arg-type]
    with NodeLedger.open(8 * MiB, path=str(tmp_path / "led")) as led:
        with pytest.raises(InvalidOptionError, match="differs from the budget of the node ledger"):
            Stager(node_budget_bytes=4 * MiB, node_ledger=led)
        s = Stager(node_ledger=led)  # shared: not closed with the stager
        s.close()
        assert led.usage().budget == 8 * MiB


def test_no_job_identity_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(InvalidOptionError, match="node_budget_job"):
        Stager(node_budget_bytes=MiB)


# -- pre-flight --------------------------------------------------------------------


def limits(mem: int) -> HostLimits:
    return HostLimits(mem_available=mem)


def rows(need: Need, mem: int) -> dict[str, Any]:
    return {r.resource: r for r in check(need, limits(mem)).rows}


def test_preflight_rows_judge_the_node() -> None:
    per = 10 * MiB
    # 4 ranks, no node budget: the machine must hold all four.
    r = rows(Need(per_set=per, sets=1, ranks=4), 30 * MiB)
    assert r["host memory (MemAvailable)"].need == 4 * per and not r["host memory (MemAvailable)"].fits
    # A node budget caps what the node maps; one process must fit the whole budget.
    r = rows(Need(per_set=per, sets=2, ranks=4, node_budget=25 * MiB), 30 * MiB)
    assert r["host memory (MemAvailable)"].need == 25 * MiB and r["host memory (MemAvailable)"].fits
    own = r["node budget, one rank"]
    assert own.need == 2 * per and own.fits and own.enforced
    all_ranks = r["node budget, all 4 ranks"]
    assert all_ranks.need == 8 * per and not all_ranks.fits and not all_ranks.enforced
    report = check(Need(per_set=per, sets=2, ranks=4, node_budget=15 * MiB), limits(1 << 40))
    assert not report.fits
    with pytest.raises(NodeBudgetError, match="lower max_buffer_sets") as e:
        report.raise_if_short()
    assert e.value.need == 2 * per and e.value.limit == 15 * MiB and e.value.report is report
    # What the budget has granted already is not mapped again.
    r = rows(Need(per_set=per, ranks=2, node_budget=25 * MiB, node_reserved=20 * MiB), 6 * MiB)
    assert r["host memory (MemAvailable)"].need == 5 * MiB
    # One rank, no budget: as before.
    assert rows(Need(per_set=per), 1 << 40)["host memory (MemAvailable)"].need == per


def test_reserve_preflight_counts_the_ranks_of_the_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``reserve()`` with a node budget: LOCAL_WORLD_SIZE ranks' worth, capped by the
    budget, against the machine's memory; refused before anything is allocated."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    sd = state(4 * MiB)
    per = set_bytes([2 * MiB, 2 * MiB])
    # Room for one rank's two sets but not for four ranks' (nor for the whole budget).
    monkeypatch.setattr(preflight_mod, "read_limits", lambda: limits(3 * per))

    async def main() -> None:
        async with Stager(node_budget_bytes=64 * MiB, node_budget_path=str(tmp_path / "a")) as s:
            with pytest.raises(HostLimitError, match="fewer than 4 ranks per node") as e:
                await s.reserve(sd)
            assert e.value.need == 4 * 2 * per and s.host_bytes == 0
        # A node budget the machine can hold: the same need fits (ranks take turns).
        async with Stager(node_budget_bytes=2 * per, node_budget_path=str(tmp_path / "b")) as s:
            await s.reserve(sd)
            assert s.host_bytes >= per

    anyio.run(main)
    assert per >= MIN_ARENA_BYTES


STRESS_CHILD = textwrap.dedent(
    """
    import json, sys, anyio, torch
    from async_stager import Stager

    async def main():
        path, budget, nbytes, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
        async with Stager(node_budget_bytes=budget, node_budget_path=path, max_buffer_sets=1,
                          buffer_wait_timeout=120) as s:
            for i in range(rounds):
                sd = {"w": torch.full((nbytes // 4,), float(i))}
                staged = await s.stage(sd)
                assert torch.equal(staged["w"], sd["w"])
                del staged
                await s.trim()  # give the bytes back for the other ranks
            led = s._engine.sets.ledger
            print(json.dumps({"waits": led.waits, "wait_seconds": led.wait_seconds}), flush=True)

    anyio.run(main)
    """
)


@pytest.mark.stress
@pytest.mark.timeout(600)
def test_stress_four_stager_processes_share_a_budget_for_two(tmp_path: Path) -> None:
    """4 processes, each staging 4 MiB (of unequal sizes: 2 to 5 MiB) 40 times and
    trimming after each, under a node budget that holds two at a time: every stage is
    bit-exact, none starves, and the sampler never sees the budget passed."""
    import json

    where, budget = str(tmp_path / "led"), 11 * MiB
    with NodeLedger.open(budget, path=where) as led:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", STRESS_CHILD, where, str(budget), str(n * MiB), "40"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for n in (2, 3, 4, 5)
        ]
        most = 0
        while any(p.poll() is None for p in procs):
            u = led.usage()
            assert u.reserved <= budget, u
            most = max(most, u.reserved)
            time.sleep(0.001)
        for n, p in zip((2, 3, 4, 5), procs, strict=True):
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
            r = json.loads(out.strip().splitlines()[-1])
            print(f"{n} MiB rank: {r['waits']} waits, {r['wait_seconds']:.2f} s waiting in all")
        print(f"most reserved at once: {most} of {budget}; ledger peak {led.usage().peak}")
