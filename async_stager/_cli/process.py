"""``bench-process``: DCP's process writer with our DefaultStager against DCP's own.

Each contender runs in its own group of rank processes (spawned, a gloo group of
``world`` ranks; each rank gets its own DCP writer daemon, as with torchtitan's
``async_with_pinned_mem``), so their memory figures do not mix. In each rank:
``checkpoints`` times, the state dict is modified in place (as an optimizer step
would), then ``dcp.async_save(..., async_stager=stager,
async_checkpointer_type=AsyncCheckpointerType.PROCESS)``; the staging time is from the
call until its staging completes, and the upload is awaited before the next step. The
rank then reports: staging times, its host memory (RSS and PSS from
``/proc/self/smaps_rollup``) before the first checkpoint, after it and after the last, what its
``ForkingPickler`` sent (storages by arena reference, arena descriptors, storages
through torch's reducer, one descriptor each, and the bytes torch copied because they
were not shared yet: ``_mp_reduce.counters``), whether the stager still stages into
its own arenas, and whether ``dcp.load`` of the last checkpoint is bit-exact.

Contenders: ``ours`` (async_stager's ``DefaultStager(CheckpointStagerConfig(
use_shared_memory=True))``), ``dcp`` (``torch.distributed.checkpoint.staging.
DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=True,
use_async_staging=True))``, CPU) and, on request, ``ours-torch-reducers``: ours with
torch's own reducers put back, the behaviour before ``_mp_reduce``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import socket
import statistics
import tempfile
import textwrap
import time
import warnings
from typing import Any

import torch

from .report import BenchError

__all__ = ["CONTENDERS", "add_arguments", "rank_main", "run_group", "run_process_bench"]

CONTENDERS = ("ours", "dcp", "ours-torch-reducers")


def _memory() -> dict[str, int]:
    """This process's Rss and Pss (bytes), from /proc/self/smaps_rollup."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("Rss", "Pss", "Pss_Shmem", "Shared_Clean", "Shared_Dirty"):
                    out[key.lower()] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def _state_dict(rank: int, tensors: int, nbytes: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234 + rank)
    n = max(1, nbytes // 4 // tensors)
    # Keys differ per rank: DCP writes every rank's tensors (no replication dedup).
    return {f"r{rank}.t{i}": torch.randn(n, generator=g) for i in range(tensors)}


def _make_stager(kind: str) -> Any:
    if kind == "dcp":
        from torch.distributed.checkpoint.staging import DefaultStager as DcpStager, StagingOptions

        return DcpStager(
            StagingOptions(
                use_pinned_memory=False,
                use_shared_memory=True,
                use_async_staging=True,
                use_non_blocking_copy=False,
            )
        )
    from async_stager._dcp.default_stager import DefaultStager
    from async_stager._dcp.interface import CheckpointStagerConfig
    from async_stager._share import reducers as _mp_reduce

    if kind == "ours-torch-reducers":
        from multiprocessing.reduction import ForkingPickler

        from torch.multiprocessing import reductions

        for t in (torch.Tensor, torch.nn.Parameter):
            ForkingPickler.register(t, reductions.reduce_tensor)
        ForkingPickler.register(torch.UntypedStorage, _mp_reduce.delegate_storage)
    return DefaultStager(CheckpointStagerConfig(use_pinned_memory=False, use_shared_memory=True))


def _in_own_arenas(stager: Any) -> bool | None:
    """Whether every storage of the stager's last result lies in its own arenas (None:
    not our stager)."""
    from async_stager._core.aio.internals import internals_of

    handle = internals_of(stager)
    staged = getattr(stager, "get_staged_state_dict", None)
    if handle is None or not callable(staged):
        return None
    ranges = [(a.base, a.base + a.nbytes) for a in handle.shared_arenas()]
    sd = staged() or {}
    for t in sd.values():
        s = t.untyped_storage()
        p = s.data_ptr()
        if not any(lo <= p and p + s.nbytes() <= hi for lo, hi in ranges):
            return False
    return True


def rank_main(rank: int, world: int, port: int, kind: str, opts: dict[str, Any], out: Any) -> None:
    """One rank of a group: see the module docstring. Puts a dict of results on ``out``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.setdefault("LOCAL_RANK", str(rank))
    warnings.filterwarnings("ignore", message=".*TypedStorage is deprecated.*")
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from async_stager._share import reducers as _mp_reduce

    result: dict[str, Any] = {"rank": rank, "kind": kind}
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        torch.set_num_threads(1)
        sd = _state_dict(rank, opts["tensors"], opts["nbytes"])
        stager = _make_stager(kind)
        stage_s: list[float] = []
        memory: list[dict[str, int]] = [_memory()]  # before the first checkpoint
        own: list[bool | None] = []
        path = ""
        _mp_reduce.counters(reset=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(opts["checkpoints"]):
                for t in sd.values():
                    t.add_(1.0)
                path = os.path.join(opts["dir"], kind, str(i))
                t0 = time.perf_counter()
                resp: Any = dcp.async_save(
                    sd,
                    checkpoint_id=path,
                    async_stager=stager,
                    async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                )
                if hasattr(resp, "staging_completion"):
                    resp.staging_completion.result()
                    upload = resp.upload_completion
                else:
                    upload = resp
                stage_s.append(time.perf_counter() - t0)
                upload.result()
                own.append(_in_own_arenas(stager))
                if i == 0:
                    memory.append(_memory())
            memory.append(_memory())
        counts = _mp_reduce.counters()
        fresh = {k: torch.zeros_like(v) for k, v in sd.items()}
        dcp.load(fresh, checkpoint_id=path)
        exact = all(torch.equal(fresh[k].view(torch.int32), sd[k].view(torch.int32)) for k in sd)
        host_bytes = getattr(stager, "host_bytes", None)
        stager.close()
        result.update(
            stage_s=stage_s,
            memory_before=memory[0],
            memory_first=memory[1],
            memory_last=memory[-1],
            counters=counts.__dict__,
            in_own_arenas=own,
            host_bytes=host_bytes,
            exact=exact,
            warnings=[str(w.message) for w in caught if "async_stager" in str(w.message)],
        )
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        out.put(result)
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_group(kind: str, world: int, opts: dict[str, Any], timeout: float = 300.0) -> list[dict[str, Any]]:
    """Spawn ``world`` ranks running ``kind``; their results, by rank. Raises
    RuntimeError if a rank failed or did not answer within ``timeout`` seconds."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, kind, opts, out)) for r in range(world)]
    for p in procs:
        p.start()
    results: list[dict[str, Any]] = []
    try:
        for _ in procs:
            results.append(out.get(timeout=timeout))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise RuntimeError(f"{kind} with {world} rank(s) failed: {errors}")
    return sorted(results, key=lambda r: int(r["rank"]))


def _row(kind: str, results: list[dict[str, Any]], checkpoints: int) -> dict[str, Any]:
    r0 = results[0]
    c = r0["counters"]
    return {
        "contender": kind,
        "stage_ms_median": statistics.median(r0["stage_s"][1:] or r0["stage_s"]) * 1e3,
        "stage_ms_first": r0["stage_s"][0] * 1e3,
        "rss_mib_before": r0["memory_before"].get("rss", 0) / 2**20,
        "rss_mib_first": r0["memory_first"].get("rss", 0) / 2**20,
        "rss_mib_last": r0["memory_last"].get("rss", 0) / 2**20,
        "pss_mib_last": r0["memory_last"].get("pss", 0) / 2**20,
        "descriptors_per_checkpoint": (c["arena_descriptors"] + c["delegated"]) / checkpoints,
        "copied_mib": c["copied_bytes"] / 2**20,
        "in_own_arenas": r0["in_own_arenas"][-1],
        "exact": all(r["exact"] for r in results),
        "warnings": sorted({w for r in results for w in r["warnings"]}),
    }


def run_process_bench(
    kinds: list[str], world: int, checkpoints: int, tensors: int, nbytes: int
) -> list[dict[str, Any]]:
    """One row per contender, measured in this run (see the module docstring)."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="async_stager-bench-process-") as d:
        opts = {"checkpoints": checkpoints, "tensors": tensors, "nbytes": nbytes, "dir": d}
        for kind in kinds:
            rows.append(_row(kind, run_group(kind, world, opts), checkpoints))
    return rows


#: The printed lines are at most this wide (the table's rows are, for the sizes this
#: command takes; the title, the legend and warnings are wrapped).
WIDTH = 100


def format_rows(rows: list[dict[str, Any]], world: int, checkpoints: int, tensors: int, nbytes: int) -> str:
    """The rows as a Markdown table under a title, with a legend of its columns and any
    warnings after it; every line at most WIDTH columns."""

    def wrap(text: str, indent: str = "  ") -> list[str]:
        return textwrap.wrap(text, WIDTH, subsequent_indent=indent, break_on_hyphens=False)

    lines = [
        *wrap(f"DCP async_save PROCESS mode, CPU, gloo world {world} (rank 0 shown)"),
        *wrap(f"{checkpoints} checkpoints of {tensors} tensors, {nbytes / 2**20:.0f} MiB per rank"),
    ]
    lines += [
        "",
        "| stager | stage ms | RSS MiB | PSS MiB | fds/ckpt | pickler copied | own arenas | exact |",
        "|:--|--:|--:|--:|--:|--:|:--|:--|",
    ]
    for r in rows:
        lines.append(
            f"| {r['contender']} | {r['stage_ms_median']:.1f}; {r['stage_ms_first']:.1f} | "
            f"{r['rss_mib_before']:.0f} -> {r['rss_mib_first']:.0f} -> {r['rss_mib_last']:.0f} | "
            f"{r['pss_mib_last']:.0f} | "
            f"{r['descriptors_per_checkpoint']:.0f} | {r['copied_mib']:.0f} MiB | "
            f"{'-' if r['in_own_arenas'] is None else r['in_own_arenas']} | {r['exact']} |"
        )
    lines.append("")
    lines += wrap(
        f"stage ms: the median of checkpoints 2-{checkpoints}; the first. RSS MiB: before the first "
        f"checkpoint -> after it -> after the {checkpoints}th. PSS MiB: after the last. fds/ckpt: "
        "descriptors sent per checkpoint. pickler copied: bytes torch copied into new shared "
        "memory. own arenas: the stager still stages into its own arenas. exact: dcp.load of the "
        "last checkpoint is bit-exact."
    )
    for r in rows:
        for w in r["warnings"]:
            lines += wrap(f"warning ({r['contender']}): {w}", "    ")
    return "\n".join(lines)


def _contenders(flag: str, text: str, namespace: argparse.Namespace) -> str:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    bad = [k for k in kinds if k not in CONTENDERS]
    if not kinds or bad:
        raise ValueError(
            f"{flag} {text!r}: {'unknown ' + ', '.join(map(repr, bad)) if bad else 'names none'}; "
            f"choose from {', '.join(CONTENDERS)}"
        )
    if len(set(kinds)) != len(kinds):
        raise ValueError(f"{flag} {text!r} names a contender twice")
    return ",".join(kinds)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench-process`` flags, each checked while parsing (a bad one is a usage
    error, exit status 2, before any process starts)."""
    from .args import Checked, int_at_least

    parser.add_argument("--world", type=int, choices=(1, 2), default=2, help="gloo ranks (default 2)")
    parser.add_argument(
        "--checkpoints",
        action=Checked,
        convert=int_at_least(2),
        default=10,
        metavar="N",
        help="checkpoints per contender, at least 2 (default 10)",
    )
    parser.add_argument(
        "--tensors",
        action=Checked,
        convert=int_at_least(1),
        default=64,
        metavar="N",
        help="tensors per rank (default 64)",
    )
    parser.add_argument(
        "--mib",
        action=Checked,
        convert=int_at_least(1),
        default=128,
        metavar="N",
        help="MiB per rank (default 128)",
    )
    parser.add_argument(
        "--contenders",
        action=Checked,
        convert=_contenders,
        default="ours,dcp",
        metavar="A,B",
        help=f"comma-separated, from {','.join(CONTENDERS)} (default ours,dcp)",
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")


def run_cli(ns: argparse.Namespace) -> int:
    """Run the parsed ``bench-process`` command; BenchError if a rank group fails."""
    kinds = [k for k in ns.contenders.split(",") if k]
    nbytes = ns.mib * 2**20
    try:
        rows = run_process_bench(kinds, ns.world, ns.checkpoints, ns.tensors, nbytes)
    except (RuntimeError, queue.Empty) as exc:  # a rank failed or did not answer
        raise BenchError(str(exc) or "a rank did not answer in time") from exc
    if ns.json:
        print(json.dumps(rows, indent=2))
    else:
        print(format_rows(rows, ns.world, ns.checkpoints, ns.tensors, nbytes))
    return 0
