"""Checksums of staged bytes: XXH3-64 of each ``PIECE_BYTES`` piece of a tensor's bytes.

The digest of a tensor is the list of XXH3-64 hashes (seed 0) of its bytes in row-major
(contiguous) order, cut at every ``PIECE_BYTES`` bytes; an empty tensor has the one
hash of no bytes. The copy threads compute it while staging (``_hostcopy``): a piece is
hashed right after it is copied, from the core's cache, so a checksum costs a second
read of cached bytes rather than of memory. ``tensor_digest`` computes the same digest
of any CPU tensor afterwards (for a destination the copy threads did not see, and for
verifying what was read back).

XXH3 is not cryptographic: it detects accidents (torn or short writes, bit rot, a
buffer overwritten while it was written, a file from another step), not tampering;
a random corruption of a piece goes unnoticed with probability about 2**-64. It
releases the GIL while hashing, so copy threads hash in parallel with the event loop.
It comes from the ``xxhash`` package, imported only when checksums are asked for.

Sources on a GPU are hashed there instead, before their copy, with WSUM64 (see
``_wordhash``); ``Checksums`` holds both kinds and says which each digest is.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from async_stager._core.checksum.wordhash import ALGORITHM as WSUM64, wsum64_digest
from async_stager.errors import UnsupportedError

__all__ = [
    "ALGORITHM",
    "PIECE_BYTES",
    "Checksums",
    "HashTask",
    "chunk_key",
    "hash_memory",
    "hash_threads",
    "hasher",
    "tensor_digest",
]

#: The hash of each piece, as named in checkpoint manifests.
ALGORITHM = "xxh3_64"
#: Bytes per hashed piece: the host copy pool's piece size (``_hostcopy.PIECE_BYTES``),
#: so a piece a copy thread copies is exactly one hashed piece.
PIECE_BYTES = 8 << 20

_module: Any = None
_MASK64 = (1 << 64) - 1
_lock = threading.Lock()


def hasher() -> Any:
    """The ``xxhash`` module; UnsupportedError naming the fix when it is missing."""
    global _module
    if _module is None:
        with _lock:
            try:
                import xxhash
            except ImportError as exc:
                raise UnsupportedError(
                    "checksums need the xxhash package (XXH3-64): pip install xxhash, "
                    "or turn checksums off (checksums=False)"
                ) from exc
            _module = xxhash
    return _module


def hash_threads() -> int:
    """Threads one process hashes a staged copy with by default: its share of the
    machine, leaving a core to training and the event loop.

    The cores are the process's CPU affinity (``sched_getaffinity``), not the machine's
    count. ``OMP_NUM_THREADS``, when set, is the process's thread budget and caps the
    result. When the affinity is the whole machine, the ranks of this node
    (``LOCAL_WORLD_SIZE``, which torchrun sets) share it: each takes its part. A
    launcher that binds each rank to its own cores gives the rank's share as its
    affinity already. Hazard: every rank hashing with every core (8 ranks: 8x
    oversubscription) slows each write and the training steps it overlaps."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    machine = os.cpu_count() or 1
    cores = affinity if affinity is not None else machine
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    ranks = int(local) if local.isdigit() and int(local) > 0 else 1
    if cores >= machine and ranks > 1:
        cores //= ranks
    threads = cores - 1
    omp = os.environ.get("OMP_NUM_THREADS", "")
    if omp.isdigit() and int(omp) > 0:
        threads = min(threads, int(omp))
    return max(1, threads)


def chunk_key(fqn: str, offsets: Sequence[int]) -> str:
    """A checkpoint manifest's key of one tensor chunk: DCP's flattened name and the
    chunk's offsets in the global tensor (``model.w@0,0``)."""
    return f"{fqn}@{','.join(str(o) for o in offsets)}"


def _view(ptr: int, nbytes: int) -> memoryview:
    return memoryview((ctypes.c_char * nbytes).from_address(ptr)).cast("B")


def hash_memory(ptr: int, nbytes: int) -> int:
    """XXH3-64 of ``nbytes`` bytes at host address ``ptr`` (the caller keeps them alive
    and unchanged meanwhile)."""
    xxh = hasher()
    if nbytes == 0:
        return int(xxh.xxh3_64_intdigest(b""))
    return int(xxh.xxh3_64_intdigest(_view(ptr, nbytes)))


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as a contiguous CPU tensor without lazy conj/neg bits (a copy
    only when ``t`` is not one already)."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t if t.is_contiguous() else t.contiguous()


def tensor_digest(t: torch.Tensor, piece_bytes: int = PIECE_BYTES) -> list[int]:
    """The digest of a CPU tensor (see the module docstring): reads it, once."""
    d = _dense(t)
    n = d.numel() * d.element_size()
    if n == 0:
        return [hash_memory(0, 0)]
    ptr = d.data_ptr()
    return [hash_memory(ptr + a, min(piece_bytes, n - a)) for a in range(0, n, piece_bytes)]


def _region(t: torch.Tensor) -> tuple[int, int] | None:
    """The host bytes a tensor's digest covers in memory order: (address, bytes), or
    None when its memory order is not its row-major order (or it has lazy bits)."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg():
        return None
    n = t.numel() * t.element_size()
    return (t.data_ptr(), n) if n > 0 else None


class HashTask:
    """One piece to hash once its bytes have landed: ``out[index] = hash(ptr, nbytes)``
    (a copy thread may also copy it part by part and hash as it goes)."""

    __slots__ = ("index", "nbytes", "out", "ptr")

    def __init__(self, ptr: int, nbytes: int, out: list[int | None], index: int) -> None:
        self.ptr = ptr
        self.nbytes = nbytes
        self.out = out
        self.index = index

    def run(self) -> None:
        self.out[self.index] = hash_memory(self.ptr, self.nbytes)


class Checksums:
    """The digests one stage computed while copying, by host destination.

    Filled by the copy threads (each slot by exactly one thread, before the stage
    returns) and, for sources on a device, by the device itself (``add_device``: the
    digest lands with the copies, before the stage returns); read-only afterwards.
    ``get(t)`` gives the digest of a staged tensor whose bytes are one whole
    destination hashed while staging, ``algorithm_of(t)`` which hash it is
    (``xxh3_64`` from the copy threads, ``wsum64`` from a device, see ``_wordhash``);
    None for anything else (a view of part of a storage, a non-contiguous layout, a
    small tensor copied from a device): compute those with ``compute``. The digests
    describe the bytes as staged; who owns the buffers is unchanged (the stage's
    lease)."""

    algorithm = ALGORITHM
    piece_bytes = PIECE_BYTES

    def __init__(self) -> None:
        self._by_region: dict[tuple[int, int], list[int | None]] = {}
        # Digests a device computes: (host int64 tensor its hashes land in, start,
        # end), read once the stage's copies have landed.
        self._device: dict[tuple[int, int], tuple[torch.Tensor, int, int]] = {}

    def __len__(self) -> int:
        return len(self._by_region) + len(self._device)

    def tasks(self, dst: torch.Tensor) -> list[HashTask]:
        """The hash tasks for every piece of host destination ``dst`` (none when it
        is not hashable in memory order, or is already covered)."""
        region = _region(dst)
        if region is None or region in self._by_region or region in self._device:
            return []
        ptr, n = region
        out: list[int | None] = [None] * -(-n // self.piece_bytes)
        self._by_region[region] = out
        return [
            HashTask(ptr + a, min(self.piece_bytes, n - a), out, i)
            for i, a in enumerate(range(0, n, self.piece_bytes))
        ]

    def add_device(self, dst: torch.Tensor, hashes: torch.Tensor, start: int) -> bool:
        """Record that a device computes the WSUM64 digest of host destination ``dst``
        into ``hashes[start : start + pieces]`` (host int64 memory that its copies fill
        by the time the stage completes). False, and nothing recorded, when ``dst``
        is not hashable in memory order or is already covered."""
        region = _region(dst)
        if region is None or region in self._by_region or region in self._device:
            return False
        pieces = -(-region[1] // self.piece_bytes)
        self._device[region] = (hashes, start, start + pieces)
        return True

    def hash_now(self, dsts: Iterable[torch.Tensor]) -> None:
        """Hash the destinations not covered yet, on this thread (their copies have
        landed)."""
        for d in dsts:
            for task in self.tasks(d):
                task.run()

    @staticmethod
    def compute(t: torch.Tensor, algorithm: str = ALGORITHM) -> list[int]:
        """The digest of any tensor, computed now (reads it once): what ``get``
        returns for a staged tensor hashed with ``algorithm`` (``xxh3_64``, of a CPU
        tensor; ``wsum64``, of a tensor on any device), for checking a copy read back
        later."""
        if algorithm == ALGORITHM:
            return tensor_digest(t)
        if algorithm == WSUM64:
            return wsum64_digest(t)
        raise ValueError(f"unknown checksum algorithm {algorithm!r}")

    def algorithm_of(self, t: torch.Tensor) -> str | None:
        """Which hash ``get(t)`` is (None when ``get(t)`` is None)."""
        region = _region(t)
        if region is not None and region in self._device:
            return WSUM64
        return ALGORITHM if self.get(t) is not None else None

    def get(self, t: torch.Tensor) -> list[int] | None:
        """The digest of staged tensor ``t``, if the stage computed it (see above)."""
        region = _region(t)
        if region is None:
            if t.device.type == "cpu" and t.numel() == 0:
                return [hash_memory(0, 0)]
            return None
        device = self._device.get(region)
        if device is not None:
            hashes, lo, hi = device
            return [int(h) & _MASK64 for h in hashes[lo:hi].tolist()]
        out = self._by_region.get(region)
        if out is None or any(h is None for h in out):
            return None
        return [h for h in out if h is not None]
