"""A trainer process for the memory tier's fault tests (run as a script).

``tier_child.py JOB BASE STEPS MIB``: snapshot ``state_of(step)`` for steps 1..STEPS
through a MemoryTier (each commit waited for), then begin step STEPS+1, stage it, print
``STAGED`` and hang until killed: a trainer SIGKILLed mid-snapshot (begun and staged,
never committed). ``MIB`` sizes the state.
"""

from __future__ import annotations

import sys

import anyio
import torch


def state_of(step: int, mib: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(step)
    n = max(1, mib * 2**20 // 4 // 2)
    return {"a": torch.randn(n, generator=g), "b": {"c": torch.randn(n, generator=g)}, "step": step}


async def main(job: str, base: str, steps: int, mib: int) -> None:
    from async_stager._tier.client import AgentClient
    from async_stager._tier.tier import MemoryTier

    tier = MemoryTier(AgentClient(job, base=base, timeout=30), policy="wait")
    async with anyio.create_task_group() as tg:
        tier.open(tg)
        for step in range(1, steps + 1):
            assert await tier.save(state_of(step, mib), step)
        while tier.in_flight():
            await anyio.sleep(0.01)
        assert tier.stats.saved == steps, tier.stats
        # The next one: begun and staged, never committed.
        protect = [steps]
        await tier.client.begin(0, steps + 1, 1, session=tier.session, protect=protect)
        lease = await tier.stager.lease(state_of(steps + 1, mib))
        print("STAGED", flush=True)
        await anyio.sleep(3600)
        lease.release()


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
