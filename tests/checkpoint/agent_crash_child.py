"""A trainer saving to the memory agent every step and to its folder every 5th, for
test_checkpointer_agent_crash (run as a script until SIGKILLed).

``agent_crash_child.py DIR JOB BASE START``: restore (memory first, else the folder),
check the restored state is bit-exact ``state_of(step)``, print ``RESTORED step``, then
save steps from there on, printing ``SAVED step`` once each save returned.
"""

from __future__ import annotations

import sys

import anyio
import torch


def state_of(step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(1000 + step)
    return {"a": torch.randn(1 << 18, generator=g), "b": {"c": torch.randn(999, generator=g)}, "step": step}


async def main(directory: str, job: str, base: str) -> None:
    from async_stager import Checkpointer
    from async_stager._tier.client import AgentClient

    client = AgentClient(job, base=base, timeout=30)
    async with Checkpointer(directory, agent=client, memory_every=1, persist_every=5) as ckpt:
        state: dict[str, object] = {"a": torch.zeros(1 << 18), "b": {"c": torch.zeros(999)}, "step": -1}
        got = await ckpt.restore(state)
        if got is not None:
            want = state_of(got)
            assert torch.equal(state["a"], want["a"]), got  # type: ignore[arg-type]
            assert torch.equal(state["b"]["c"], want["b"]["c"]), got  # type: ignore[index]
            assert state["step"] == got
        print(f"RESTORED {got}", flush=True)
        step = (got or 0) + 1
        while True:
            assert await ckpt.save(state_of(step), step=step)
            print(f"SAVED {step}", flush=True)
            step += 1


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2], sys.argv[3])
