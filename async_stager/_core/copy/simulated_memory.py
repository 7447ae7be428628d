"""The simulated device's memory (``simulated``): one slab handed out in aligned blocks,
each freed in stream order and overwritten with ``POISON`` at once; the traps freed scratch
points at; and ``Where``, the memory a pending operation names by address (so it keeps
nothing alive) and checks, when it runs, for a use after free.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Protocol

import numpy as np
import torch

__all__ = ["ALIGN", "POISON", "Block", "Slab", "UseAfterFree", "Where"]

#: The byte a freed block is overwritten with.
POISON = 0xA5
#: Alignment of device blocks (bytes).
ALIGN = 64


class UseAfterFree(RuntimeError):
    """A device operation touched memory freed before it ran (recorded in
    ``SimulatedDevice.errors``; the operation still runs, on whatever the memory holds
    now, as a GPU would)."""


class Ordered(Protocol):
    """A stream as the allocator sees it: how far it has run and how much is queued."""

    finished: int
    queued: int


class Block:
    """One allocation of the slab: ``start`` and ``nbytes`` in it, the stream that
    allocated it (``owner``), and the (stream, position) pairs it must wait for before
    it is reused (``uses``: ``record_stream``'s, then the owner's at the release)."""

    __slots__ = ("foreign", "nbytes", "owner", "start", "uses")

    def __init__(self, start: int, nbytes: int, owner: Ordered) -> None:
        self.start, self.nbytes, self.owner = start, nbytes, owner
        self.uses: list[tuple[Ordered, int]] = []
        #: Memory the allocator does not own (``SimulatedDevice.foreign``).
        self.foreign = False


class Slab:
    """Device memory: ``capacity`` bytes (a multiple of ``ALIGN``) handed out first-fit
    in ``ALIGN``-byte blocks (``allocate``), each released block poisoned and handed back
    once every stream that used it ran past its uses (``release``, ``reap``), under the
    device's ``cond``. Its memory is host memory the test can read (``tensor``: the
    whole slab as bytes)."""

    def __init__(self, capacity: int, cond: threading.Condition) -> None:
        self.capacity = capacity
        self.cond = cond
        #: Set at the device's close: releases after it are ignored.
        self.closed = False
        #: Blocks freed (poisoned).
        self.frees = 0
        #: Live blocks by their start.
        self.blocks: dict[int, Block] = {}
        self._bytes = bytearray(capacity)
        self._mv = memoryview(self._bytes)
        self.tensor = torch.frombuffer(self._bytes, dtype=torch.uint8)
        self.base = self.tensor.data_ptr()
        self._free: list[tuple[int, int]] = [(0, capacity)]
        self._releases: list[Block] = []
        #: Memory that freed scratch points at until it is grown again (never freed).
        self._traps: list[bytearray] = []
        self._trap_ranges: list[tuple[int, int]] = []

    def owns(self, tensor: torch.Tensor) -> bool:
        if tensor.device.type != "cpu":
            return False
        try:
            ptr = tensor.untyped_storage().data_ptr()
        except Exception:  # noqa: BLE001 - a tensor without storage
            return False
        return self.base <= ptr < self.base + self.capacity

    def block_of(self, t: torch.Tensor) -> Block | None:
        if not self.owns(t):
            return None
        return self.blocks.get(t.untyped_storage().data_ptr() - self.base)

    def allocate(self, nbytes: int, owner: Ordered) -> tuple[np.ndarray[Any, Any], Block]:
        """A block of at least ``nbytes`` for ``owner`` (an array over it, and the block);
        ``torch.OutOfMemoryError`` when no free range fits."""
        size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        with self.cond:
            for i, (start, n) in enumerate(self._free):
                if n >= size:
                    self._free[i] = (start + size, n - size)
                    if n == size:
                        del self._free[i]
                    break
            else:
                raise torch.OutOfMemoryError(
                    f"simulated device out of memory: {nbytes} bytes asked, capacity {self.capacity}"
                )
            block = self.blocks[start] = Block(start, size, owner)
        return np.frombuffer(self._mv[start : start + size], dtype=np.uint8), block

    def release(self, block: Block) -> None:
        """``block``'s last tensor died, or ``free`` gave it back (any thread, a GC run
        included): it is poisoned and reused once its streams reach their uses (a
        foreign block at once: its owner frees it whatever streams still read it)."""
        with self.cond:
            if self.closed:
                return
            if block.foreign:
                block.uses = []
            else:
                block.uses.append((block.owner, block.owner.queued))
            self._releases.append(block)
            self.reap()

    def reap(self) -> None:
        """Poison (and hand back) every released block whose streams reached it (under
        ``cond``)."""
        keep = []
        for block in self._releases:
            if all(s.finished >= p for s, p in block.uses):
                self._mv[block.start : block.start + block.nbytes] = bytes([POISON]) * block.nbytes
                self.frees += 1
                block.uses = []
                if self.blocks.get(block.start) is block:
                    del self.blocks[block.start]
                    self._give(block.start, block.nbytes)
            else:
                keep.append(block)
        self._releases = keep

    def _give(self, start: int, nbytes: int) -> None:
        """Return a range to the free list, merged with its free neighbours."""
        free = sorted([*self._free, (start, nbytes)])
        merged: list[tuple[int, int]] = []
        for a, n in free:
            if merged and merged[-1][0] + merged[-1][1] == a:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((a, n))
        self._free = merged

    def trap(self, nbytes: int) -> np.ndarray[Any, Any]:
        """``nbytes`` of trap memory (an array of its own over it): host memory holding
        ``POISON``, never handed out, that freed scratch points at."""
        with self.cond:
            for buf in self._traps:
                if len(buf) >= nbytes:
                    break
            else:
                buf = bytearray([POISON]) * max(nbytes, 1 << 16)
                self._traps.append(buf)
                start = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
                self._trap_ranges.append((start, start + len(buf)))
        return np.frombuffer(memoryview(buf)[:nbytes], dtype=np.uint8)

    def trapped(self, ptr: int) -> bool:
        return any(a <= ptr < b for a, b in self._trap_ranges)


class Where:
    """Memory written or read by a pending operation: a device tensor by its offset in
    the slab (nothing kept alive; ``block``: the allocation it belonged to at the
    enqueue, checked when the operation runs), a host destination by its address, a
    host source by reference (host memory the test owns). A use after free is appended
    to ``errors``."""

    __slots__ = (
        "block",
        "conj",
        "dtype",
        "errors",
        "kind",
        "nbytes",
        "neg",
        "offset",
        "ref",
        "size",
        "slab",
        "storage_offset",
        "stride",
    )

    def __init__(self, slab: Slab, errors: list[BaseException], t: torch.Tensor, *, write: bool) -> None:
        self.slab, self.errors = slab, errors
        self.dtype, self.size, self.stride = t.dtype, tuple(t.shape), t.stride()
        self.storage_offset = t.storage_offset()
        self.conj, self.neg = t.is_conj(), t.is_neg()
        self.ref: torch.Tensor | None = None
        self.block: Block | None = None
        storage = t.untyped_storage()
        self.nbytes = storage.nbytes()
        if slab.owns(t):
            self.kind = "device"
            self.offset = storage.data_ptr() - slab.base
            self.block = slab.blocks.get(self.offset)
            return
        if slab.trapped(storage.data_ptr()):
            errors.append(
                UseAfterFree(
                    f"a device operation was enqueued on {storage.nbytes()} bytes freed by free() and "
                    "not grown again (on CUDA: an illegal address)"
                )
            )
            self.kind = "trap"  # reads poison, writes are lost
            self.offset = 0
            return
        if write:
            if any(s < 0 for s in self.stride):
                raise RuntimeError("the simulated device writes host memory with non-negative strides")
            self.kind = "host"
            self.offset = storage.data_ptr()
        else:
            self.kind = "ref"
            self.offset = 0
            self.ref = t

    def view(self) -> torch.Tensor:
        if self.ref is not None:
            return self.ref
        if self.kind == "device" and self.slab.blocks.get(self.offset) is not self.block:
            self.errors.append(
                UseAfterFree(
                    f"a device operation on {threading.current_thread().name} touched {self.nbytes} bytes "
                    f"at offset {self.offset} after they were freed (a missing record_stream, event "
                    "hold or stream-ordered allocation)"
                )
            )
        if self.nbytes == 0:
            return torch.empty(self.size, dtype=self.dtype)
        if self.kind == "trap":
            poison = torch.full((self.nbytes,), POISON, dtype=torch.uint8).view(self.dtype)
            return poison.as_strided(self.size, self.stride, self.storage_offset)
        if self.kind == "device":
            # as_strided's offset counts from the slab's start (its storage).
            typed = self.slab.tensor.view(self.dtype)
            start = self.offset // typed.element_size() + self.storage_offset
            t = typed.as_strided(self.size, self.stride, start)
        else:
            raw = (ctypes.c_uint8 * self.nbytes).from_address(self.offset)
            flat = torch.frombuffer(raw, dtype=torch.uint8)
            t = flat.view(self.dtype).as_strided(self.size, self.stride, self.storage_offset)
        if self.conj:
            t = t.conj()
        if self.neg:
            t = t._neg_view()
        return t

    def physical(self) -> torch.Tensor:
        """The memory without its lazy bits (what a DMA engine reads)."""
        t = self.view()
        if t.is_conj():
            t = t.conj()
        if t.is_neg():
            t = t._neg_view()
        return t
