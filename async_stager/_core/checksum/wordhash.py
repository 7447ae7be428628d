"""WSUM64: a checksum made of torch operations only, so the device that holds the data
computes it (a GPU at memory bandwidth, before the device-to-host copy) and any device
recomputes it identically afterwards (the CPU, on restore).

Definition, per ``PIECE_BYTES`` piece of a tensor's bytes in row-major order (the same
pieces as the XXH3 digest of ``_digest``): zero-pad the piece to a multiple of 4 bytes,
read it as little-endian signed 32-bit words ``w[j]`` and take

    h = L * LEN_MUL + sum_j w[j] * A[j % COLS] * B[j // COLS]   (mod 2**64)

with ``L`` the piece's bytes and ``A``, ``B`` fixed odd 64-bit constants (SplitMix64
of a fixed seed). All arithmetic is int64 with wraparound, so the order of the sums
does not matter: a GPU's parallel reduction and the CPU's give the same value. The
digest is the list of the pieces' ``h`` as unsigned integers (an empty tensor: one
``h`` of nothing, 0).

What it detects (not tampering: it is linear and its constants are public): any change
confined to one 32-bit word, always (every multiplier is odd, so a nonzero difference
times it is nonzero mod 2**64); a change of the length; and any other accident (a torn
or zeroed range, swapped words, a file from another step) except with probability
about 2**-32 in the worst case (two sign-bit flips) and far less for typical ones. It
is weaker than XXH3 and used only where XXH3 cannot run: on an accelerator.

Cost: one multiply-and-sum over int64 products, about five bytes of memory traffic per
byte hashed; temporary device memory of at most ``2 * GROUP_BYTES`` bytes per call (the
products of ``GROUP_BYTES`` of input at a time), allocated on the current stream.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

__all__ = [
    "ALGORITHM",
    "COLS",
    "GROUP_BYTES",
    "MIN_DEVICE_BYTES",
    "OFFLOAD_BYTES",
    "TABLE_WORDS",
    "device_pairs",
    "digest_tensor",
    "fill_tables",
    "hash_layout",
    "make_tables",
    "table_views",
    "piece_count",
    "piece_hashes",
    "raw_bytes",
    "wsum64_digest",
]

#: The name of this checksum in checkpoint manifests.
ALGORITHM = "wsum64"
#: Bytes per piece (must equal ``_digest.PIECE_BYTES``; a test keeps them in step).
PIECE_BYTES = 8 << 20
#: Words per row: ``A`` has this many constants, ``B`` one per row of a piece.
COLS = 4096
_ROWS = PIECE_BYTES // 4 // COLS
#: Input bytes multiplied at once (bounds the int64 products held in memory).
GROUP_BYTES = 16 << 20
_MASK = (1 << 64) - 1
#: Sources of fewer bytes are not hashed on their device: a hash costs a few kernel
#: launches (microseconds of the worker's time each), more than hashing a small tensor
#: from its host copy later; the bytes are in the big ones.
MIN_DEVICE_BYTES = 1 << 20
#: SplitMix64's increment, also the length's multiplier.
LEN_MUL = 0x9E3779B97F4A7C15


_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_SEED = 0x5EED_57A6_E5


def _signed(x: int) -> int:
    x &= _MASK
    return x - (1 << 64) if x >> 63 else x


#: The constants on one device: ``A`` (COLS,), ``B`` (rows, 1) and the tail word's byte
#: weights (3,), int64.
Tables = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
_tables: dict[torch.device, Tables] = {}
_lock = threading.Lock()


def _lsr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def make_tables(device: torch.device) -> Tables:
    """The constants, computed on ``device`` by kernels on its current stream (SplitMix64
    in int64 ops: the i-th constant, i from 1, is SplitMix64's output for state
    ``_SEED + i * LEN_MUL``, made odd): no upload, so nothing waits
    for the device. Hazard (CUDA): ready only in that stream's order; another stream
    must not use them before it has waited for this one (a copier makes its own, on its
    hash stream)."""
    i = torch.arange(1, COLS + _ROWS + 1, dtype=torch.int64, device=device)
    z = i * _signed(LEN_MUL) + _signed(_SEED)
    z = (z ^ _lsr(z, 30)) * _signed(_M1)
    z = (z ^ _lsr(z, 27)) * _signed(_M2)
    z = (z ^ _lsr(z, 31)) | 1
    weights = torch.bitwise_left_shift(
        torch.ones(3, dtype=torch.int64, device=device),
        torch.arange(0, 24, 8, dtype=torch.int64, device=device),
    )
    return z[:COLS], z[COLS:].view(_ROWS, 1), weights


#: int64 words ``fill_tables`` writes (the constants and the byte weights).
TABLE_WORDS = COLS + _ROWS + 3


def table_views(mem: torch.Tensor) -> Tables:
    """The tables as views of ``mem`` (``TABLE_WORDS`` int64s that ``fill_tables``
    wrote)."""
    return mem[:COLS], mem[COLS : COLS + _ROWS].view(_ROWS, 1), mem[COLS + _ROWS :]


def fill_tables(mem: torch.Tensor) -> None:
    """Write ``make_tables``' constants into ``mem`` (``TABLE_WORDS`` int64s, on any
    device) by kernels on the current stream: memory the caller allocated (a device's
    stream-ordered allocation), read through ``table_views``."""
    z, rows, weights = make_tables(mem.device)
    a, b, w = table_views(mem)
    a.copy_(z)
    b.copy_(rows)
    w.copy_(weights)


def _tables_on(device: torch.device) -> Tables:
    """The constants on ``device`` for callers that wait for their result (the CPU, and
    ``wsum64_digest``, which reads the hashes back): made once per device. On CUDA they
    are made on the current stream and synchronized once, so every stream may use them
    afterwards."""
    found = _tables.get(device)
    if found is None:
        with _lock:
            found = _tables.get(device)
            if found is None:
                made = make_tables(device)
                if device.type == "cuda":
                    torch.cuda.current_stream(device).synchronize()
                found = _tables[device] = made
    return found


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of contiguous tensor ``t`` as a 1-D uint8 view of its storage (any
    dtype, no copy); the caller has resolved lazy conjugate/negative bits."""
    nbytes = t.numel() * t.element_size()
    out = torch.empty(0, dtype=torch.uint8, device=t.device)
    out.set_(t.untyped_storage(), t.storage_offset() * t.element_size(), (nbytes,), (1,))
    return out


def _whole_pieces(words: torch.Tensor, out: torch.Tensor, tables: Tables) -> None:
    """``out[p]`` = the hash sum of whole piece ``p`` of ``words`` (int32, a multiple of
    a piece long), without the length term; GROUP_BYTES of input at a time."""
    a, b, _ = tables
    per_piece = COLS * _ROWS
    group = max(1, GROUP_BYTES // PIECE_BYTES)
    pieces = words.numel() // per_piece
    for lo in range(0, pieces, group):
        hi = min(pieces, lo + group)
        block = words[lo * per_piece : hi * per_piece].view(hi - lo, _ROWS, COLS)
        if words.device.type == "cpu":
            # The CPU multiplies int64 by int64 far faster than it promotes int32.
            prod = block.to(torch.int64)
            prod.mul_(a)
        else:
            prod = torch.mul(block, a)  # int32 * int64 -> int64, one kernel
        rows = prod.sum(dim=2)  # (pieces, rows)
        del prod
        torch.sum(rows * b.view(1, _ROWS), dim=1, out=out[lo:hi])


def _last_piece(u8: torch.Tensor, tables: Tables) -> torch.Tensor:
    """The hash sum of one piece of fewer than PIECE_BYTES bytes (0-dim int64), without
    the length term."""
    a, b, weights = tables
    n = u8.numel()
    whole = n // 4
    words = u8[: whole * 4].view(torch.int32)
    full_rows, rest = divmod(whole, COLS)
    total = torch.zeros((), dtype=torch.int64, device=u8.device)
    if full_rows:
        rows = torch.mul(words[: full_rows * COLS].view(full_rows, COLS), a).sum(dim=1)
        total += (rows * b[:full_rows, 0]).sum()
    if rest:
        total += torch.mul(words[full_rows * COLS :], a[:rest]).sum() * b[full_rows, 0]
    tail = n - whole * 4
    if tail:
        # The zero-padded last word: little-endian bytes, at most 24 bits, so positive.
        word = (u8[whole * 4 :].to(torch.int64) * weights[:tail]).sum()
        r, c = divmod(whole, COLS)  # the word's index; r < rows in a partial piece
        total += word * (a[c] * b[r, 0])
    return total


def piece_count(nbytes: int) -> int:
    """Pieces (digest entries) of ``nbytes`` bytes: at least one."""
    return max(1, -(-nbytes // PIECE_BYTES))


def piece_hashes(
    u8: torch.Tensor, out: torch.Tensor | None = None, tables: Tables | None = None
) -> torch.Tensor:
    """The WSUM64 of every piece of ``u8`` (1-D uint8, on any device), as an int64
    tensor on that device (signed; ``& (2**64 - 1)`` gives the digest's values), into
    ``out`` when given (``piece_count`` entries). Only enqueues work on the current
    stream: nothing waits for the device. ``tables``: ``make_tables``'s, made on this
    stream (default: the shared ones of ``_tables_on``). ``u8`` must start at an
    address that is a multiple of 4 (``device_pairs`` checks it)."""
    if tables is None:
        tables = _tables_on(u8.device)
    n = u8.numel()
    pieces = piece_count(n)
    if out is None:
        out = torch.empty(pieces, dtype=torch.int64, device=u8.device)
    whole = n // PIECE_BYTES
    if whole:
        _whole_pieces(u8[: whole * PIECE_BYTES].view(torch.int32), out[:whole], tables)
        out[:whole] += _signed(PIECE_BYTES * LEN_MUL)
    rest = n - whole * PIECE_BYTES
    if rest or n == 0:
        out[whole] = _last_piece(u8[whole * PIECE_BYTES :], tables) + _signed(rest * LEN_MUL)
    return out


def device_pairs(
    dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], min_bytes: int | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (host destination, source) pairs whose source's bytes are the destination's
    bytes exactly (same dtype and shape, both contiguous, no lazy bits) and at least
    ``min_bytes`` (default ``MIN_DEVICE_BYTES``): what a device can hash before it
    copies. The rest are hashed from the host copy."""
    floor = MIN_DEVICE_BYTES if min_bytes is None else min_bytes
    out = []
    for d, s in zip(dsts, srcs):
        if s.numel() * s.element_size() < floor:
            continue
        if s.dtype != d.dtype or s.shape != d.shape or not (s.is_contiguous() and d.is_contiguous()):
            continue
        if s.is_conj() or s.is_neg() or d.is_conj() or d.is_neg():
            continue
        if s.data_ptr() % 4:
            # Its bytes cannot be read as int32 words in place: the address, not only
            # the offset in its storage (a DLPack import may start at an odd address,
            # and an int32 load there faults the kernel).
            continue
        out.append((d, s))
    return out


def hash_layout(
    dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]
) -> tuple[list[tuple[torch.Tensor, torch.Tensor, int, int]], int]:
    """The pairs a device hashes (``device_pairs``) and where their hashes go in one
    int64 result buffer: per (destination, source), its first slot and its piece
    count; and the buffer's length (0: nothing to hash)."""
    out = []
    start = 0
    for d, src in device_pairs(dsts, srcs):
        pieces = piece_count(d.numel() * d.element_size())
        out.append((d, src, start, pieces))
        start += pieces
    return out, start


def digest_tensor(hashes: torch.Tensor) -> list[int]:
    """``piece_hashes``'s result as the digest: unsigned 64-bit integers (reads the
    tensor: on a device, this waits for it)."""
    return [int(h) & _MASK for h in hashes.tolist()]


#: A CPU tensor of at least this many bytes is hashed on the current CUDA device when
#: this process already uses CUDA (a restore read back into host memory): the CPU
#: hashes WSUM64 per thread far slower than a GPU reads its memory, so the upload pays
#: for itself above this size.
OFFLOAD_BYTES = 8 << 20


def wsum64_digest(t: torch.Tensor) -> list[int]:
    """The WSUM64 digest of any tensor (on any device), computed now: its values in
    row-major order (a contiguous copy first only when it is not contiguous or has lazy
    bits). A big CPU tensor goes to the GPU for it when CUDA is already initialised
    (``OFFLOAD_BYTES``); never creates a CUDA context."""
    d = t.detach()
    if (
        d.device.type == "cpu"
        and d.numel() * d.element_size() >= OFFLOAD_BYTES
        and torch.cuda.is_available()
        and torch.cuda.is_initialized()
    ):
        d = d.to(torch.device("cuda", torch.cuda.current_device()))
    if d.is_conj():
        d = d.resolve_conj()
    if d.is_neg():
        d = d.resolve_neg()
    if not d.is_contiguous() or d.data_ptr() % 4:
        d = d.clone(memory_format=torch.contiguous_format)  # contiguous, and 4-byte aligned
    return digest_tensor(piece_hashes(raw_bytes(d)))
