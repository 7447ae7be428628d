"""Checkpointer measurements, one run: the checksum's cost against staging, and a CPU
training loop with and without checkpoints (docs/benchmarks.md, "Checkpointer").

1. Checksum cost, ``transformer`` workload (async_stager/_cli/workloads.py, scale 1):
   median of ``--repeats`` warm leases without and with ``checksums=True`` (XXH3-64
   in the copy threads), interleaved, for the default ``Stager()`` and
   ``copy_threads=2``; for reference, a second pass over the staged copy after
   staging: XXH3 (``checksum_state``), CRC-32 (the first manifest format) and a torch
   int64 sum.
2. End to end: ``--steps`` training steps of an MLP with AdamW on the CPU, a DCP
   checkpoint every ``--every`` steps, five ways: none; ``Checkpointer`` (``await
   save``); ``Checkpointer`` with the save as a task (staging overlaps the next
   forward/backward, awaited before ``optimizer.step()``); DCP
   ``async_save`` with PyTorch's own ``DefaultStager``; ``async_save`` with
   async_stager's ``DefaultStager``. Reports the mean step time, the time the loop was
   blocked per checkpoint (the save call plus the wait before ``optimizer.step()``
   until the stage has read the parameters), and the loop's total wall time (the last
   write awaited at the end, outside the loop).

Run: ``PYTHONPATH=. python scripts/bench_checkpoint.py`` (about a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from async_stager import Checkpointer, SaveStats, Stager
from async_stager._checkpoint.integrity import checksum_state, tensor_crcs
from async_stager._cli.workloads import build_transformer, count_tensors

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


SAVES: list[SaveStats] = []


def _sums(words: list[torch.Tensor]) -> list[torch.Tensor]:
    return [w.sum() for w in words]


def _crcs(tensors: list[torch.Tensor]) -> list[list[int]]:
    return [tensor_crcs(t) for t in tensors]


def median_time(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def checksum_cost(repeats: int) -> None:
    sd = build_transformer(1.0, torch.device("cpu"))
    tensors, nbytes = count_tensors(sd)
    print(f"transformer workload: {tensors} tensors, {nbytes / 2**20:.0f} MiB, {os.cpu_count()} cores")
    for threads in (None, 2):
        async with Stager(copy_threads=threads) as stager:
            times: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(2):  # plans, arenas and pages first
                for hashed in (False, True):
                    (await stager.lease(sd, checksums=hashed)).release()
            for _ in range(repeats):  # interleaved, so both see the same machine
                for hashed in (False, True):
                    t0 = time.perf_counter()
                    lease = await stager.lease(sd, checksums=hashed)
                    times[hashed].append(time.perf_counter() - t0)
                    lease.release()
                    del lease
            plain, fused = statistics.median(times[False]), statistics.median(times[True])
            label = f"Stager(copy_threads={threads})"
            print(
                f"  {label}: stage {plain * 1e3:.1f} ms, with checksums (XXH3 in the copy threads) "
                f"{fused * 1e3:.1f} ms: +{100 * (fused / plain - 1):.0f}% of staging"
            )
            if threads is None:
                stage = plain
                held = await stager.stage(sd)
    # For reference: a second pass over the staged copy, after staging.
    xxh = median_time(functools.partial(checksum_state, held, threads=1), repeats)
    flat = [t for t in held["model"].values()] + [
        v for st in held["optim"]["state"].values() for v in st.values() if isinstance(v, torch.Tensor)
    ]
    crc = median_time(functools.partial(_crcs, flat), repeats)
    words = [
        t.reshape(-1).view(torch.uint8)[: t.numel() * t.element_size() // 8 * 8].view(torch.int64)
        for t in flat
    ]
    summed = median_time(functools.partial(_sums, words), repeats)
    del held, words, flat
    for label, t in (
        ("xxh3 pass over the staged copy, 1 thread", xxh),
        ("crc32 pass over the staged copy, 1 thread (the first format)", crc),
        ("int64 sum over the staged copy (reference)", summed),
    ):
        print(f"  {label}: {t * 1e3:.1f} ms, {nbytes / t / 1e9:.2f} GB/s, {100 * t / stage:.0f}% of staging")


def model(width: int, depth: int) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    m = nn.Sequential(*layers)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-4), torch.randn(32, width)


async def loop(
    mode: str, out: Path, steps: int, every: int, width: int, depth: int
) -> tuple[float, float, float]:
    """(mean step seconds, mean blocked seconds per checkpoint, loop wall seconds)."""
    import torch.distributed.checkpoint as dcp

    m, opt, x = model(width, depth)
    blocked: list[float] = []
    step_times: list[float] = []
    t_start = time.perf_counter()
    ckpt: Checkpointer | None = None
    stager: Any = None
    task: asyncio.Task[bool] | None = None
    if mode.startswith("checkpointer"):
        ckpt = Checkpointer(out, keep=2, on_saved=SAVES.append)
        await ckpt.__aenter__()
    elif mode == "dcp-torch-stager":
        from torch.distributed.checkpoint.staging import DefaultStager as TorchStager, StagingOptions

        # Its defaults assume CUDA (pinning, non-blocking copies); on the CPU those are off.
        stager = TorchStager(StagingOptions(use_pinned_memory=False, use_non_blocking_copy=False))
    elif mode == "dcp-our-stager":
        from async_stager import CheckpointStagerConfig, DefaultStager

        stager = DefaultStager(CheckpointStagerConfig())
    staging: Any = None
    upload: Any = None
    last_save = -1
    try:
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            m(x).square().mean().backward()
            wait = 0.0
            if ckpt is not None:
                w0 = time.perf_counter()
                if task is not None and step - 1 == last_save:
                    await task  # staged: the sources may change
                await ckpt.fence()
                wait = time.perf_counter() - w0
            elif staging is not None:
                w0 = time.perf_counter()
                staging.result()
                wait = time.perf_counter() - w0
                staging = None
            if blocked and step - 1 == last_save:
                blocked[-1] += wait  # the wait that follows a checkpoint belongs to it
            opt.step()
            opt.zero_grad()
            if step % every == 0 and mode != "none":
                s0 = time.perf_counter()
                if mode == "checkpointer-task":
                    # The stage overlaps the next forward/backward; fence before step().
                    assert ckpt is not None
                    if task is not None:
                        await task
                    task = asyncio.create_task(ckpt.save({"model": m, "optim": opt}, step=step))
                elif ckpt is not None:
                    await ckpt.save({"model": m, "optim": opt}, step=step)
                else:
                    if upload is not None:
                        upload.result()  # one write at a time, as the Checkpointer
                    sd = {"model": m.state_dict(), "optim": opt.state_dict()}
                    resp = dcp.async_save(
                        sd, checkpoint_id=str(out / f"s{step}"), async_stager=stager, no_dist=True
                    )
                    if hasattr(resp, "staging_completion"):
                        staging, upload = resp.staging_completion, resp.upload_completion
                    else:
                        upload = resp
                blocked.append(time.perf_counter() - s0)
                last_save = step
            await asyncio.sleep(0)
            step_times.append(time.perf_counter() - t0)
        wall = time.perf_counter() - t_start
        if ckpt is not None:
            if task is not None:
                await task
            await ckpt.wait()
        if upload is not None:
            upload.result()
    finally:
        if ckpt is not None:
            await ckpt.__aexit__(None, None, None)
        if stager is not None:
            stager.close()
    return statistics.mean(step_times), statistics.mean(blocked) if blocked else 0.0, wall


async def end_to_end(steps: int, every: int, width: int, depth: int) -> None:
    m, _, _ = model(width, depth)
    params = sum(p.numel() for p in m.parameters())
    print(
        f"training loop: MLP {depth}x{width} ({params / 1e6:.1f} M params, state {params * 12 / 2**20:.0f} MiB "
        f"with AdamW), {steps} steps, a checkpoint every {every}"
    )
    base = None
    for mode in ("none", "checkpointer", "checkpointer-task", "dcp-torch-stager", "dcp-our-stager"):
        with tempfile.TemporaryDirectory() as d:
            step_s, blocked_s, wall = await loop(mode, Path(d), steps, every, width, depth)
        base = base or step_s
        extra = ""
        if SAVES:
            extra = (
                f"  (write {statistics.mean(x.write_seconds for x in SAVES) * 1e3:.0f} ms, checksum "
                f"{statistics.mean(x.checksum_seconds for x in SAVES) * 1e3:.0f} ms alongside, commit "
                f"{statistics.mean(x.commit_seconds for x in SAVES) * 1e3:.0f} ms)"
            )
            SAVES.clear()
        print(
            f"  {mode:18s} step {step_s * 1e3:7.1f} ms ({step_s / base:4.2f}x)  "
            f"blocked per checkpoint {blocked_s * 1e3:7.1f} ms  loop {wall:6.2f} s{extra}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=8)
    args = p.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    asyncio.run(checksum_cost(args.repeats))
    asyncio.run(end_to_end(args.steps, args.every, args.width, args.depth))


if __name__ == "__main__":
    main()
