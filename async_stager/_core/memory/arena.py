"""Host memory: arenas of pinned and/or shared memory, carved into exact-size blocks.

An arena is one ``mmap`` region: anonymous memory, or a memfd when it must be shared
with another process (one file descriptor per arena, whatever the number of tensors).
When pinning is asked for, the whole arena is registered with CUDA once
(``cudaHostRegister``), never per tensor and never rounded up to a power of two.

Each block gets its own exact-size torch storage (``torch.frombuffer`` over a slice of
the mapping). That matters downstream: DCP's FileSystemWriter clones any tensor whose
storage is larger than the tensor, and ``torch.save`` of a view writes its whole
storage, so views into one big storage would cost a second copy in the writer.

Ownership: the pool owns its arenas; every block's tensor holds a reference to the
arena's mmap object, so a staged tensor a user still holds after ``close()`` stays
valid host memory. Close unpins and drops the pool's references; the region is unmapped
when the last tensor viewing it dies.

Node budget: a pool given a ``reserve`` function (a node ledger's, see ``ledger``)
reserves each new arena's bytes before it maps or pins it; the reservation is given
back when the pool lets the arena go (``trim``, ``close``; ``trim`` drops only arenas
no result uses), and by a finalizer on the mmap object for an arena dropped without
``close()``. A staged result a caller still holds after the stager is closed keeps its
memory mapped, no longer counted.
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from async_stager.errors import HostAllocationError, PinningError

if TYPE_CHECKING:
    from async_stager._core.memory.ledger import Reservation

__all__ = [
    "ALIGN",
    "Arena",
    "Block",
    "CudaPinner",
    "HostPool",
    "Pinner",
    "align",
    "arena_at",
    "pin",
    "pinning_skipped",
]

#: Block alignment in bytes: a cache line, and enough for any dtype and for DMA.
ALIGN = 64
_PAGE = mmap.PAGESIZE
#: Each new arena is at least this big (bytes), so a trickle of new small storages
#: does not make one mapping (and one pin registration) each.
MIN_ARENA_BYTES = 1 << 20


def align(n: int, a: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``a``: the bytes a block of ``n`` takes."""
    return (n + a - 1) // a * a


class Pinner(Protocol):
    """Registers host memory with an accelerator (page-locks it) and back.

    Optional class attribute ``charges_memlock`` (default False): True for a pinner
    whose pages count against RLIMIT_MEMLOCK (one built on ``mlock``); the pre-flight
    then enforces that limit (``_preflight``). CudaPinner's do not.

    Optional attribute ``needs_context`` (default False): True for a pinner that needs
    an accelerator context to pin, and creates one where none exists (CudaPinner); the
    engine then pins nothing for a stage with no device in use (see
    ``Engine._skips_pinning``)."""

    def register(self, ptr: int, nbytes: int) -> None: ...

    def unregister(self, ptr: int) -> None: ...


class CudaPinner:
    """cudaHostRegister/cudaHostUnregister through torch's bundled cudart bindings."""

    # cudaHostRegisterPortable: the pinning is visible to every CUDA context, so one
    # arena serves copies from any device.
    _FLAGS = 1
    #: cudaHostRegister creates a context on the current device when it has none.
    needs_context = True

    def register(self, ptr: int, nbytes: int) -> None:
        rt = torch.cuda.cudart()
        err = int(rt.cudaHostRegister(ptr, nbytes, self._FLAGS))
        if err != 0:
            # Hazard: the failure is also this thread's CUDA "last error", which torch's
            # next kernel-launch check would report against an unrelated tensor: the
            # stager would not stay usable. Take it off the thread.
            _clear_cuda_last_error()
            raise PinningError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {err}")

    def unregister(self, ptr: int) -> None:
        err = int(torch.cuda.cudart().cudaHostUnregister(ptr))
        if err != 0:
            _clear_cuda_last_error()
            raise PinningError(f"cudaHostUnregister failed with CUDA error {err}")


def pin(pinner: Pinner, owner: object, ptr: int, nbytes: int) -> weakref.finalize[Any, Any]:
    """Register the ``nbytes`` bytes at ``ptr`` with ``pinner``: the one pinning path of
    the arenas and the budget ring (same pinner, same flags, a failed registration's
    CUDA error cleared by ``CudaPinner``). Raises PinningError (the pinner's own, or one
    wrapping any other failure); nothing stays registered then. Returns the finalizer
    that unregisters once: call it to unpin; it also runs when ``owner`` (what holds
    the memory) is collected, since pages left pinned would make a later mapping at the
    same address fail to register ("already registered")."""
    try:
        pinner.register(ptr, nbytes)
    except PinningError:
        raise
    except Exception as e:
        raise PinningError(f"pinning {nbytes} bytes failed: {e}") from e
    return weakref.finalize(owner, pinner.unregister, ptr)


def _clear_cuda_last_error() -> None:
    """cudaGetLastError() in the CUDA runtime torch already loaded (best effort: a
    torch that links the runtime statically exposes no symbol to call)."""
    import ctypes

    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"):
        try:
            lib = ctypes.CDLL(name, mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_LOCAL)
        except OSError:
            continue
        try:
            lib.cudaGetLastError()
        except AttributeError:
            continue
        return


class Arena:
    """One mapping of ``nbytes`` bytes: anonymous, or a memfd when ``shared``."""

    def __init__(
        self,
        nbytes: int,
        *,
        shared: bool,
        pinner: Pinner | None,
        prefault: bool = False,
        reservation: Reservation | None = None,
    ) -> None:
        """``reservation``: ``nbytes`` of a node budget, owned by the arena from now on
        (given back when the mapping goes, or at once if mapping fails)."""
        self.nbytes = nbytes
        self.shared = shared
        self.fd = -1
        self._pinner = pinner
        self._pinned_ptr = 0
        self._fd_closer: weakref.finalize[Any, Any] | None = None
        self._unpinner: weakref.finalize[Any, Any] | None = None
        try:
            if shared:
                self.fd = _make_shared_fd(nbytes)
                # An arena dropped without close() (a stager never closed) must not
                # leak its descriptor: closed when the arena is collected.
                self._fd_closer = weakref.finalize(self, os.close, self.fd)
                self.mm = mmap.mmap(self.fd, nbytes, flags=mmap.MAP_SHARED)
            else:
                # MAP_PRIVATE: a forked child gets copy-on-write pages, never a view that
                # a later stage in the parent writes into (Megatron-LM #2288).
                self.mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            # Transparent huge pages where the kernel allows them: one fault per huge
            # page instead of one per page on the first copy (and lazy faults rather
            # than MAP_POPULATE, which made the first stage slower).
            if hasattr(mmap, "MADV_HUGEPAGE"):
                try:
                    self.mm.madvise(mmap.MADV_HUGEPAGE)
                except OSError:
                    pass
        except OSError as e:
            self._close_fd()
            if reservation is not None:
                reservation.release()
            raise HostAllocationError(
                f"could not map {nbytes} bytes of {'shared' if shared else 'host'} memory: {e}"
            ) from e
        except BaseException:
            if reservation is not None:
                reservation.release()
            raise
        self._reservation = reservation
        if reservation is not None:
            # The backstop for an arena never closed: when its region is unmapped.
            # Hazard: that may be any thread, the event loop's too: a release takes the
            # node lock for one record write (plus any wait for another process's).
            weakref.finalize(self.mm, reservation.release)
        # The base tensor views the whole mapping; its data_ptr is the arena's address.
        self.tensor = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.base = self.tensor.data_ptr()
        _live.add(self)
        if prefault:
            # Touch every page now (reserve()): the first stage then pays no faults.
            self.tensor.zero_()
        if pinner is not None:
            try:
                self._unpinner = pin(pinner, self, self.base, nbytes)
            except PinningError:
                self._release_mapping()
                raise
            self._pinned_ptr = self.base

    @property
    def pinned(self) -> bool:
        """Whether the arena is registered with its pinner now."""
        return self._pinned_ptr != 0

    def block_tensor(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor whose storage is exactly bytes [offset, offset+nbytes)."""
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self.mm, dtype=torch.uint8, count=nbytes, offset=offset)

    def close(self) -> None:
        """Unpin and drop this arena's references; idempotent. The mapping and the
        file descriptor are released even if unpinning raises (which is re-raised)."""
        try:
            if self._pinned_ptr and self._unpinner is not None:
                self._pinned_ptr = 0
                self._unpinner()  # unregister, once
        finally:
            self._release_mapping()

    def _release_mapping(self) -> None:
        # Hazard: never mm.close() here. torch.frombuffer keeps a reference to the
        # mmap object but no buffer export, so close() would unmap memory that staged
        # tensors still view (a segfault on the next read). Dropping our references
        # instead unmaps the region when the last tensor viewing it dies: at once if
        # nobody holds a staged result any more.
        _live.close(self)
        self.__dict__.pop("tensor", None)
        self.__dict__.pop("mm", None)
        self._close_fd()
        # The pool lets the arena go: its bytes go back to the node budget now (the
        # stager's own references to old blocks may keep the mapping a little longer).
        reservation, self._reservation = getattr(self, "_reservation", None), None
        if reservation is not None:
            reservation.release()

    def _close_fd(self) -> None:
        if self.fd >= 0:
            self.fd = -1
            if self._fd_closer is not None:
                self._fd_closer()  # os.close, once


class _LiveArenas:
    """The arenas of this process by address range, so that code given only a storage
    (a pickler's reducer) can tell whether it lies in one. An entry lasts as long as
    its mapping (weakly held): after ``close()`` it says "closed" while tensors still
    view the memory, and goes when the memory is unmapped (the range may then be
    reused by anything)."""

    def __init__(self) -> None:
        # Reentrant: a weakref callback may run (garbage collection) while it is held.
        self._lock = threading.RLock()
        self._bases: list[int] = []  # sorted
        # base -> [nbytes, the arena while open (else None), the mapping (weak)]
        self._by_base: dict[int, list[Any]] = {}

    def add(self, arena: Arena) -> None:
        base = arena.base

        def gone(ref: weakref.ref[mmap.mmap]) -> None:
            with self._lock:
                entry = self._by_base.get(base)
                if entry is not None and entry[2] is ref:
                    del self._by_base[base]
                    self._bases.remove(base)

        with self._lock:
            if base not in self._by_base:
                bisect.insort(self._bases, base)
            self._by_base[base] = [arena.nbytes, weakref.ref(arena), weakref.ref(arena.mm, gone)]

    def close(self, arena: Arena) -> None:
        with self._lock:
            entry = self._by_base.get(arena.base)
            if entry is not None and entry[1] is not None and entry[1]() is arena:
                entry[1] = None

    def at(self, ptr: int, nbytes: int) -> tuple[bool, Arena | None]:
        with self._lock:
            i = bisect.bisect_right(self._bases, ptr) - 1
            if i < 0:
                return False, None
            size, arena_ref, mm_ref = self._by_base[self._bases[i]]
            if ptr + nbytes > self._bases[i] + size or mm_ref() is None:
                return False, None
            return True, None if arena_ref is None else arena_ref()


_live = _LiveArenas()


def arena_at(ptr: int, nbytes: int) -> tuple[bool, Arena | None]:
    """Whether bytes [ptr, ptr+nbytes) lie in an arena of this process (of any pool)
    that is still mapped, and that arena while it is open (None once closed: its memory
    may still be mapped for tensors that view it, but its descriptor is gone).
    Thread-safe; O(log arenas)."""
    return _live.at(ptr, nbytes)


def _make_shared_fd(nbytes: int) -> int:
    """A file descriptor of ``nbytes`` bytes of shared memory, with no name to leak."""
    if hasattr(os, "memfd_create"):
        # Sealable: the memory tier's agent seals a snapshot's arenas once their writer
        # is gone (``_tier.sealing``); the kernel grants that only while no process maps
        # them shared and writable, so a seal never takes memory from a live writer.
        fd = os.memfd_create("async_stager", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    else:  # pragma: no cover - non-Linux
        import tempfile

        d = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, name = tempfile.mkstemp(prefix="async_stager-", dir=d)
        os.unlink(name)
    try:
        os.ftruncate(fd, nbytes)
        # Reserve the pages now: a full tmpfs then fails here with ENOSPC instead of
        # killing the process with SIGBUS at the first copy.
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, nbytes)
    except OSError:
        os.close(fd)
        raise
    return fd


@dataclass(eq=False)
class Block:
    """Bytes [offset, offset+nbytes) of ``arena``; ``tensor`` is its exact-size uint8 view.

    A zero-byte block needs no memory: its ``arena`` is None (it is in no pool)."""

    arena: Arena | None
    offset: int
    nbytes: int
    tensor: torch.Tensor
    #: The Python object of the block's storage, kept so that it stays the one that
    #: ``untyped_storage()`` returns for every tensor viewing the block (torch keeps
    #: one object per storage while it is referenced): a user holding it then shows in
    #: its reference count (see ``BufferSet.held``).
    storage: torch.UntypedStorage = field(init=False)

    def __post_init__(self) -> None:
        self.storage = self.tensor.untyped_storage()


_skip = threading.local()


@contextlib.contextmanager
def pinning_skipped() -> Iterator[None]:
    """Within it, arenas a pool makes on this thread are not pinned, and free space is
    taken from any arena: the engine's, for a stage with no accelerator device in use
    (a CPU-only state dict before CUDA is initialised), where pinning would create a
    CUDA context (about 0.5 GiB of device memory) for memory no device copy uses."""
    prev = getattr(_skip, "on", False)
    _skip.on = True
    try:
        yield
    finally:
        _skip.on = prev


class HostPool:
    """Arenas of one kind (pinned/shared) and the free space in them.

    Thread-safe: the worker thread allocates while the loop thread may close.
    """

    def __init__(
        self,
        *,
        shared: bool,
        pinner: Pinner | None,
        reserve: Callable[[int, Callable[[], int]], Reservation] | None = None,
    ) -> None:
        """``reserve``: called with a new arena's bytes before it is mapped (blocking,
        worker thread; may raise, e.g. NodeBudgetError), and a function that releases
        this pool's arenas no block is allocated from (returns the bytes; for a budget
        that is short); None: no node budget."""
        self.shared = shared
        self._pinner = pinner
        self._reserve = reserve
        self._lock = threading.Lock()
        self.arenas: list[Arena] = []
        # Per arena: sorted, coalesced free ranges [(offset, size)].
        self._free: dict[Arena, list[tuple[int, int]]] = {}
        self._used: dict[Arena, int] = {}

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory mapped by this pool (the arenas' sizes)."""
        return sum(a.nbytes for a in self.arenas)

    def allocate(self, sizes: Sequence[int], *, prefault: bool = False) -> list[Block]:
        """One block per size (bytes), from free space first, then one new arena for
        the rest, sized to exactly what is missing (``prefault``: touch its pages now).

        Blocks of one call that land in a new arena are adjacent and in order, which
        lets the device layer move a run of small ones with one copy.

        A pool that pins takes free space only from pinned arenas (an arena made
        within ``pinning_skipped`` is not: a device copy into it would be synchronous),
        except within ``pinning_skipped``, where its new arena is not pinned either.
        """
        skip = self._pinner is not None and getattr(_skip, "on", False)
        pinner = None if skip else self._pinner
        with self._lock:
            out: list[Block | None] = [None] * len(sizes)
            pending = [i for i, n in enumerate(sizes) if n > 0]
            for i, n in enumerate(sizes):
                if n == 0:
                    out[i] = Block(None, 0, 0, torch.empty(0, dtype=torch.uint8))
            for arena in self.arenas:
                if not pending:
                    break
                if pinner is not None and not arena.pinned:
                    continue
                pending = self._fit(arena, sizes, pending, out)
            if pending:
                need = max(sum(align(sizes[i]) for i in pending), MIN_ARENA_BYTES)
                # Hazard: this may wait (the node budget's bound) with the pool's lock
                # held; only this set's stage allocates from it, and a close marks the
                # sets closed first, which ends the wait (the reserve function's stop).
                reservation = self._reserve(need, self._trim_locked) if self._reserve is not None else None
                arena = Arena(
                    need, shared=self.shared, pinner=pinner, prefault=prefault, reservation=reservation
                )
                self.arenas.append(arena)
                self._free[arena] = [(0, arena.nbytes)]
                self._used[arena] = 0
                pending = self._fit(arena, sizes, pending, out)
                assert not pending
            return out  # type: ignore[return-value]

    def _fit(
        self,
        arena: Arena,
        sizes: Sequence[int],
        pending: list[int],
        out: list[Block | None],
    ) -> list[int]:
        # Greedy and linear: walk the free ranges once, placing requests in order.
        free = self._free[arena]
        new_free: list[tuple[int, int]] = []
        k = 0
        npending = len(pending)
        used = 0
        block_tensor = arena.block_tensor
        for off, size in free:
            while k < npending:
                i = pending[k]
                nb = sizes[i]
                n = align(nb)
                if n > size:
                    break
                out[i] = Block(arena, off, nb, block_tensor(off, nb))
                used += n
                off += n
                size -= n
                k += 1
            if size:
                new_free.append((off, size))
        self._used[arena] += used
        self._free[arena] = new_free
        return pending[k:]

    def free(self, blocks: Sequence[Block]) -> None:
        """Give blocks back to their arenas' free space. An arena that becomes wholly
        free stays mapped and pinned: the next checkpoint's storages (fresh tensors of
        the same sizes, typically) reuse it with no new mapping, pin or page fault.
        Memory goes back to the system only through ``trim`` and ``close``."""
        with self._lock:
            by_arena: dict[Arena, list[tuple[int, int]]] = {}
            for b in blocks:
                if b.nbytes == 0 or b.arena is None or b.arena not in self._free:
                    continue
                by_arena.setdefault(b.arena, []).append((b.offset, align(b.nbytes)))
                self._used[b.arena] -= align(b.nbytes)
            for arena, ranges in by_arena.items():
                merged: list[tuple[int, int]] = []
                for off, size in sorted(self._free[arena] + ranges):
                    if merged and merged[-1][0] + merged[-1][1] == off:
                        merged[-1] = (merged[-1][0], merged[-1][1] + size)
                    else:
                        merged.append((off, size))
                self._free[arena] = merged

    def trim(self) -> int:
        """Release (unpin, unmap) every arena no block is allocated from; returns the
        bytes released. Raises PinningError (after releasing the rest) if unpinning
        failed."""
        with self._lock:
            return self._trim_locked()

    def _trim_locked(self) -> int:
        # Under the lock (``trim``, or ``allocate`` making room in a node budget).
        errors: list[BaseException] = []
        empty = [a for a in self.arenas if self._used[a] == 0]
        for arena in empty:
            self._drop(arena, errors)
        _raise_first(errors)
        return sum(a.nbytes for a in empty)

    def _drop(self, arena: Arena, errors: list[BaseException]) -> None:
        # Forgotten first, closed second: an arena whose unpinning fails is still
        # unmapped and never handed out again; the error is collected, and the caller
        # goes on releasing the rest before raising it.
        self.arenas.remove(arena)
        del self._free[arena]
        del self._used[arena]
        try:
            arena.close()
        except Exception as e:  # noqa: BLE001 - re-raised by _raise_first
            errors.append(e)

    def close(self) -> None:
        """Release every arena; idempotent. Raises PinningError (after releasing
        everything) if unpinning failed."""
        with self._lock:
            errors: list[BaseException] = []
            for arena in list(self.arenas):
                self._drop(arena, errors)
            _raise_first(errors)


def _raise_first(errors: list[BaseException]) -> None:
    if errors:
        e = errors[0]
        if isinstance(e, PinningError):
            raise e
        raise PinningError(f"unpinning host memory failed: {e!r}") from e
