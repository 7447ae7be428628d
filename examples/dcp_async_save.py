"""DCP ``async_save`` with async_stager's ``DefaultStager`` as a drop-in stager.

``torch.distributed.checkpoint.async_save(sd, async_stager=DefaultStager(...))``: DCP
calls ``stager.stage(sd)`` (a Future: the walk and copies run in the stager's worker),
then uploads the staged copy in its own thread. The stager is created once and reused,
so the host buffers are allocated on the first checkpoint only; close it after the last
one (DCP does not close a stager it was given). A checkpoint's staged buffers are reused
by the next ``stage()``: wait for a checkpoint's upload before starting the next one.

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

from async_stager import CheckpointStagerConfig, DefaultStager

# DCP warns on every no_dist save/load that it assumes a single process: we do.
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)


def upload_future(response: Any) -> Future[Any]:
    """async_save returns an AsyncSaveResponse (torch >= 2.9, with a Future-returning
    stager) or a plain Future of the upload."""
    fut: Future[Any] = getattr(response, "upload_completion", response)
    return fut


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
    upload: Future[Any] | None = None
    try:
        for step in range(1, args.steps + 1):
            model(x).square().mean().backward()
            if upload is not None:
                upload.result()  # the previous checkpoint is written; its buffers are free
            stager.synchronize_staging()  # staging has read the parameters: may step now
            optimizer.step()
            optimizer.zero_grad()
            sd = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step}
            t0 = time.perf_counter()
            upload = upload_future(
                dcp.async_save(
                    sd, checkpoint_id=str(args.out / f"step{step}"), async_stager=stager, no_dist=True
                )
            )
            print(f"step {step}: async_save returned in {1e3 * (time.perf_counter() - t0):.1f} ms")
        assert upload is not None
        upload.result()
    finally:
        stager.close()

    # Load the last checkpoint into fresh modules and check it is bit-exact.
    fresh = nn.Linear(args.width, args.width)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    fresh(x).square().mean().backward()
    fresh_opt.step()  # creates optimizer state to load into
    target = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict(), "step": 0}
    dcp.load(target, checkpoint_id=str(args.out / f"step{args.steps}"), no_dist=True)
    fresh.load_state_dict(target["model"])
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    assert target["step"] == args.steps
    print(f"loaded step {target['step']}: bit-exact")


if __name__ == "__main__":
    main()
