"""Source storage -> host block: the storage cache of one buffer set.

Keyed by the source storage's identity (its StorageImpl address, kept unique by a weak
reference that pins the impl, not the data) and re-validated on each hit by data
pointer, size and device. An entry whose storage died is dropped at the next slow-path
stage and its block goes back to the arena (never a stale hit, and memory does not grow
across checkpoints of fresh tensors). Identity decides whether a *plan* can be reused;
the arena (``_arena.HostPool``) decides whether *memory* can.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from async_stager._core.memory.arena import Block, HostPool

__all__ = ["CacheEntry", "StorageCache"]


@dataclass(eq=False)
class CacheEntry:
    weak: StorageWeakRef
    ptr: int
    nbytes: int
    device: torch.device
    block: Block


def _entries(
    storages: Sequence[torch.UntypedStorage], devices: Sequence[torch.device], blocks: Sequence[Block]
) -> Iterator[CacheEntry]:
    """A cache entry per (storage, device, block), made in bulk (``map``)."""
    return map(
        CacheEntry,
        map(StorageWeakRef, storages),
        map(torch.UntypedStorage.data_ptr, storages),
        map(torch.UntypedStorage.nbytes, storages),
        devices,
        blocks,
    )


class StorageCache:
    """Maps live source storages to their host blocks in one HostPool."""

    def __init__(self, pool: HostPool) -> None:
        self.pool = pool
        self._entries: dict[int, CacheEntry] = {}
        #: id(block) -> the key of the entry that holds it.
        self._by_block: dict[int, int] = {}
        #: Set when a lookup freed a block; the plan maker then drops the set's plans.
        self.invalidated = False

    def __len__(self) -> int:
        return len(self._entries)

    def take_invalidated(self) -> bool:
        """Whether a lookup freed a block since the last call (the plans writing into
        it are then stale); clears the flag."""
        invalidated, self.invalidated = self.invalidated, False
        return invalidated

    def lookup(self, storage: torch.UntypedStorage, device: torch.device) -> Block | None:
        """The block of ``storage`` if it is cached and still the same memory."""
        e = self._entries.get(storage._cdata)
        if e is None:
            return None
        if (
            e.weak.expired()
            or e.ptr != storage.data_ptr()
            or e.nbytes != storage.nbytes()
            or e.device != device
        ):
            # Same impl, other memory (moved, resized, reallocated): never a stale hit.
            del self._entries[storage._cdata]
            self._by_block.pop(id(e.block), None)
            self.pool.free([e.block])
            # The block may be handed out again: plans that write into it are stale.
            self.invalidated = True
            return None
        return e.block

    def insert(self, storage: torch.UntypedStorage, device: torch.device, block: Block) -> None:
        key = storage._cdata
        old = self._entries.get(key)
        if old is not None and old.block is not block:
            self._by_block.pop(id(old.block), None)
        self._entries[key] = CacheEntry(
            StorageWeakRef(storage), storage.data_ptr(), storage.nbytes(), device, block
        )
        self._by_block[id(block)] = key

    def insert_many(self, pairs: Sequence[tuple[torch.UntypedStorage, torch.device, Block]]) -> None:
        """``insert`` for each (storage, device, block), in bulk (``map``): a plan of
        tens of thousands of small storages inserts them all at once."""
        entries = self._entries
        by_block = self._by_block
        storages = [p[0] for p in pairs]
        keys = list(map(operator.attrgetter("_cdata"), storages))
        for key in keys:
            old = entries.get(key)
            if old is not None:
                by_block.pop(id(old.block), None)
        entries.update(zip(keys, _entries(storages, [p[1] for p in pairs], [p[2] for p in pairs])))
        by_block.update(zip(map(id, (p[2] for p in pairs)), keys))

    def take_over(self, pairs: Sequence[tuple[torch.UntypedStorage, torch.device, Block]]) -> bool:
        """Hand each ``block`` to the new source ``storage`` (all or nothing); returns
        whether it did. Only when every block's current source has died (a live
        source keeps its block) and no new storage is cached already (it has a block
        of its own): fresh tensors of the same layout as dead ones then reuse their
        memory with no allocation, no page fault and no pinning. In bulk (``map``):
        it runs per storage of a state dict of many small tensors."""
        entries = self._entries
        storages = [p[0] for p in pairs]
        blocks = [p[2] for p in pairs]
        found = list(map(self._by_block.get, map(id, blocks)))
        if None in found:
            return False
        keys: list[int] = found  # type: ignore[assignment]
        if not all(
            map(StorageWeakRef.expired, map(operator.attrgetter("weak"), map(entries.__getitem__, keys)))
        ):
            return False
        new_keys = list(map(operator.attrgetter("_cdata"), storages))
        if any(map(entries.__contains__, new_keys)):
            return False
        for k in keys:
            del entries[k]
        entries.update(zip(new_keys, _entries(storages, [p[1] for p in pairs], blocks)))
        self._by_block.update(zip(map(id, blocks), new_keys))
        return True

    def sweep(self) -> int:
        """Drop entries whose source storage died; free their blocks. Returns how many."""
        dead = [k for k, e in self._entries.items() if e.weak.expired()]
        if dead:
            blocks = [self._entries.pop(k).block for k in dead]
            for b in blocks:
                self._by_block.pop(id(b), None)
            self.pool.free(blocks)
        return len(dead)

    def moved(self) -> list[Block]:
        """Cached blocks whose storage no longer views their arena: torch moved it out
        in place (``share_memory_()`` of a private arena's storage, its reducer; see
        ``sharing``). In bulk (``map``): one pass over the blocks."""
        blocks = [e.block for e in self._entries.values() if e.block.arena is not None]
        ptrs = list(map(torch.UntypedStorage.data_ptr, map(operator.attrgetter("storage"), blocks)))
        return [b for b, p in zip(blocks, ptrs) if b.arena is not None and p != b.arena.base + b.offset]

    def drop(self, blocks: Sequence[Block]) -> None:
        """Forget ``blocks`` (moved out of their arena) and give their bytes back to the
        pool: nothing views those bytes any more."""
        for b in blocks:
            key = self._by_block.pop(id(b), None)
            if key is not None:
                self._entries.pop(key, None)
        self.pool.free(blocks)
        self.invalidated = True

    def blocks(self) -> list[Block]:
        """Every cached block that has memory."""
        return [e.block for e in self._entries.values() if e.block.nbytes]

    def clear(self) -> None:
        self.pool.free([e.block for e in self._entries.values()])
        self._entries.clear()
        self._by_block.clear()
