"""The Checkpointer on S3 against DCP's fsspec writer and reader (issue 44's measure):
a local S3 server (moto's server mode, started here on a free loopback port), one state
of SIZE MiB (float32 tensors of 16 MiB), for each size:

- ours, S3: ``Checkpointer("s3://...")``: the time ``save()`` blocked the caller, the
  time from ``save()`` to the commit (``wait()`` returned), ``restore()``'s time;
- ours, folder: the same into a local folder (the blocked-time reference);
- DCP + s3fs: ``torch.distributed.checkpoint.async_save`` with ``FsspecWriter`` (its
  own staging: the time it blocked; the time to the upload's end), then ``load`` with
  ``FsspecReader``.

Medians of ``--rounds`` rounds, each on a new prefix.

    pip install -e '.[test]' s3fs
    python scripts/bench_s3_checkpointer.py --sizes 100 --rounds 3
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_store import KEY_ID, REGION, SECRET, start_moto

MiB = 1 << 20


def make_state(mib: int) -> dict[str, Any]:
    n = max(1, mib // 16)
    return {f"layer{i}": torch.randn(4 * MiB) for i in range(n)} | {"step": 0}


def ours(url: str, state: dict[str, Any]) -> dict[str, float]:
    from async_stager import Checkpointer

    async def run() -> dict[str, float]:
        async with Checkpointer(url, keep=2, checksums=True) as ckpt:
            await ckpt.save(state, step=0)  # warm: buffer sets allocated, pinned
            await ckpt.wait()
            t0 = time.perf_counter()
            await ckpt.save(state, step=1)
            blocked = time.perf_counter() - t0
            await ckpt.wait()
            commit = time.perf_counter() - t0
            target = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
            t1 = time.perf_counter()
            assert await ckpt.restore(target) == 1
            restore = time.perf_counter() - t1
        return {"blocked": blocked, "commit": commit, "restore": restore}

    return anyio.run(run)


def dcp_fsspec(url: str, state: dict[str, Any]) -> dict[str, float]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warm = {"w": torch.zeros(16)}
        dcp.save(warm, storage_writer=FsspecWriter(url + "-warm"), no_dist=True)  # warm: s3fs's session
        t0 = time.perf_counter()
        response: Any = dcp.async_save(state, storage_writer=FsspecWriter(url), no_dist=True)
        blocked = time.perf_counter() - t0
        getattr(response, "upload_completion", response).result()
        commit = time.perf_counter() - t0
        target = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        t1 = time.perf_counter()
        dcp.load(target, storage_reader=FsspecReader(url), no_dist=True)
        restore = time.perf_counter() - t1
    return {"blocked": blocked, "commit": commit, "restore": restore}


def _empty(client: Any, prefix: str) -> None:
    for page in client.get_paginator("list_objects_v2").paginate(Bucket="bench", Prefix=prefix):
        for item in page.get("Contents", []):
            client.delete_object(Bucket="bench", Key=item["Key"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="100", help="MiB, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    proc, endpoint = start_moto()
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID=KEY_ID,
        AWS_SECRET_ACCESS_KEY=SECRET,
        AWS_DEFAULT_REGION=REGION,
        AWS_EC2_METADATA_DISABLED="true",
    )
    try:
        import botocore.session

        client = botocore.session.get_session().create_client("s3", endpoint_url=endpoint, region_name=REGION)
        client.create_bucket(Bucket="bench")
        with tempfile.TemporaryDirectory() as tmp:
            os.environ["ASYNC_STAGER_SCRATCH"] = os.path.join(tmp, "scratch")
            for mib in (int(s) for s in args.sizes.split(",")):
                state = make_state(mib)
                rows: dict[str, list[dict[str, float]]] = {"ours S3": [], "ours folder": [], "DCP+s3fs": []}
                for r in range(args.rounds):
                    s3_ours, s3_dcp = f"s3://bench/ours-{mib}-{r}", f"s3://bench/dcp-{mib}-{r}"
                    folder = os.path.join(tmp, f"folder-{mib}-{r}")
                    runs: list[tuple[str, Callable[[], dict[str, float]], str | None]] = [
                        ("ours S3", functools.partial(ours, s3_ours, state), f"ours-{mib}-{r}"),
                        ("ours folder", functools.partial(ours, folder, state), None),
                        ("DCP+s3fs", functools.partial(dcp_fsspec, s3_dcp, state), f"dcp-{mib}-{r}"),
                    ]
                    for name, run, prefix in runs:
                        try:
                            got = run()
                        except Exception as exc:  # noqa: BLE001 - reported, the others still run
                            print(
                                f"{mib} MiB round {r} {name}: FAILED {type(exc).__name__}: {str(exc)[:200]}"
                            )
                            continue
                        rows[name].append(got)
                        print(f"{mib} MiB round {r} {name}: {got}", flush=True)
                        if prefix is not None:  # moto keeps every object in memory
                            _empty(client, prefix)
                        shutil.rmtree(os.path.join(tmp, f"folder-{mib}-{r}"), ignore_errors=True)
                print(f"\n{mib} MiB, median of {args.rounds} (seconds)")
                print(f"{'':14} {'blocked':>9} {'to commit':>10} {'restore':>9}")
                for name, done in rows.items():
                    if not done:
                        continue
                    med = {k: statistics.median(g[k] for g in done) for k in ("blocked", "commit", "restore")}
                    print(f"{name:14} {med['blocked']:9.3f} {med['commit']:10.3f} {med['restore']:9.3f}")
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
