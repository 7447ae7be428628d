"""torch.multiprocessing without copies: staged tensors cross as arena references.

torch.multiprocessing registers reducers on ``multiprocessing.reduction.ForkingPickler``
(used by every ``Queue``, ``Pipe``/``Connection.send`` and DCP's process writer). Its
storage reducer moves a storage that is not already torch shared memory into a new
shared segment *in place* (``_share_fd_cpu_``): for a stager's memfd arenas that copies
every staged byte, once per storage, with one descriptor per storage (the stager then
drops the moved blocks and stages into new ones: ``_core.memory.sharing``).

This module registers, after torch's own (importing it imports ``torch.multiprocessing``
first), reducers for ``torch.Tensor``, ``torch.nn.Parameter`` and
``torch.UntypedStorage`` that recognise a storage lying inside an open *shared* arena of
this process (``_arena.arena_at``) and send it as (arena, byte offset, bytes). The arena
is one Python object per arena (``_ArenaToken``), so pickle's memo sends it, and its
descriptor (``multiprocessing.reduction.DupFd``, as torch does for its fds), once per
message however many tensors view it. The receiving process maps each arena once
(shared, read-write, like torch's shared memory; a mapping still alive from an earlier
message is reused) and rebuilds each storage as an exact-size ``torch.frombuffer`` view:
the mapping lives as long as any tensor views it, whatever the sender does meanwhile.
Tensors keep their lazy conjugate/negative bits (torch's reducer drops them) and Python
attributes. Every other tensor or storage goes to torch's reducer, unchanged.

Loud, never silent: a storage in one of our arenas that cannot go by reference (a
stager without ``share_memory``, an arena already closed, a platform that cannot pass
descriptors) goes through torch's copying reducer with a ``RuntimeWarning`` naming the
bytes and descriptors it costs, once per reason per process. ``counters()`` says what
crossed and how (used by tests and the ``bench-process`` command).

Limits: the sender must keep the staged buffers unchanged until the receiver is done
(hold the lease, as for any staged result; DCP's async_save does). A receiver writing
into the tensors writes into the stager's buffers (torch's shared-memory semantics).
If code calls ``torch.multiprocessing.reductions.init_reductions()`` again later, it
replaces these reducers: call ``install()`` again after it.
"""

from __future__ import annotations

import mmap
import multiprocessing.reduction as mp_reduction
import os
import pickle
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing  # torch registers its reducers first; ours replace them
from torch.multiprocessing import reductions as torch_reductions

from async_stager._core.memory.arena import Arena, arena_at
from async_stager._core.plan.views import lazy_bits, view_on

__all__ = ["ForkingCounters", "counters", "delegate_storage", "install"]


@dataclass(frozen=True)
class ForkingCounters:
    """What this process's ``ForkingPickler`` sent since start (or ``reset``).

    ``by_reference``: storages sent as arena references (``reference_bytes``: their
    bytes, none of them copied). ``arena_descriptors``: arena descriptors sent (one
    per arena per message). ``delegated``: CPU storages sent by torch's reducer (one
    descriptor each; ``copied_bytes``: the bytes of those that were not shared memory
    yet, which torch copied into new shared memory). ``warned``: fallbacks warned of.
    """

    by_reference: int = 0
    reference_bytes: int = 0
    arena_descriptors: int = 0
    delegated: int = 0
    copied_bytes: int = 0
    warned: int = 0


_lock = threading.Lock()
_counts: dict[str, int] = dict.fromkeys(ForkingCounters.__dataclass_fields__, 0)
_warned: set[str] = set()


def counters(*, reset: bool = False) -> ForkingCounters:
    """A snapshot of the counters; ``reset=True`` zeroes them after reading (and lets
    each fallback warning be given once more)."""
    with _lock:
        snap = ForkingCounters(**_counts)
        if reset:
            for k in _counts:
                _counts[k] = 0
            _warned.clear()
    return snap


def _count(**add: int) -> None:
    with _lock:
        for k, v in add.items():
            _counts[k] += v


def _warn_once(reason: str, message: str) -> None:
    with _lock:
        if reason in _warned:
            return
        _warned.add(reason)
        _counts["warned"] += 1
    warnings.warn(message, RuntimeWarning, stacklevel=3)


class _ArenaToken:
    """One shared arena as a pickle sees it: the same object for every storage in the
    arena, so a message carries it (and its descriptor) once. Reduced to a fresh
    ``DupFd`` per message; unpickled into an ``_AttachedArena``."""

    def __init__(self, arena: Arena) -> None:
        self._arena = weakref.ref(arena)
        self.nbytes = arena.nbytes

    def __reduce__(self) -> Any:
        arena = self._arena()
        fd = -1 if arena is None else arena.fd
        try:
            st = os.fstat(fd)
        except OSError as e:
            # Closed between the storage's reduction and this one (microseconds, in
            # the same dump): the storage is already a reference, so no fallback.
            raise pickle.PicklingError(
                f"async_stager: a shared arena of {self.nbytes} bytes was closed while it was being "
                "pickled; keep the stager open until the staged dict is sent"
            ) from e
        _count(arena_descriptors=1)
        return (_attach_arena, (mp_reduction.DupFd(fd), self.nbytes, st.st_dev, st.st_ino))


_tokens: weakref.WeakKeyDictionary[Arena, _ArenaToken] = weakref.WeakKeyDictionary()


def _token_of(storage: torch.UntypedStorage) -> tuple[_ArenaToken, int] | None:
    """(token, byte offset) for a CPU storage inside an open shared arena whose
    descriptor this process can send; None otherwise (warned of when it is ours)."""
    nbytes = storage.nbytes()
    if nbytes == 0 or storage.device.type != "cpu":
        return None
    ptr = storage.data_ptr()
    ours, arena = arena_at(ptr, nbytes)
    if not ours:
        return None  # not ours: torch's behaviour, untouched
    if arena is not None and not arena.shared:
        _warn_once(
            "private",
            f"async_stager: a staged storage of {nbytes} bytes from a stager without shared memory "
            "is pickled for another process: torch copies it into new shared memory (one "
            "descriptor per storage) and swaps it in place (the stager then stages into new "
            "blocks of its arenas). Every such storage costs the same (this warning is given "
            "once). Use Stager(share_memory=True) / DefaultStager(use_shared_memory=True) to "
            "send arenas by reference instead.",
        )
        return None
    fd = -1 if arena is None else arena.fd
    if arena is None or fd < 0 or not (mp_reduction.HAVE_SEND_HANDLE or _spawning()):
        _warn_once(
            "nofd",
            f"async_stager: a staged storage of {nbytes} bytes cannot be sent by reference "
            f"({'its arena is closed' if fd < 0 else 'this platform cannot pass descriptors'}): "
            "torch copies it into new shared memory, one descriptor per storage (this warning is "
            "given once; every such storage costs the same).",
        )
        return None
    with _lock:
        token = _tokens.get(arena)
        if token is None:
            token = _tokens[arena] = _ArenaToken(arena)
    return token, ptr - arena.base


def _spawning() -> bool:
    from multiprocessing.context import get_spawning_popen

    return get_spawning_popen() is not None


def delegate_storage(storage: Any) -> Any:
    """torch's own reducer of a storage (a copy into shared memory unless it is shared
    already), counted: what a storage outside the stagers' arenas is sent by."""
    if storage.device.type == "cpu" and storage.nbytes() > 0:
        copied = 0 if storage.is_shared() else storage.nbytes()
        _count(delegated=1, copied_bytes=copied)
    return _torch_reduce_storage(storage)


def _reduce_storage(storage: torch.UntypedStorage) -> Any:
    found = _token_of(storage)
    if found is None:
        return delegate_storage(storage)
    token, offset = found
    _count(by_reference=1, reference_bytes=storage.nbytes())
    return (_rebuild_storage, (token, offset, storage.nbytes()))


def _reduce_tensor(t: torch.Tensor) -> Any:
    if (
        t.layout is not torch.strided
        or t.is_nested
        or t.device.type != "cpu"
        or (t.requires_grad and not t.is_leaf)  # torch's reducer raises, as it should
    ):
        return _torch_reduce_tensor(t)
    storage = t.untyped_storage()
    found = _token_of(storage)
    if found is None:
        return _torch_reduce_tensor(t)
    torch.utils.hooks.warn_if_has_hooks(t)
    bits = lazy_bits(t)
    cls = torch.nn.Parameter if type(t) is torch.nn.Parameter else None
    args = (storage, t.dtype, t.storage_offset(), tuple(t.shape), t.stride(), t.requires_grad, bits, cls)
    state = torch._utils._get_obj_state(t) or None
    # The storage is pickled by _reduce_storage (memoized: views of one storage stay
    # views of one storage there).
    return (_rebuild_tensor, args, state, None, None, _set_state)


class _AttachedArena:
    """(Receiving process.) One arena mapped for one message: its storages."""

    def __init__(self, mm: mmap.mmap) -> None:
        self.mm = mm
        self.storages: dict[tuple[int, int], torch.UntypedStorage] = {}

    def storage(self, offset: int, nbytes: int) -> torch.UntypedStorage:
        s = self.storages.get((offset, nbytes))
        if s is None:
            view = torch.frombuffer(self.mm, dtype=torch.uint8, count=nbytes, offset=offset)
            s = self.storages[(offset, nbytes)] = view.untyped_storage()
        return s


#: (dev, ino) -> a live mapping of that arena in this (receiving) process. A mapping
#: keeps its file alive, so the inode cannot name another file while it is here.
_mappings: weakref.WeakValueDictionary[tuple[int, int], mmap.mmap] = weakref.WeakValueDictionary()


def _attach_arena(df: Any, nbytes: int, dev: int, ino: int) -> _AttachedArena:
    fd = df.detach()
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (dev, ino) or st.st_size < nbytes:
            raise RuntimeError(
                f"async_stager: the descriptor received for a shared arena of {nbytes} bytes names "
                "another file (the arena was closed while the message was in flight); hold the "
                "lease on the staged result until the receiver has it"
            )
        with _lock:
            mm = _mappings.get((dev, ino))
            if mm is None or len(mm) < nbytes:
                mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                _mappings[(dev, ino)] = mm
    finally:
        os.close(fd)  # the mapping keeps the memory (and Python's mmap its own dup)
    return _AttachedArena(mm)


def _rebuild_storage(arena: _AttachedArena, offset: int, nbytes: int) -> torch.UntypedStorage:
    return arena.storage(offset, nbytes)


def _rebuild_tensor(
    storage: torch.UntypedStorage,
    dtype: torch.dtype,
    storage_offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    requires_grad: bool,
    bits: int,
    cls: type[torch.Tensor] | None,
) -> torch.Tensor:
    t = view_on(storage, dtype, storage_offset, size, stride, bits)  # with the sender's lazy bits
    if cls is torch.nn.Parameter:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad_(True)
    return t


def _set_state(t: torch.Tensor, state: Any) -> None:
    torch._utils._set_obj_state(t, state)


_torch_reduce_tensor: Any = torch_reductions.reduce_tensor
_torch_reduce_storage: Any = torch_reductions.reduce_storage


def install() -> None:
    """Register the reducers on ``ForkingPickler`` (idempotent). Done on import of
    async_stager; call again if ``init_reductions()`` re-registered torch's."""
    global _torch_reduce_tensor, _torch_reduce_storage
    extra = mp_reduction.ForkingPickler._extra_reducers  # type: ignore[attr-defined]
    prev_t = extra.get(torch.Tensor)
    if prev_t is not None and prev_t is not _reduce_tensor:
        _torch_reduce_tensor = prev_t
    prev_s = extra.get(torch.UntypedStorage)
    if prev_s is not None and prev_s is not _reduce_storage:
        _torch_reduce_storage = prev_s
    mp_reduction.ForkingPickler.register(torch.Tensor, _reduce_tensor)
    mp_reduction.ForkingPickler.register(torch.nn.Parameter, _reduce_tensor)
    mp_reduction.ForkingPickler.register(torch.UntypedStorage, _reduce_storage)


install()
