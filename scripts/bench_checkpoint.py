"""Checkpointer measurements, one run: the checksum's cost against staging, and a CPU
training loop with and without checkpoints (docs/benchmarks.md, "Checkpointer").

1. Checksum cost, ``transformer`` workload (async_stager/_cli/workloads.py, scale 1):
   median of ``--repeats`` warm leases without and with ``checksums=True`` (XXH3-64
   in the copy threads), interleaved, for the default ``Stager()`` and
   ``copy_threads=2``; for reference, a second pass over the staged copy after
   staging: XXH3 (``checksum_state``), CRC-32 (the first manifest format) and a torch
   int64 sum.
2. End to end: ``--steps`` training steps of an MLP with AdamW on the CPU, a DCP
   checkpoint every ``--every`` steps, in the recipe's loop exactly as docs/recipes.md
   writes it (no extra yields), five ways: none; ``Checkpointer`` with checksums and
   without; DCP ``async_save`` with async_stager's ``DefaultStager`` and with
   PyTorch's. ``--rounds`` loops per way, rotated; medians of the mean step time, of
   the time the loop was blocked per checkpoint (the save call plus the wait before
   the next ``optimizer.step()``) and of the Checkpointer's background write, against
   the same write alone; then the issue-24 targets as ratios.

Run: ``PYTHONPATH=. python scripts/bench_checkpoint.py`` (a few minutes on 2 cores;
``--skip-checksum-cost`` for the loop only).
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


async def loop(mode: str, out: Path, steps: int, every: int, width: int, depth: int) -> dict[str, float]:
    """One training loop: the recipe's loop exactly as docs/recipes.md writes it
    (``await ckpt.fence()`` before ``optimizer.step()``, ``await ckpt.save(...)`` every
    ``every`` steps, no other await), or the same with DCP's ``async_save``. Returns the
    mean step seconds, the mean blocked seconds per checkpoint (the save call plus the
    wait before the next ``optimizer.step()``), the loop's wall seconds and, for the
    Checkpointer, the background write's median seconds."""
    import torch.distributed.checkpoint as dcp

    m, opt, x = model(width, depth)
    blocked: list[float] = []
    step_times: list[float] = []
    saves: list[SaveStats] = []
    ckpt: Checkpointer | None = None
    stager: Any = None
    if mode.startswith("checkpointer"):
        ckpt = Checkpointer(out, keep=2, checksums=mode == "checkpointer", on_saved=saves.append)
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
    t_start = time.perf_counter()
    try:
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            m(x).square().mean().backward()
            w0 = time.perf_counter()
            if ckpt is not None:
                await ckpt.fence()  # the recipe's only await per step
            elif staging is not None:
                staging.result()
                staging = None
            if blocked and step - 1 == last_save:
                blocked[-1] += time.perf_counter() - w0  # the wait after a checkpoint is its cost
            opt.step()
            opt.zero_grad()
            if step % every == 0 and mode != "none":
                s0 = time.perf_counter()
                if ckpt is not None:
                    await ckpt.save({"model": m, "optim": opt}, step=step)
                else:
                    if upload is not None:
                        upload.result()  # one write at a time, as the Checkpointer
                    sd = {"model": m.state_dict(), "optim": opt.state_dict()}
                    resp: Any = dcp.async_save(
                        sd, checkpoint_id=str(out / f"s{step}"), async_stager=stager, no_dist=True
                    )
                    if hasattr(resp, "staging_completion"):
                        staging, upload = resp.staging_completion, resp.upload_completion
                    else:
                        upload = resp
                blocked.append(time.perf_counter() - s0)
                last_save = step
            step_times.append(time.perf_counter() - t0)
        wall = time.perf_counter() - t_start
        if ckpt is not None:
            await ckpt.wait()
        if upload is not None:
            upload.result()
    finally:
        if ckpt is not None:
            await ckpt.__aexit__(None, None, None)
        if stager is not None:
            stager.close()
    return {
        "step": statistics.mean(step_times),
        "blocked": statistics.median(blocked) if blocked else 0.0,
        "wall": wall,
        "write": statistics.median(x.write_seconds for x in saves) if saves else 0.0,
    }


def write_alone(width: int, depth: int, repeats: int) -> float:
    """The same write with nothing else running: DCP's save of a host copy of the
    loop's state (what the Checkpointer writes), median seconds."""
    from async_stager._dcp.blocking import save_blocking

    m, opt, x = model(width, depth)
    m(x).square().mean().backward()
    opt.step()
    sd = {"model": {k: v.clone() for k, v in m.state_dict().items()}, "optim": opt.state_dict()}
    times = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            save_blocking(sd, no_dist=True, checkpoint_id=d)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


MODES = ("none", "checkpointer", "checkpointer-nosum", "dcp-our-stager", "dcp-torch-stager")


async def end_to_end(steps: int, every: int, width: int, depth: int, rounds: int) -> None:
    m, _, _ = model(width, depth)
    params = sum(p.numel() for p in m.parameters())
    print(
        f"training loop: MLP {depth}x{width} ({params / 1e6:.1f} M params, state {params * 12 / 2**20:.0f} MiB "
        f"with AdamW), {steps} steps, a checkpoint every {every}; {rounds} rounds, modes rotated, medians"
    )
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for r in range(rounds):
        for mode in MODES[r % len(MODES) :] + MODES[: r % len(MODES)]:
            with tempfile.TemporaryDirectory() as d:
                runs[mode].append(await loop(mode, Path(d), steps, every, width, depth))
    med = {mode: {k: statistics.median(run[k] for run in rs) for k in rs[0]} for mode, rs in runs.items()}
    base = med["none"]["step"]
    for mode in MODES:
        v = med[mode]
        extra = f"  background write {v['write'] * 1e3:6.1f} ms" if v["write"] else ""
        print(
            f"  {mode:19s} step {v['step'] * 1e3:7.2f} ms ({v['step'] / base:5.3f}x)  "
            f"blocked per checkpoint {v['blocked'] * 1e3:7.1f} ms  loop {v['wall']:6.2f} s{extra}"
        )
    alone = write_alone(width, depth, max(3, rounds))
    c = med["checkpointer"]
    print(f"  the same write alone: {alone * 1e3:.1f} ms")
    print("targets (issue 24):")
    print(
        f"  blocked, save with checksums / async_save with our DefaultStager: "
        f"{c['blocked'] / med['dcp-our-stager']['blocked']:.2f} (target <= 1.2)"
    )
    print(
        f"  blocked, async_save with PyTorch's DefaultStager / save with checksums: "
        f"{med['dcp-torch-stager']['blocked'] / c['blocked']:.2f} (target >= 2)"
    )
    print(f"  step time with a checkpoint every {every} / without: {c['step'] / base:.3f} (target <= 1.05)")
    print(f"  background write / the same write alone: {c['write'] / alone:.2f} (target <= 1.2)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3, help="loops per mode (medians are reported)")
    p.add_argument("--skip-checksum-cost", action="store_true", help="only the training loop")
    args = p.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    if not args.skip_checksum_cost:
        asyncio.run(checksum_cost(args.repeats))
    asyncio.run(end_to_end(args.steps, args.every, args.width, args.depth, args.rounds))


if __name__ == "__main__":
    main()
