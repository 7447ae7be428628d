"""The process test_checkpointer_crash.py kills: resume, report, train, save every step.

``python crash_child.py DIR FORMAT KILL`` restores from DIR (``fallback=False``: the
newest committed checkpoint must verify), prints ``restored STEP DIGEST``, then trains
and saves every step (``RUN`` steps) until it SIGKILLs itself at ``KILL``: ``NAME:K`` is the K-th call
(from 1, counted after the restore) of one of the functions patched below, so kill
points fall in each phase: staging (``lease``), writing (``write_item`` and
``torch_save``: DCP's and torch.save's per-item writes; ``digest``: a piece hashed by the
copy threads while staging),
and committing (``fsync``, ``rename``, ``replace``, ``rmtree``; ``link``: an incremental
save's links to the previous commit's data; FORMAT ``dcp+incremental``). ``none`` trains to the
end. The training is deterministic (one thread), so ``digest(step)`` is a function of
the step alone, computed by the parent with ``reference()``.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import warnings
import zlib
from typing import Any

import torch
from torch import nn

STEPS = 400
#: The format argument of an incremental run (``dcp`` with ``incremental=True`` and a
#: frozen tensor in the state).
INCREMENTAL = "dcp+incremental"
FROZEN = 64 * 1024
#: Steps one run trains past its restored step (each one saved) unless killed first.
RUN = int(os.environ.get("CRASH_CHILD_RUN", "8"))


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 64, generator=g)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def digest(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    crc = 0
    for t in [*model.state_dict().values()]:
        crc = zlib.crc32(t.detach().contiguous().view(torch.uint8).numpy().tobytes(), crc)
    for st in opt.state_dict()["state"].values():
        for k in sorted(st):
            crc = zlib.crc32(st[k].detach().reshape(-1).view(torch.uint8).numpy().tobytes(), crc)
    return crc


class App:
    """Model and optimizer through get_state_dict/set_state_dict (which creates the
    optimizer's state before a load, so DCP can load into it in place)."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.opt)
        return {"model": msd, "optim": osd}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def frozen() -> torch.Tensor:
    return torch.randn(FROZEN, generator=torch.Generator().manual_seed(7))


def reference() -> dict[int, int]:
    """The digest after each step, trained without interruption."""
    torch.set_num_threads(1)
    model, opt = build()
    out = {}
    for step in range(1, STEPS + 1):
        train_step(model, opt, step)
        out[step] = digest(model, opt)
    return out


def arm(spec: str) -> None:
    if spec == "none":
        return
    name, _, k = spec.partition(":")
    left = [int(k)]

    def wrap(owner: Any, attr: str) -> None:
        orig = getattr(owner, attr)

        def patched(*args: Any, **kwargs: Any) -> Any:
            left[0] -= 1
            if left[0] == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            return orig(*args, **kwargs)

        setattr(owner, attr, patched)

    import torch.distributed.checkpoint.filesystem as fs

    import async_stager
    from async_stager._core.checksum import digest as _digest

    targets = {
        "lease": (async_stager.Stager, "lease"),
        "write_item": (fs, "_write_item"),
        "torch_save": (torch, "save"),
        "digest": (_digest, "hash_memory"),
        "fsync": (os, "fsync"),
        "rename": (os, "rename"),
        "replace": (os, "replace"),
        "rmtree": (shutil, "rmtree"),
        "link": (os, "link"),
    }
    wrap(*targets[name])


async def main(directory: str, fmt: Any, spec: str) -> None:
    from async_stager import Checkpointer

    torch.set_num_threads(1)
    model, opt = build()
    state: dict[str, Any] = {"app": App(model, opt), "progress": {"step": 0}}
    incremental = fmt == INCREMENTAL
    if incremental:
        fmt, state["frozen"] = "dcp", torch.zeros(FROZEN)
    async with Checkpointer(
        directory, keep=2, format=fmt, checksum_threads=1, incremental=incremental
    ) as ckpt:
        restored = await ckpt.restore(state, fallback=False)
        step = 0 if restored is None else int(state["progress"]["step"])
        if incremental:
            # A frozen tensor every save after the first references.
            if restored is not None and not torch.equal(state["frozen"], frozen()):
                print("frozen tensor differs", flush=True)
                sys.exit(3)
            state["frozen"] = frozen()
        print(f"restored {restored} {digest(model, opt) if restored is not None else 0}", flush=True)
        arm(spec)
        stop = min(STEPS, step + RUN)
        while step < stop:
            step += 1
            await ckpt.fence()
            train_step(model, opt, step)
            state["progress"]["step"] = step
            await ckpt.save(state, step=step)
    print("done", flush=True)


if __name__ == "__main__":
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3]))
