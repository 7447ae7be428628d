"""The blocking half of a DCP save: ``torch.distributed.checkpoint.save`` of a staged
(host) copy, run in a thread by ``save`` (stage-then-save), by the budgeted pipeline
and by the Checkpointer's writes. Kept apart from ``save`` so the budgeted pipeline
reaches it without going back up into the module that calls the pipeline.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.storage import StorageWriter

__all__ = ["host_writer", "no_dist_quiet", "save_blocking"]

#: DCP warns on every ``no_dist`` save and load; a caller that asked for ``no_dist=True``
#: knows.
_NO_DIST_WARNING = r"torch\.distributed is disabled, unavailable or uninitialized"
_quiet_lock = threading.Lock()
_quiet_users = 0
_QUIET_FILTER = ("ignore", re.compile(_NO_DIST_WARNING, re.I), UserWarning, None, 0)


@contextlib.contextmanager
def no_dist_quiet() -> Iterator[None]:
    """Silence DCP's ``no_dist`` warning while the block runs, in any thread.

    Hazard: ``warnings.catch_warnings`` swaps the process-wide filter list and restores
    it at exit, so two threads inside it at once restore each other's lists: with
    overlapping saves or a restore beside a write, the warning escaped in the other
    thread (an error under ``-W error``), and a filter another thread added meanwhile
    was lost. Here one filter entry is inserted by the first user and removed by the
    last (counted under a lock); nothing else in the list is touched."""
    global _quiet_users
    with _quiet_lock:
        if _quiet_users == 0:
            cast(list[Any], warnings.filters).insert(0, _QUIET_FILTER)
            warnings._filters_mutated()  # type: ignore[attr-defined]
        _quiet_users += 1
    try:
        yield
    finally:
        with _quiet_lock:
            _quiet_users -= 1
            if _quiet_users == 0:
                try:
                    cast(list[Any], warnings.filters).remove(_QUIET_FILTER)
                except ValueError:
                    pass  # a catch_warnings elsewhere restored a list without it
                warnings._filters_mutated()  # type: ignore[attr-defined]


def host_writer(storage_writer: StorageWriter | None, checkpoint_id: Any) -> StorageWriter | None:
    """The writer DCP would pick for a plain path, told that the data is on the host.

    Hazard: DCP's default ``FileSystemWriter`` loads through ``_OverlappingCpuLoader``
    whenever CUDA is available, which synchronizes the caller's current stream every
    ``per_thread_copy_ahead`` bytes (10 MB), so a save of host tensors waited for
    training every 10 MB. ``per_thread_copy_ahead=0`` selects the serial loader, which
    needs no stream. A caller's own writer is kept as given; a non-path id (an fsspec
    URL, None) is left to DCP.
    """
    if storage_writer is not None or not isinstance(checkpoint_id, (str, os.PathLike)):
        return storage_writer
    if "://" in os.fspath(checkpoint_id):
        return None
    from async_stager._dcp.files import naming_writer

    # DCP's FileSystemWriter, whose full-disk errors name the file (``_dcp.files``).
    writer: StorageWriter = naming_writer(checkpoint_id, per_thread_copy_ahead=0)
    return writer


def save_blocking(
    staged: dict[str, Any], *, no_dist: bool, cuda_device: int | None = None, **kwargs: Any
) -> Metadata:
    """The DCP save itself (worker thread). Blocks for the serialization and writes.

    The current CUDA device is per thread: a new thread starts on device 0, and DCP
    runs NCCL collectives on ``torch.cuda.current_device()``, so the caller's device
    is set here first (rank k on GPU k would otherwise talk on GPU 0).
    """
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    if cuda_device is not None:
        torch.cuda.set_device(cuda_device)
    kwargs["storage_writer"] = host_writer(kwargs.get("storage_writer"), kwargs.get("checkpoint_id"))
    if not no_dist:
        metadata: Metadata = dcp_save(staged, no_dist=False, **kwargs)
        return metadata
    with no_dist_quiet():
        metadata = dcp_save(staged, no_dist=True, **kwargs)
    return metadata
