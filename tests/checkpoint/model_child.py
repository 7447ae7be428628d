"""The processes test_checkpointer_model.py starts: a saver it SIGKILLs, and a disk-full run.

``python model_child.py loop DIR CONFIG`` opens a Checkpointer on DIR with the options in
CONFIG (JSON: ``format``, ``policy`` ("wait" or "skip"), ``keep``, ``max_in_flight``,
``budget`` (None or bytes), ``seq0``, ``seed``) and saves for ever, one save after the
other from one task, until it is killed. Save number ``seq`` (from ``seq0``) saves
``build(seq)`` as a step drawn from ``random.Random(seed)``; its values are a function
of ``seq`` alone, so the parent recomputes them (``build``, ``fresh``). It prints, each
line flushed at once:

- ``ready``: the Checkpointer is open (the parent starts its kill clock here);
- ``call SEQ STEP``: just before ``save()`` is called;
- ``ret SEQ True|False``: ``save()`` returned;
- ``commit STEP``: from ``on_saved`` (in commit order);
- ``failure TEXT``: a save raised (nothing here should fail; exit status 3).

After a save returns its sources are overwritten (the snapshot must not see that).

``python model_child.py fsize DIR FORMAT [BUDGET]`` checks a write failing for want of
space (``BUDGET``: ``host_budget_bytes``, DCP only):
after one good commit it lowers ``RLIMIT_FSIZE`` below the size of the tensor file (the
kernel then fails the write with EFBIG; SIGXFSZ is ignored), saves, and prints one JSON
line saying what ``wait()``/``save()`` raised, whether a task of its own was cancelled
meanwhile, and what the directory held after the failure and after a later good save.
"""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

import anyio
import torch
from torch import nn

#: Elements of the float32 tensor ``w`` (256 KiB: the write takes a while to land in).
W_NUMEL = 64 * 1024
#: The file size limit of the disk-full run, bytes: below ``w``'s file, above the rest.
FSIZE_LIMIT = 64 * 1024


#: Elements of the tensor every save holds unchanged.
FROZEN_NUMEL = 4096


def build(seq: int) -> dict[str, Any]:
    """The state of save ``seq``: a Linear with an AdamW that took one step (so it has
    ``exp_avg``, ``exp_avg_sq`` and ``step``), a tensor and nested plain values, all a
    function of ``seq``."""
    g = torch.Generator().manual_seed(seq)
    model = nn.Linear(8, 4)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    optim.step()
    optim.zero_grad()
    w = torch.arange(W_NUMEL, dtype=torch.float32) + float(seq)
    return {
        "model": model,
        "optim": optim,
        "w": w,
        "meta": {"seq": seq, "name": f"s{seq}", "l": [seq, str(seq)]},
        # The same in every save: what an incremental save references.
        "frozen": torch.arange(FROZEN_NUMEL, dtype=torch.float32) * 0.25,
    }


def fresh() -> dict[str, Any]:
    """A restore target of ``build``'s structure: new objects, other values, an
    optimizer without state yet."""
    torch.manual_seed(999)
    model = nn.Linear(8, 4)
    return {
        "model": model,
        "optim": torch.optim.AdamW(model.parameters(), lr=0.5),
        "w": torch.zeros(W_NUMEL),
        "meta": {"seq": -1, "name": "", "l": [-1, ""]},
        "frozen": torch.zeros(FROZEN_NUMEL),
    }


def scribble(state: dict[str, Any]) -> None:
    """Overwrite a saved state's sources (allowed once ``save`` returned)."""
    with torch.no_grad():
        state["w"].fill_(-1.0)
        for p in state["model"].parameters():
            p.fill_(-1.0)
    state["meta"]["l"][0] = -1


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def loop(directory: str, config: dict[str, Any]) -> None:
    from async_stager import Checkpointer

    rng = random.Random(config["seed"])
    seq = int(config["seq0"])
    async with Checkpointer(
        directory,
        format=config["format"],
        policy=config["policy"],
        keep=config["keep"],
        max_in_flight=config["max_in_flight"],
        host_budget_bytes=config["budget"],
        incremental=config.get("incremental", False),
        checksum_threads=1,
        on_saved=lambda stats: say(f"commit {stats.step}"),
    ) as ckpt:
        say("ready")
        while True:
            step = rng.randrange(6)
            state = build(seq)
            say(f"call {seq} {step}")
            try:
                ok = await ckpt.save(state, step=step)
            except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails
                say(f"failure {type(exc).__name__}: {exc}")
                sys.exit(3)
            say(f"ret {seq} {ok}")
            scribble(state)
            seq += 1
            if rng.random() < 0.3:
                await anyio.sleep(rng.random() * 0.01)


def listing(directory: str) -> list[str]:
    return sorted(os.listdir(directory))


async def fsize(directory: str, fmt: Any, budget: int | None) -> None:
    from async_stager import Checkpointer, CheckpointError

    big = {"w": torch.arange(W_NUMEL, dtype=torch.float32), "n": 1}
    small = {"w": torch.ones(16), "n": 2}
    out: dict[str, Any] = {"cancelled": False}
    ticks = [0]

    async def ticker() -> None:
        try:
            while True:
                await anyio.sleep(0.001)
                ticks[0] += 1
        except anyio.get_cancelled_exc_class():
            out["cancelled"] = out.get("closing") is None
            raise

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        async with Checkpointer(directory, format=fmt, checksum_threads=1, host_budget_bytes=budget) as ckpt:
            await ckpt.save(big, step=1)  # staging memory is mapped now, under no limit
            await ckpt.wait()
            soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE_LIMIT, hard))
            try:
                # 1) The failure raised by wait().
                ok = await ckpt.save(big, step=2)
                try:
                    await ckpt.wait()
                    out["wait"] = None
                except CheckpointError as exc:
                    out["wait"] = {"type": type(exc).__name__, "step": exc.step, "text": repr(exc.__cause__)}
                out["saved_2"] = ok
                out["after_wait"] = listing(directory)
                try:
                    await ckpt.wait()
                    out["wait_again"] = None
                except CheckpointError as exc:
                    out["wait_again"] = repr(exc)
                # 2) The failure raised by the next save().
                await ckpt.save(big, step=3)
                for _ in range(400):  # until the write failed (its folder goes), 2 s at most
                    await anyio.sleep(0.005)
                    if not any(".tmp-" in n for n in listing(directory)):
                        break
                try:
                    await ckpt.save(small, step=4)
                    out["save"] = None
                except CheckpointError as exc:
                    out["save"] = {"type": type(exc).__name__, "step": exc.step}
            finally:
                resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            # 3) Space again: a save commits.
            await ckpt.save(small, step=5)
            await ckpt.wait()
            out["steps"] = ckpt.steps()
            out["final"] = listing(directory)
            out["ticks"] = ticks[0]
            out["closing"] = True
        tg.cancel_scope.cancel()
    say(json.dumps(out))


if __name__ == "__main__":
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    torch.set_num_threads(1)
    mode, target = sys.argv[1], sys.argv[2]
    Path(target).mkdir(parents=True, exist_ok=True)
    if mode == "loop":
        anyio.run(loop, target, json.loads(sys.argv[3]))
    elif mode == "fsize":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        anyio.run(fsize, target, sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else None)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
