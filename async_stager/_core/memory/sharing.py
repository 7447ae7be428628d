"""torch's shared-memory calls on staged storages: the truth, and no silent move.

A staged tensor's storage is an exact-size ``torch.frombuffer`` view of an arena, so
torch does not see it as shared memory: ``is_shared()`` said False for a
``share_memory=True`` stager, whose arenas other processes do map (``export_shared``,
the torch.multiprocessing reducers), and ``share_memory_()`` copied the storage into a
new shared segment and swapped it *in place*. The stager's plan views that very
storage, so every later stage then wrote outside the stager's arenas (memory doubled,
on a GPU the pinning lost, the zero-copy hand-over gone), and a GPU's gathered small
tensors, copied into the arena, left the result's swapped tensors stale.

On import this module wraps four methods of ``torch.UntypedStorage`` (what
``Tensor.is_shared``/``share_memory_`` and torch's reducers call), for storages that lie
in an arena of this process (``arena_at``) only; every other storage gets torch's own
behaviour, untouched:

- ``is_shared()``: True for a storage in an open *shared* arena (memory another process
  can map); a private arena's storage stays False (the truth).
- ``share_memory_()``: a no-op for a storage in an open shared arena (it is shared
  memory already: it stays in place, and later stages stay in the arenas). Elsewhere
  torch's move, as before.
- ``_share_fd_cpu_()``/``_share_filename_cpu_()`` (torch's move, also what
  ``share_memory_()`` runs for a private arena's storage, and torch's reducer when ours
  cannot send by reference): torch's move, then ``moves()`` is bumped, so each buffer
  set finds its blocks that left the arena (``BufferSet.note_moves``) and stops using
  them: the next stage into that set stages into its arenas again.

Hazard: ``torch.multiprocessing.reductions.init_reductions()`` does not touch these
methods, but code that replaces them on ``torch.UntypedStorage`` after this import
replaces these wrappers; ``install()`` puts them back (idempotent).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

from async_stager._core.memory.arena import arena_at

__all__ = ["in_shared_arena", "install", "moves"]

_lock = threading.Lock()
_moves = 0

#: Marks a wrapper of ours (``install`` wraps a method only once).
_OURS = "_async_stager_wrapped"


def moves() -> int:
    """How many times a storage lying in one of this process's arenas was moved out of
    it in place (torch's ``_share_fd_cpu_``/``_share_filename_cpu_``). Only grows."""
    return _moves


def _bump() -> None:
    global _moves
    with _lock:
        _moves += 1


def in_shared_arena(storage: torch.UntypedStorage) -> bool:
    """Whether ``storage`` lies in an open shared-memory arena of this process (memory
    another process can map: the arena's descriptor is still open)."""
    if storage.device.type != "cpu":
        return False
    nbytes = storage.nbytes()
    if nbytes == 0:
        return False
    ours, arena = arena_at(storage.data_ptr(), nbytes)
    return ours and arena is not None and arena.shared and arena.fd >= 0


def _in_any_arena(storage: torch.UntypedStorage) -> bool:
    if storage.device.type != "cpu":
        return False
    nbytes = storage.nbytes()
    return nbytes > 0 and arena_at(storage.data_ptr(), nbytes)[0]


def _is_shared(orig: Callable[..., bool]) -> Callable[..., bool]:
    @functools.wraps(orig)
    def is_shared(self: torch.UntypedStorage) -> bool:
        return bool(orig(self)) or in_shared_arena(self)

    return is_shared


def _share_memory(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def share_memory_(self: torch.UntypedStorage, *args: Any, **kwargs: Any) -> Any:
        if in_shared_arena(self):
            return self
        return orig(self, *args, **kwargs)

    return share_memory_


def _move(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def share_cpu(self: torch.UntypedStorage, *args: Any, **kwargs: Any) -> Any:
        ours = _in_any_arena(self)
        # Counted before and after the move: a buffer set that looked between the first
        # count and the swap (and found nothing) looks again after the second. Also
        # when torch raised part way: a look that finds nothing moved costs one scan.
        if ours:
            _bump()
        try:
            return orig(self, *args, **kwargs)
        finally:
            if ours:
                _bump()

    return share_cpu


_WRAPPERS: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    "is_shared": _is_shared,
    "share_memory_": _share_memory,
    "_share_fd_cpu_": _move,
    "_share_filename_cpu_": _move,
}


def install() -> None:
    """Wrap the methods (see the module doc) on ``torch.UntypedStorage``; idempotent."""
    cls = torch.UntypedStorage
    for name, wrap in _WRAPPERS.items():
        orig = getattr(cls, name)
        if getattr(orig, _OURS, False):
            continue
        wrapper = wrap(orig)
        setattr(wrapper, _OURS, True)
        setattr(cls, name, wrapper)


install()
