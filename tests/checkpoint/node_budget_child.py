"""One rank of the node-budget tests (test_node_budget_procs.py, scripts/bench_node_budget.py).

``python node_budget_child.py CONFIG_JSON``: a gloo rank that saves its state every
step with a Checkpointer at a node budget (or a per-process ``host_budget_bytes``),
then restores every checkpoint it saved and checks it bit-exact; or (``"restore"``)
restores a job's checkpoints at another world size. Its state: per key ``w<i>`` a
DTensor sharded on dim 0 (``layout="dtensor"``: every rank the same sizes, so a restore
at another world size reshards) or a plain tensor ``r<rank>.w<i>`` (``"plain"``: each
rank its own keys and sizes). Values are a function of (rank, key, step): a restore
recomputes them. Writes ``<out>/ready-<rank>`` (its RSS after warm-up, the sampler's
baseline), ``<out>/saving-<rank>`` before its first save, and ``<out>/rank-<rank>.json``
(per save: path taken, node wait, seconds; the restores checked).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import warnings
from typing import Any

warnings.filterwarnings("ignore")

MiB = 1 << 20


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def local_part(rank: int, i: int, numel: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(1000 * rank + i)
    return torch.randn(numel, generator=g)


def make_state(cfg: dict[str, Any], rank: int, world: int, step: int) -> dict[str, Any]:
    """The state of ``rank`` as of ``step`` (``step`` in-place adds of 1.0)."""
    import torch

    numel = cfg["tensor_mib"] * MiB // 4
    keys = cfg["sizes_mib"][rank] // cfg["tensor_mib"]
    out: dict[str, Any] = {}
    for i in range(keys):
        t = local_part(rank, i, numel)
        for _ in range(step):
            t.add_(1.0)
        out[f"r{rank}.w{i}" if cfg["layout"] == "plain" else f"w{i}"] = t
    del torch
    return out


def as_dtensors(local: dict[str, Any], world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    return {k: DTensor.from_local(v, mesh, [Shard(0)], run_check=False) for k, v in local.items()}


def main() -> None:
    cfg = json.loads(sys.argv[1])
    rank, world = cfg["rank"], cfg["world"]
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(cfg["port"])
    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    import anyio
    import torch
    import torch.distributed as dist

    from async_stager import Checkpointer

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=cfg.get("gloo_timeout", 60))
    )
    out_dir = cfg["out"]
    report: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "saves": [], "restored": []}

    if cfg["mode"] == "restore":
        restore_at(cfg, rank, world, report)
        with open(os.path.join(out_dir, f"restore-{rank}.json"), "w") as f:
            json.dump(report, f)
        dist.barrier()
        dist.destroy_process_group()
        return

    local = make_state(cfg, rank, world, 0)
    sd: dict[str, Any] = {"model": as_dtensors(local, world) if cfg["layout"] == "dtensor" else local}
    kwargs: dict[str, Any] = {"keep": cfg["steps"] + 1}
    if cfg.get("host_budget_bytes"):
        kwargs["host_budget_bytes"] = cfg["host_budget_bytes"]
    else:
        kwargs.update(node_budget_bytes=cfg["budget"], node_budget_path=cfg["ledger"])

    async def run() -> None:
        async with Checkpointer(cfg["ckpt"], **kwargs) as ckpt:
            with open(os.path.join(out_dir, f"ready-{rank}"), "w") as f:
                f.write(str(rss()))
            dist.barrier()
            t0 = time.monotonic()
            for step in range(1, cfg["steps"] + 1):
                for t in local.values():
                    t.add_(1.0)  # the "training step": the DTensors view these
                await anyio.sleep(cfg["delays"][rank])
                if step == 1:
                    open(os.path.join(out_dir, f"saving-{rank}"), "w").close()
                s0 = time.monotonic()
                await ckpt.save(sd, step=step)
                blocked = time.monotonic() - s0
                await ckpt.wait()
                st = ckpt.last
                assert st is not None and st.step == step
                report["saves"].append(
                    {
                        "step": step,
                        "admission": st.admission,
                        "node_wait": st.node_wait_seconds,
                        "blocked": blocked,
                        "seconds": time.monotonic() - s0,
                        "ring": st.budget.arena_bytes if st.budget is not None else 0,
                    }
                )
            report["wall"] = time.monotonic() - t0
        report["steps"] = sorted(Checkpointer(cfg["ckpt"]).steps())
        open(os.path.join(out_dir, f"done-{rank}"), "w").close()  # the sampler stops counting it

    try:
        anyio.run(run)
    except BaseException as e:  # noqa: BLE001 - reported: the parent asserts on it
        report["failed"] = f"{type(e).__name__}: {e}"[:2000]
        with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as f:
            json.dump(report, f)
        sys.stdout.flush()
        os._exit(3)  # a dead peer: do not wait in destroy_process_group
    if cfg.get("restore", True):
        restore_at(cfg, rank, world, report)
    with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


def restore_at(cfg: dict[str, Any], rank: int, world: int, report: dict[str, Any]) -> None:
    """Restore every step of the job (saved by ``cfg["saved_world"]`` ranks) at this
    world size and check each bit-exact."""
    import anyio
    import torch

    from async_stager import Checkpointer

    saved_world = cfg.get("saved_world", world)
    per = saved_world // world  # saved ranks whose shards this rank now holds

    async def run() -> None:
        async with Checkpointer(cfg["ckpt"]) as ckpt:
            for step in ckpt.steps():
                parts = [make_state(cfg, r, saved_world, step) for r in range(rank * per, (rank + 1) * per)]
                if cfg["layout"] == "dtensor":
                    expect = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
                    out: dict[str, Any] = {
                        "model": as_dtensors({k: torch.zeros_like(v) for k, v in expect.items()}, world)
                    }
                    assert await ckpt.restore(out, step=step, fallback=False) == step
                    for k, v in expect.items():
                        assert torch.equal(out["model"][k].to_local(), v), (step, k)
                else:
                    expect = {k: v for p in parts for k, v in p.items()}
                    out = {"model": {k: torch.zeros_like(v) for k, v in expect.items()}}
                    assert await ckpt.restore(out, step=step, fallback=False) == step
                    for k, v in expect.items():
                        assert torch.equal(out["model"][k], v), (step, k)
                report["restored"].append(step)

    anyio.run(run)


if __name__ == "__main__":
    main()
