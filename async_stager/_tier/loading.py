"""A memory snapshot loaded for a restore: checked once, then read straight into the state.

``load_snapshot`` fetches a snapshot from the agent and checks it: a snapshot the
agent sealed and verified after the seal (``Fetched.sealed``: the agent's word, and the
kernel's seals on the descriptors) is trusted, since no process can have changed its
bytes since that verification (``sealing``); any other is verified here, every byte
against its digest, as before. It is then attached (``attach_shared``: the structure,
its tensors viewing private mappings of the arenas, nothing read yet).

``Loaded.read_into(target)`` is the copy, once: each tensor of the snapshot whose
counterpart in ``target`` (the state's current values, ``resolve``d) is a CPU tensor
of the same dtype and shape, both contiguous, is read from the arena's descriptor
directly into that tensor (``preadv``, on several threads). The kernel copies from the
page cache, so no page of the snapshot is mapped into this process: mapping a GiB of
4 KiB pages costs about as much as copying it (this machine: 0.2-0.35 s). The
structure returned has those leaves replaced by the state's own tensors, so the
``copy_`` of ``load_state_dict`` that follows finds source and destination the same
memory and returns at once. Every other leaf (another dtype, a GPU tensor, a key the
state lacks, destinations that overlap) keeps its mapped view and is copied as before.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any

import torch

from async_stager._core.aio.threads import run_in_thread
from async_stager._share.handoff import AttachedStateDict, SharedHandle, attach_shared
from async_stager._tier.client import AgentClient, Fetched, verify_fetched

__all__ = ["Loaded", "load_into", "load_snapshot"]

#: Bytes per read: the unit the reading threads share.
READ_BYTES = 16 << 20

#: (destination address, bytes, arena slot, offset in the arena).
_Job = tuple[int, int, int, int]


class Loaded:
    """A fetched snapshot, checked (``trusted``: sealed and verified by the agent, not
    read again here; else verified here) and attached. Holds the arenas' descriptors
    until ``close`` (``read_into`` reads through them). A context manager."""

    def __init__(self, attached: AttachedStateDict, fetched: Fetched, trusted: bool) -> None:
        self.attached = attached
        self.fetched = fetched
        self.trusted = trusted

    @property
    def state_dict(self) -> Any:
        """The attached structure (tensors view the arenas). ClosedError once closed."""
        return self.attached.state_dict

    @property
    def handle(self) -> SharedHandle:
        return self.attached.handle

    @property
    def closed(self) -> bool:
        return self.attached.closed

    def close(self) -> None:
        """Drop the structure and close the descriptors (tensors kept from it keep
        their mappings). Idempotent."""
        self.attached.close()
        self.fetched.close()

    def __enter__(self) -> Loaded:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def read_into(self, target: Any, threads: int | None = None) -> Any:
        """Read every tensor of the snapshot that has an eligible counterpart in
        ``target`` (see the module doc) into it, and return the snapshot's structure
        with those leaves replaced by ``target``'s tensors (the rest as attached).
        Blocking (run it in a thread); ``threads``: readers (default the cores, at most
        4). Raises OSError if a read fails (the tensors read so far hold the new
        bytes, the others the old)."""
        spans = self.attached.spans()
        fds = self.fetched.fds
        leaves: list[tuple[torch.Tensor, torch.Tensor, _Job | None]] = []

        def pair(dst: Any, src: Any) -> Any:
            if isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor):
                leaves.append((dst, src, _job(dst, src, spans)))
                return _Leaf(len(leaves) - 1)
            return src

        shaped = _zip(target, self.state_dict, pair)
        keep = _without_overlaps(leaves)
        jobs = sorted({job for i in keep if (job := leaves[i][2]) is not None})
        _read(fds, jobs, threads)
        for i in keep:
            _bump(leaves[i][0])
        return _unleaf(shaped, lambda i: leaves[i][0] if i in keep else leaves[i][1])


async def load_snapshot(
    client: AgentClient, rank: int, step: int, *, ns: str, timeline: str | None, wait: float
) -> Loaded:
    """Fetch snapshot ``step`` of ``rank`` (giving the agent ``wait`` seconds to seal
    and verify it), check it (trusted if sealed, else verified here: IntegrityError)
    and attach it. Raises AgentError (gone, refused). Cancellation: the descriptors
    are closed; a verification in its thread finishes first."""
    fetched = await client.fetch(rank, step, ns=ns, timeline=timeline, wait=wait)
    try:
        if not fetched.sealed:
            await run_in_thread(lambda: verify_fetched(fetched), name="async-stager-tier-verify")
        attached = attach_shared(fetched.handle)
    except BaseException:
        fetched.close()
        raise
    return Loaded(attached, fetched, fetched.sealed)


def load_into(snapshot: Any, target: Any) -> Any:
    """The structure to apply to the state: ``snapshot.read_into(target)`` for a
    ``Loaded``, else its attached ``state_dict`` (copied from as it is). Blocking."""
    if isinstance(snapshot, Loaded):
        return snapshot.read_into(target)
    return snapshot.state_dict


class _Leaf:
    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i


def _zip(target: Any, loaded: Any, pair: Callable[[Any, Any], Any]) -> Any:
    """``loaded``'s structure, each leaf with a counterpart at the same path in
    ``target`` (dict keys, list and tuple positions) replaced by ``pair(dst, src)``."""
    if isinstance(loaded, dict) and isinstance(target, dict):
        return {k: _zip(target[k], v, pair) if k in target else v for k, v in loaded.items()}
    if type(loaded) in (list, tuple) and type(target) is type(loaded) and len(target) == len(loaded):
        items = [_zip(a, b, pair) for a, b in zip(target, loaded)]
        return items if isinstance(loaded, list) else type(loaded)(items)
    return pair(target, loaded)


def _unleaf(shaped: Any, value: Callable[[int], Any]) -> Any:
    if isinstance(shaped, _Leaf):
        return value(shaped.i)
    if isinstance(shaped, dict):
        return {k: _unleaf(v, value) for k, v in shaped.items()}
    if isinstance(shaped, list):
        return [_unleaf(v, value) for v in shaped]
    if type(shaped) is tuple:
        return tuple(_unleaf(v, value) for v in shaped)
    return shaped


def _plain(t: torch.Tensor) -> bool:
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and not t.is_quantized
        and not t.is_conj()
        and not t.is_neg()
        and t.is_contiguous()
    )


def _job(dst: torch.Tensor, src: torch.Tensor, spans: list[tuple[int, int]]) -> _Job | None:
    """The read that fills ``dst`` with ``src``'s bytes, or None if it is not eligible."""
    if dst.dtype != src.dtype or dst.shape != src.shape or dst.numel() == 0:
        return None
    if not (_plain(dst) and _plain(src)):
        return None
    nbytes = src.numel() * src.element_size()
    ptr = src.data_ptr()
    for slot, (base, size) in enumerate(spans):
        if base <= ptr and ptr + nbytes <= base + size:
            return (dst.data_ptr(), nbytes, slot, ptr - base)
    return None


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The bytes a tensor may touch: its storage's (a conservative bound)."""
    s = t.untyped_storage()
    return s.data_ptr(), s.data_ptr() + s.nbytes()


def _without_overlaps(leaves: list[tuple[torch.Tensor, torch.Tensor, _Job | None]]) -> set[int]:
    """The leaves read directly: eligible ones whose destination overlaps no other
    leaf's destination (they would be written in another order than the copies'), but
    for the same bytes read into the same place twice (tied weights)."""
    spans: list[tuple[int, int, int, Any]] = []
    for i, (dst, _, job) in enumerate(leaves):
        if dst.device.type != "cpu":
            continue
        lo, hi = (job[0], job[0] + job[1]) if job is not None else _extent(dst)
        spans.append((lo, hi, i, job))
    spans.sort(key=lambda x: (x[0], x[1]))
    bad: set[int] = set()
    reach, last = -1, -1
    for lo, hi, i, job in spans:
        if lo < reach and not (job is not None and leaves[last][2] == job):
            bad.update((i, last))
        if hi > reach:
            reach, last = hi, i
    return {i for i, (_, _, job) in enumerate(leaves) if job is not None and i not in bad}


def _read(fds: tuple[int, ...], jobs: list[_Job], threads: int | None) -> None:
    pieces = [
        (dst + a, min(READ_BYTES, nbytes - a), fds[slot], offset + a)
        for dst, nbytes, slot, offset in jobs
        for a in range(0, nbytes, READ_BYTES)
    ]
    if not pieces:
        return
    n = threads if threads is not None else min(4, os.cpu_count() or 1)
    if n <= 1 or len(pieces) == 1:
        for p in pieces:
            _pread(*p)
        return
    with ThreadPoolExecutor(min(n, len(pieces)), thread_name_prefix="async-stager-tier-read") as pool:
        for _ in pool.map(lambda p: _pread(*p), pieces):
            pass


def _pread(address: int, nbytes: int, fd: int, offset: int) -> None:
    """Read ``nbytes`` at ``offset`` of ``fd`` into memory at ``address`` (preadv
    releases the GIL)."""
    done = 0
    while done < nbytes:
        buf = (ctypes.c_char * (nbytes - done)).from_address(address + done)
        got = os.preadv(fd, [buf], offset + done)
        if got <= 0:
            raise OSError(f"an arena ended {nbytes - done} bytes early at offset {offset + done}")
        done += got


def _bump(t: torch.Tensor) -> None:
    """Tell autograd the tensor changed (its bytes were written behind torch's back)."""
    bump = getattr(torch.autograd.graph, "increment_version", None)
    if bump is not None:
        with torch.no_grad():
            bump(t)
