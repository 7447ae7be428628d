"""Enqueue a plan's copies on its devices' copiers, and find the tensor a failed batch
tripped on.

A plan has one copy program per source device (``_layout.DeviceProgram``). Running it
means: ``begin`` on that device's copier (its copy stream waits for the stage's capture
there), the gathers of small-tensor runs, the direct copies (batched, chunked so torch
never parses one huge tensor list holding the GIL), ``protect`` (sources kept from the
caching allocator until the copies land) and ``end`` (the completion to poll). Called
on the worker thread only.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from async_stager._core.checksum.digest import Checksums
from async_stager._core.copy.device import Completion, Copier, order_after
from async_stager._core.copy.hostcopy import GROUP_MAX
from async_stager._core.plan.build import sources
from async_stager._core.plan.layout import Plan
from async_stager._core.walk.tree import path_of_leaf
from async_stager.errors import CopyError, StagingError

__all__ = ["COPY_CHUNK", "copy_chunked", "diagnose_copy_error", "enqueue", "no_torch_function"]

#: Tensors per batched copy call: the same bound as the host copy pool's groups.
COPY_CHUNK = GROUP_MAX

CopierFor = Callable[[torch.device], Copier]
#: Called with completions now in flight into the stage's buffer set.
Track = Callable[[Sequence[Completion]], None]


def no_torch_function() -> Any:
    """Tensor subclasses' ``__torch_function__`` overrides off (this thread) while the
    engine inspects and copies their data: staging copies the bytes as they are, and an
    override that raises or redirects must not break or bend that."""
    return torch._C.DisableTorchFunctionSubclass()


def copy_chunked(
    copier: Copier, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], tick: Callable[[], None]
) -> None:
    """``copier.copy`` in chunks of COPY_CHUNK tensors, a cancellation check between."""
    n = len(dsts)
    if n <= COPY_CHUNK:
        copier.copy(dsts, srcs)
        return
    for lo in range(0, n, COPY_CHUNK):
        copier.copy(dsts[lo : lo + COPY_CHUNK], srcs[lo : lo + COPY_CHUNK])
        tick()


def enqueue(
    copier_for: CopierFor,
    plan: Plan,
    leaves: list[torch.Tensor],
    captures: Mapping[torch.device, Any],
    tick: Callable[[], None],
    latest: dict[torch.device, Completion],
    track: Track,
    checksums: Checksums | None = None,
    first: bool = False,
) -> tuple[list[Completion], list[torch.device]]:
    """Enqueue every program's copies; returns the completions and, pairwise, the
    device each belongs to (CPU programs finish inside and have none). ``latest``
    gets each device's newest completion (what ``fence`` orders after).

    Ordering: each device's copies wait (on the device) for its capture; the CPU
    program's host copies wait (in this thread) for every capture, since a pinned CPU
    leaf may still be filled by a ``non_blocking`` copy queued before the call. So the
    CPU program goes last: the device copies are already enqueued while it waits.

    Failure or cancellation (a tick) part way: copies enqueued before that may still
    read the sources and land in the set's buffers, so their sources are protected and
    their completions passed to ``track`` before the error propagates; no later stage
    (or close) reuses the buffers before they finish.

    ``checksums``: the digests of every destination of a program whose copies have
    landed when it ends (the CPU's): hashed by the copy threads as pieces land, the
    rest by this thread after the program. A device program hashes its big direct
    sources on the device (``Copier.hash_sources``); the rest of it is hashed from the
    host copy later, by the caller. ``first``: the plan's memory was mapped by this stage (see
    ``Copier.copy_planned``)."""
    completions: list[Completion] = []
    devices: list[torch.device] = []
    programs = sorted(plan.programs, key=lambda p: p.device.type == "cpu")
    with torch.no_grad():
        for prog in programs:
            copier = copier_for(prog.device)
            srcs_all: list[torch.Tensor] = []
            try:
                # Hazard: from begin() to end() the copier may hold a stream context on
                # this thread; end() must run whatever happens.
                copier.begin(order_after(prog.device, captures))
                direct: list[torch.Tensor] = []
                if prog.direct:
                    if prog.direct_whole:
                        direct = sources(prog.direct, leaves)
                    elif prog.direct_in_order and len(leaves) == len(prog.direct_reps):
                        # Every leaf, in order: no gather (a C call over every leaf,
                        # holding the GIL throughout). Read only, never changed here.
                        direct = leaves
                    elif len(prog.direct_reps) == 1:
                        direct = [leaves[prog.direct_reps[0]]]
                    else:
                        direct = list(operator.itemgetter(*prog.direct_reps)(leaves))
                    srcs_all.extend(direct)
                    if checksums is not None:
                        # Before any copy of this program: a device hashes the sources
                        # as of the capture, on its own stream (the CPU's copy threads
                        # hash as pieces land instead: a no-op there).
                        # A whole storage copied for its views: the results are the
                        # views, hashed from the host copy; not worth a device hash.
                        pairs = [
                            (d, src)
                            for d, src, unit in zip(prog.direct_dsts, direct, prog.direct)
                            if not unit.whole
                        ]
                        copier.hash_sources([d for d, _ in pairs], [src for _, src in pairs], checksums)
                for run in prog.runs:
                    for views, units in run.groups:
                        srcs = sources(units, leaves)
                        srcs_all.extend(srcs)
                        copy_chunked(copier, views, srcs, tick)
                    copier.copy([run.span], [run.scratch])
                if prog.direct:
                    srcs = direct
                    if prog.direct_layout is not None:
                        copier.copy_planned(
                            prog.direct_dsts, srcs, prog.direct_layout, tick, checksums, first
                        )
                    else:
                        copy_chunked(copier, prog.direct_dsts, srcs, tick)
                copier.protect(srcs_all)
            except BaseException:
                try:
                    copier.protect(srcs_all)
                finally:
                    done = copier.end()
                if done is not None:
                    completions.append(done)
                    devices.append(prog.device)
                    latest[prog.device] = done
                track(completions)
                raise
            done = copier.end()
            if done is not None:
                completions.append(done)
                devices.append(prog.device)
                latest[prog.device] = done
            elif checksums is not None:
                # Landed: what the copy threads did not hash (small programs, runs).
                checksums.hash_now(prog.direct_dsts)
                checksums.hash_now(run.span for run in prog.runs)
    return completions, devices


def diagnose_copy_error(
    copier_for: CopierFor,
    sd: Any,
    plan: Plan,
    leaves: list[torch.Tensor],
    captures: Mapping[torch.device, Any],
    cause: BaseException,
    latest: dict[torch.device, Completion],
    track: Track,
) -> StagingError:
    """Find which unit's copy fails, for an error that names its path: each unit is
    copied again on its own, through its device's copier (the failed batch may have
    mixed many tensors). The copies are those of a stage: ordered after the stage's
    captures, their sources protected from the allocator, their completions tracked in
    flight and the latest of their device (for ``fence``)."""
    with torch.no_grad(), no_torch_function():
        for unit in plan.units:
            copier = copier_for(unit.device)
            srcs: list[torch.Tensor] = []
            try:
                copier.begin(order_after(unit.device, captures))
                srcs = sources([unit], leaves)
                copier.copy([unit.dst], srcs)
            except RuntimeError as e:
                err = CopyError(f"copying this tensor failed: {e}", path=path_of_leaf(sd, unit.rep))
                err.__cause__ = e
                return err
            finally:
                try:
                    copier.protect(srcs)
                finally:
                    done = copier.end()
                    if done is not None:
                        latest[unit.device] = done
                        track([done])
    err = CopyError(f"a batched copy failed ({cause}), but no single copy did")
    err.__cause__ = cause
    return err
