"""Snapshot regions and their digests, read through mappings of the arenas' descriptors.

A snapshot's tensors live in regions ``(slot, offset, nbytes)`` of its arenas (the
storages of ``SharedHandle.refs``); a region's digest is the project's checksum
(``_core.checksum.digest``): XXH3-64 of each ``PIECE_BYTES`` piece, in order. The
trainer computes it after its stage, the agent recomputes it before it accepts the
snapshot, and a restarted trainer recomputes it before it loads from memory: the
memory tier's completeness is decided by content, never by a marker.

``ArenaMaps`` keeps one read-only mapping per arena (by inode), so hashing the
same arenas at every snapshot pays their page-table set-up once.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from async_stager._core.checksum.digest import ALGORITHM, PIECE_BYTES, hasher

__all__ = [
    "ALGORITHM",
    "PIECE_BYTES",
    "ArenaMaps",
    "Region",
    "digests_in",
    "digests_of",
    "region_digest",
    "regions_of",
]

#: (slot of the arena in the snapshot, byte offset in it, bytes).
Region = tuple[int, int, int]


def regions_of(refs: Iterable[Sequence[Any]]) -> list[Region]:
    """The distinct storage regions a handle's references use (``"t"`` tensors and
    ``"s"`` storages: slot, offset and bytes are their elements 1-3), in order."""
    seen: dict[Region, None] = {}
    for ref in refs:
        if ref and ref[0] in ("t", "s"):
            seen.setdefault((int(ref[1]), int(ref[2]), int(ref[3])), None)
    return list(seen)


def region_digest(buf: Any, offset: int, nbytes: int, piece: int = PIECE_BYTES) -> list[int]:
    """The digest of bytes [offset, offset+nbytes) of ``buf`` (a mapping): XXH3-64 of
    each ``piece`` bytes. Releases the GIL while hashing (xxhash does)."""
    xxh = hasher()
    view = memoryview(buf)
    try:
        if nbytes == 0:
            return [int(xxh.xxh3_64_intdigest(b""))]
        return [
            int(xxh.xxh3_64_intdigest(view[offset + a : offset + min(a + piece, nbytes)]))
            for a in range(0, nbytes, piece)
        ]
    finally:
        view.release()


class ArenaMaps:
    """Read-only mappings of arena descriptors, one per inode, kept until
    ``drop``/``close``. Thread-safe.

    Private mappings (``MAP_PRIVATE``, read only): they read the arena's pages as they
    are (nothing is ever written through them, so no page is copied), and, unlike a
    shared mapping of a descriptor opened for writing, they never count as a writer:
    the agent's seal (``sealing``) is not refused because of them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._maps: dict[tuple[int, int], mmap.mmap] = {}

    def get(self, fd: int, nbytes: int) -> mmap.mmap:
        """The mapping of ``fd``'s first ``nbytes`` bytes (made now if new, or if the
        one held is shorter)."""
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        with self._lock:
            mm = self._maps.get(key)
            if mm is not None and len(mm) >= nbytes:
                return mm
            if mm is not None:
                _close(mm)
            mm = self._maps[key] = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
            return mm

    def drop(self, key: tuple[int, int]) -> None:
        """Unmap the arena of inode ``key`` (device, inode), if mapped."""
        with self._lock:
            mm = self._maps.pop(key, None)
        if mm is not None:
            _close(mm)

    def keep_only(self, keys: Iterable[tuple[int, int]]) -> None:
        """Unmap every arena not in ``keys``."""
        wanted = set(keys)
        with self._lock:
            gone = [k for k in self._maps if k not in wanted]
            maps = [self._maps.pop(k) for k in gone]
        for mm in maps:
            _close(mm)

    def close(self) -> None:
        with self._lock:
            maps = list(self._maps.values())
            self._maps.clear()
        for mm in maps:
            _close(mm)


def _close(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:  # pragma: no cover - a digest still reading it: unmapped when it is collected
        pass


def digests_of(
    maps: ArenaMaps,
    fds: Sequence[int],
    sizes: Sequence[int],
    regions: Sequence[Region],
    piece: int = PIECE_BYTES,
    threads: int | None = None,
) -> list[list[int]]:
    """The digest of every region, read through ``maps`` of the arenas ``fds`` (each
    ``sizes[i]`` bytes). Blocking (hashes every byte once, on ``threads`` threads:
    default the cores, at most 4; xxhash releases the GIL): run it in a thread."""
    bufs: dict[int, mmap.mmap] = {}
    for slot, offset, nbytes in regions:
        if not 0 <= slot < len(fds) or offset < 0 or nbytes < 0 or offset + nbytes > sizes[slot]:
            raise ValueError(
                f"region {(slot, offset, nbytes)} is outside the snapshot's arenas {list(sizes)}"
            )
        bufs[slot] = maps.get(fds[slot], sizes[slot])
    return digests_in(bufs, regions, piece, threads)


def digests_in(
    bufs: Mapping[int, Any], regions: Sequence[Region], piece: int = PIECE_BYTES, threads: int | None = None
) -> list[list[int]]:
    """The digest of every region of the buffers ``bufs`` (by slot), on ``threads``
    threads (default the cores, at most 4). Blocking: run it in a thread."""
    pieces = [
        (i, bufs[slot], offset + a, min(piece, nbytes - a))
        for i, (slot, offset, nbytes) in enumerate(regions)
        for a in range(0, max(nbytes, 1), piece)
    ]
    n = threads if threads is not None else min(4, os.cpu_count() or 1)
    out: list[list[int]] = [[] for _ in regions]
    if n <= 1 or len(pieces) <= 1:
        hashed = [region_digest(buf, off, size, piece)[0] for _, buf, off, size in pieces]
    else:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(n, thread_name_prefix="async-stager-tier-hash") as pool:
            hashed = list(pool.map(lambda p: region_digest(p[1], p[2], p[3], piece)[0], pieces))
    for (i, _, _, _), h in zip(pieces, hashed):
        out[i].append(h)
    return out
