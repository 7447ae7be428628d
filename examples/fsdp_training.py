"""FSDP2 training on CPUs (gloo) with asynchronous, verified, committed checkpoints.

Run: ``torchrun --nproc-per-node 2 examples/fsdp_training.py --out /tmp/fsdp``. Each rank
holds a shard of a small transformer (``fully_shard``) and of its AdamW state. Every
``--every`` steps all ranks call ``ckpt.save(state, step=n)`` with a Stateful that goes
through ``get_state_dict``/``set_state_dict``; the save returns once this rank's shard is
staged, DCP writes in the background, and rank 0 commits once every rank's files are
durable. Started again, it resumes from the newest committed step that verifies, on any
number of ranks (``--nproc-per-node 1`` or 4: DCP reshards).

``--kill-at N`` SIGKILLs rank ``--kill-rank`` (0) right after the save of step N was staged (its write may
or may not have been committed): torchrun then stops the other ranks. ``--digests``
prints a CRC of the full (unsharded) model and optimizer state at every save and after a
resume, so a test can check that a resume is bit-exact. The last step is always saved;
at the end every rank restores the newest committed checkpoint into a fresh sharded
model and a fresh AdamW with no state, and rank 0 compares the whole (unsharded) state
(parameters, buffers, ``exp_avg``, ``exp_avg_sq`` and ``step``, ``param_groups``) and
the step counter bit for bit with the trained ones.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard

from async_stager import Checkpointer

WIDTH, VOCAB, SEQ = 32, 64, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


class Transformer(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(x.reshape(-1, WIDTH))  # (batch * seq, vocab): not a view
        return out


class TrainState:
    """The Stateful handed to the Checkpointer: sharded model and optimizer state."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        msd, osd = get_state_dict(self.model, self.optimizer)
        return {"model": msd, "optim": osd}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    """The sharded model (each block, then the root) and its optimizer (no state yet)."""
    model = Transformer()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The whole (unsharded) model and optimizer state on rank 0's CPU, empty on the
    other ranks (a collective: every rank calls it)."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, optimizer, options=opts)
    return {"model": msd, "optim": osd}


def digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """CRC-32 of the full state (a collective: every rank calls it)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(full_state(model, optimizer))
    crc = 0
    for k in sorted(flat):
        v = flat[k]
        if isinstance(v, torch.Tensor):
            crc = zlib.crc32(k.encode(), crc)
            crc = zlib.crc32(v.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes(), crc)
    return crc


def differences(expected: Any, actual: Any, path: str = "state") -> list[str]:
    """The paths (``state.optim.state.0.exp_avg``) where ``actual`` differs from
    ``expected``: dict keys, sequence types and lengths, plain values and their types;
    tensors by dtype, shape and bytes (bit-exact: -0.0 is not 0.0, a NaN equals itself)."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor) or actual.dtype != expected.dtype:
            return [path]
        if actual.shape != expected.shape or not torch.equal(raw(actual), raw(expected)):
            return [path]
        return []
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or actual.keys() != expected.keys():
            return [f"{path} (keys)"]
        return [d for k in expected for d in differences(expected[k], actual[k], f"{path}.{k}")]
    if isinstance(expected, (list, tuple)):
        if type(actual) is not type(expected) or len(actual) != len(expected):
            return [path]
        return [d for i, pair in enumerate(zip(expected, actual)) for d in differences(*pair, f"{path}[{i}]")]
    return [] if type(actual) is type(expected) and actual == expected else [path]


def raw(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, as a flat uint8 tensor on the CPU."""
    return t.detach().cpu().reshape(-1).view(torch.uint8)


def optimizer_keys(optimizer: torch.optim.Optimizer) -> str:
    """The names in an optimizer's per-parameter state (AdamW: exp_avg, exp_avg_sq, step)."""
    return ", ".join(sorted({k for s in optimizer.state_dict()["state"].values() for k in s}))


async def verify_restore(ckpt: Checkpointer, state: dict[str, Any]) -> str:
    """Restore the newest committed checkpoint into a fresh sharded model and optimizer
    and compare their whole state with ``state``'s (a collective); SystemExit naming
    what differs."""
    fresh_model, fresh_opt = build()
    fresh: dict[str, Any] = {"train": TrainState(fresh_model, fresh_opt), "progress": {"step": -1}}
    step = await ckpt.restore(fresh)
    train = state["train"]
    expected = {**full_state(train.model, train.optimizer), "progress": state["progress"]}
    restored = {**full_state(fresh_model, fresh_opt), "progress": fresh["progress"]}
    bad = differences(expected, restored)
    if step != state["progress"]["step"] or bad:
        raise SystemExit(f"restored step {step} differs from the trained state: {', '.join(bad[:8])}")
    return (
        f"restored step {step}: model, optimizer ({optimizer_keys(train.optimizer)}, param_groups)"
        " and step counter bit-exact"
    )


def batch(step: int, rank: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=g)  # the global batch
    return tokens[rank::world] if world <= 4 else tokens[rank % 4 :: 4]


async def train(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model, optimizer = build()
    state: dict[str, Any] = {"train": TrainState(model, optimizer), "progress": {"step": 0}}
    async with Checkpointer(args.out, keep=args.keep) as ckpt:
        resumed = await ckpt.restore(state)
        step = 0 if resumed is None else int(state["progress"]["step"])
        if rank == 0:
            print(f"world {world}: resumed from step {resumed}", flush=True)
        if resumed is not None and args.digests:
            d = digest(model, optimizer)
            if rank == 0:
                print(f"digest after resume {step}: {d:08x}", flush=True)
        while step < args.steps:
            tokens = batch(step, rank, world)
            logits = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits, tokens[:, 1:].reshape(-1))
            loss.backward()
            await ckpt.fence()  # a save in flight has read the parameters
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % args.every == 0 or step == args.steps:
                state["progress"]["step"] = step
                if args.digests:
                    d = digest(model, optimizer)
                    if rank == 0:
                        print(f"digest at save {step}: {d:08x}", flush=True)
                await ckpt.save(state, step=step)
                if step == args.kill_at and rank == args.kill_rank:
                    os.kill(os.getpid(), signal.SIGKILL)
        await ckpt.wait()
        if rank == 0:
            print(f"trained to step {step}, committed {ckpt.steps()}", flush=True)
        state["progress"]["step"] = step
        if ckpt.steps():  # nothing to restore after a run of no steps on an empty folder
            line = await verify_restore(ckpt, state)
            if rank == 0:
                print(line, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("fsdp-checkpoints"))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--kill-rank", type=int, default=0)
    p.add_argument("--digests", action="store_true")
    args = p.parse_args()
    dist.init_process_group("gloo")
    try:
        asyncio.run(train(args))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
