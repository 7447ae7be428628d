"""A node-budget save that streams reads its fence points at the ``save()`` call.

Admission decides on the loop, after the call, that a save streams; its pipeline is
built then. The streams its fence orders after the copies must still be the caller's
at the call (the snapshot point's), not whatever is current on the loop when the
pipeline is made: on the simulated device, training queued on the caller's stream
after ``save()`` returned would otherwise overwrite sources whose copies are still in
flight, and the checkpoint would hold the later values.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import bits

import async_stager._checkpoint.checkpointer as checkpointer_module
from async_stager import Checkpointer, Stager
from async_stager.testing import SimulatedBackend, SimulatedDevice

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_thread_leak")]

MiB = 2**20


@pytest.mark.anyio
async def test_a_streamed_node_budget_save_fences_the_stream_of_its_call(
    tmp_path: Path, anyio_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Copies land 30 ms after their enqueue: still in flight when save() returns.
    with SimulatedDevice(seed=31, delay=(0.03, 0.03), capacity=32 * MiB) as sim:
        g = torch.Generator().manual_seed(4)
        sd = {f"w{i}": sim.tensor(torch.randn(MiB // 4, generator=g)) for i in range(6)}  # 1 MiB each
        want = {k: bits(v.clone()) for k, v in sd.items()}
        train = sim.stream("train")
        # The Checkpointer makes its own Stager at a node budget: on the simulated device.
        monkeypatch.setattr(
            checkpointer_module, "Stager", functools.partial(Stager, backend=SimulatedBackend(sim))
        )
        budget = 2 * MiB + 4096  # the state does not fit: admission streams it
        async with Checkpointer(
            tmp_path / "ck", node_budget_bytes=budget, node_budget_path=str(tmp_path / "ledger")
        ) as ckpt:
            with sim.using(train):
                saving = ckpt.save({"model": sd}, step=1)  # the call: on the train stream
            await saving  # returns once the last piece is copied (enqueued, fenced)
            with sim.using(train):
                # The next step's writes, queued on the stream of the call.
                sim.launch(lambda: [t.add_(1.0) for t in sd.values()])
            await ckpt.wait()
            stats = ckpt.last
            assert stats is not None and stats.admission == "streamed", stats
            back: dict[str, Any] = {"model": {k: torch.zeros(MiB // 4) for k in sd}}
            assert await ckpt.restore(back) == 1
        for k, v in want.items():
            assert torch.equal(bits(back["model"][k]), v), k
        sim.synchronize()
        assert sim.errors == []
