"""DCP ``async_save`` with async_stager's ``DefaultStager`` as a drop-in stager.

``torch.distributed.checkpoint.async_save(sd, async_stager=DefaultStager(...))``: DCP
calls ``stager.stage(sd)``, which returns a Future (the walk and copies run in the
stager's worker), starts the upload in its own thread (it waits for the staged copy,
then saves it) and returns at once an ``AsyncSaveResponse``: it does not wait for the
stage, nor call ``synchronize_staging()`` (torch 2.13). The parameters may be modified
in place (``optimizer.step()``) only once ``response.staging_completion`` is done: here
the stage overlaps the next forward and backward, and is waited for before the step.
The stager is created once and reused, so the host buffers are allocated on the first
checkpoint only; close it after the last one (DCP does not close a stager it was
given). Wait for a checkpoint's upload (``response.upload_completion``) before starting
the next one. The state dicts come from ``get_state_dict`` (DCP's recipe for optimizers:
keyed by parameter name, so they reshard), and ``set_state_dict`` loads them back. At
the end the last checkpoint is loaded with ``dcp.load`` into a fresh model and
optimizer, and their whole state (parameters, buffers, AdamW's ``exp_avg``,
``exp_avg_sq`` and ``step``, ``param_groups``) and the step counter are compared bit for
bit with the trained ones.

Run: ``python examples/dcp_async_save.py --steps 3 --out /tmp/dcp``
(single process: ``no_dist=True``; in a distributed job drop it and call this on every
rank).
"""

from __future__ import annotations

import argparse
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from async_stager import CheckpointStagerConfig, DefaultStager, state_differences

# DCP warns on every no_dist save/load that it assumes a single process: we do.
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)


def optimizer_keys(optimizer: torch.optim.Optimizer) -> str:
    """The names in an optimizer's per-parameter state (AdamW: exp_avg, exp_avg_sq, step)."""
    return ", ".join(sorted({k for s in optimizer.state_dict()["state"].values() for k in s}))


def state_of(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    """What is saved: the model's and the optimizer's state (the live tensors, not
    copies: they must not change until the stage has read them) and the step."""
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd, "step": step}


def verify_last(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, step: int, width: int) -> str:
    """Load the checkpoint at ``path`` into a fresh model and optimizer and compare
    their whole state with the trained ones; SystemExit naming what differs."""
    fresh = nn.Linear(width, width)
    fresh_opt = torch.optim.AdamW(fresh.parameters())  # no state yet
    # dcp.load loads in place into tensors of the saved shapes: get_state_dict gives the
    # fresh optimizer its state (a step with zero gradients and lr 0: the parameters do
    # not change); the plain values (param_groups, step) are replaced.
    target = state_of(fresh, fresh_opt, -1)
    dcp.load(target, checkpoint_id=str(path), no_dist=True)
    set_state_dict(fresh, fresh_opt, model_state_dict=target["model"], optim_state_dict=target["optim"])
    expected = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step}
    restored = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict(), "step": target["step"]}
    bad = state_differences(expected, restored)
    if bad:
        raise SystemExit(f"{path} does not restore the trained state: {', '.join(bad[:8])}")
    return (
        f"restored step {target['step']}: model, optimizer ({optimizer_keys(optimizer)}, param_groups)"
        " and step counter bit-exact"
    )


def save_futures(response: Any, stager: DefaultStager) -> tuple[Future[Any], Future[Any]]:
    """(staged, uploaded) of an ``async_save``: an ``AsyncSaveResponse`` for a
    Future-returning stager; a plain Future of the upload otherwise (a synchronous
    stager has staged before async_save returns; ``synchronize_staging()`` waits for
    every stage submitted in any case)."""
    if hasattr(response, "staging_completion"):
        return response.staging_completion, response.upload_completion
    stager.synchronize_staging()
    staged: Future[Any] = Future()
    staged.set_result(None)
    return staged, response


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--out", type=Path, default=Path("checkpoints"))
    args = p.parse_args()

    torch.manual_seed(0)
    model = nn.Linear(args.width, args.width)
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(16, args.width)
    # The seed's flags; None/defaults take what the machine supports (no CUDA: no
    # pinning, synchronous copies), shared memory and async staging are on.
    stager = DefaultStager(CheckpointStagerConfig())
    staged: Future[Any] | None = None
    upload: Future[Any] | None = None
    try:
        for step in range(1, args.steps + 1):
            model(x).square().mean().backward()  # overlaps the previous checkpoint's stage
            if staged is not None:
                # The stage has read the parameters: they may change now. Not waiting
                # here can tear the checkpoint (async_save did not wait for the stage).
                staged.result()
            optimizer.step()
            optimizer.zero_grad()
            if upload is not None:
                upload.result()  # one upload at a time: the previous one is written
            sd = state_of(model, optimizer, step)
            t0 = time.perf_counter()
            response = dcp.async_save(
                sd, checkpoint_id=str(args.out / f"step{step}"), async_stager=stager, no_dist=True
            )
            staged, upload = save_futures(response, stager)
            print(f"step {step}: async_save returned in {1e3 * (time.perf_counter() - t0):.1f} ms")
        assert upload is not None
        upload.result()
    finally:
        stager.close()

    print(verify_last(args.out / f"step{args.steps}", model, optimizer, args.steps, args.width))


if __name__ == "__main__":
    main()
