"""PyTorch DCP's staging interface: the ``CheckpointStager`` base class and its config.

The seed (PyTorch's experimental ``torch.distributed.checkpoint.staging``, continued by
meta-pytorch/torch_checkpointing) defines a stager as ``stage``/``close`` and its config
as four ``use_*`` flags; ``DefaultStager`` (``_default_stager``) implements both on the
engine. Kept apart so the interface reads on its own.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from async_stager._core.stats import METRIC_PREFIX
from async_stager.errors import InvalidOptionError, InvalidOptionTypeError

__all__ = [
    "DEFAULT_METRIC_PREFIX",
    "DEFAULT_THREAD_NAME",
    "STATE_DICT",
    "CheckpointStager",
    "CheckpointStagerConfig",
    "can_pin_memory",
    "check_name",
]

STATE_DICT = dict[str, Any]

# torch_checkpointing's names (its staging.py), so a switched stager keeps the thread
# and metric names that dashboards and py-spy filters already look for.
DEFAULT_THREAD_NAME = "ckpt-staging"
DEFAULT_METRIC_PREFIX = "train.checkpoint_write"
#: The prefix of async_stager's own ``Stager`` (kept for reference by callers).
STAGER_METRIC_PREFIX = METRIC_PREFIX


def can_pin_memory() -> bool:
    """Whether host memory can be pinned here (CUDA and its runtime): the default of
    ``use_pinned_memory`` and ``use_non_blocking_copy``, as torch_checkpointing's.

    Read at each call through ``torch.cuda``'s attributes (so a patched
    ``torch.cuda.is_available`` is seen, as the peer's tests rely on)."""
    return bool(torch.cuda.is_available()) and torch.cuda.cudart() is not None


class CheckpointStager(abc.ABC):
    """Interface of a checkpoint stager, as torch_checkpointing's: ``stage``,
    ``get_staged_state_dict`` and ``close`` (abstract), and ``pinned_num_bytes`` (0
    unless a stager pins host memory)."""

    @abc.abstractmethod
    def stage(
        self, state_dict: STATE_DICT, keys_not_requiring_copy: Iterable[Any] = ()
    ) -> STATE_DICT | Future[STATE_DICT]:
        """A staged copy of ``state_dict`` (the top-level ``keys_not_requiring_copy``
        passed through as they are), or a Future of it."""

    @abc.abstractmethod
    def get_staged_state_dict(self) -> STATE_DICT | None:
        """The most recently staged state dict, if any."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release every resource of the stager."""

    def pinned_num_bytes(self) -> int:
        """Pinned (page-locked) host memory held, in bytes; 0 by default."""
        return 0


@dataclass(frozen=True)
class CheckpointStagerConfig:
    """torch_checkpointing's config: four flags, a thread name and a metric prefix.

    Defaults as torch_checkpointing's (read at construction): ``use_pinned_memory``
    and ``use_non_blocking_copy`` are True when CUDA can pin memory, False otherwise
    (``can_pin_memory()``); the rest True. ``None`` for those two is the same
    (``machine_defaults`` names the flags so defaulted). PyTorch's own ``StagingOptions`` (the seed's class, every flag True) is
    accepted by ``DefaultStager`` with its defaults unchanged.

    - ``use_pinned_memory``: pinned host arenas (needs CUDA).
    - ``use_shared_memory``: shared-memory host arenas (memfd; one descriptor each).
    - ``use_async_staging``: ``stage()`` returns a Future; staging runs in a worker.
    - ``use_non_blocking_copy``: asynchronous device-to-host copies (needs CUDA).
    - ``thread_name``: the name of the stager's worker thread, in Python and at OS
      level (Linux keeps its first 15 bytes: ``top -H``, ``py-spy``,
      ``/proc/self/task/<tid>/comm``).
    - ``metric_prefix``: the prefix of the metric names in the stage log records
      (``<prefix>.stage_seconds``, ``<prefix>.bytes``, ``<prefix>.cache_hits``).
    """

    use_pinned_memory: bool | None = None
    use_shared_memory: bool = True
    use_async_staging: bool = True
    use_non_blocking_copy: bool | None = None
    thread_name: str = DEFAULT_THREAD_NAME
    metric_prefix: str = DEFAULT_METRIC_PREFIX
    #: The flags given as None (or left out), now read as ``can_pin_memory()``: a
    #: DefaultStager asks its device backend for those instead (the same answer on a
    #: real machine; the test seams' fake devices decide for themselves).
    machine_defaults: frozenset[str] = field(init=False, repr=False, compare=False, default=frozenset())

    def __post_init__(self) -> None:
        defaulted = frozenset(f for f in _MACHINE_FLAGS if getattr(self, f) is None)
        if defaulted:
            can_pin = can_pin_memory()
            for f in defaulted:
                # Frozen: set once, here, as dataclasses' own __init__ does.
                object.__setattr__(self, f, can_pin)
        object.__setattr__(self, "machine_defaults", defaulted)


_MACHINE_FLAGS = ("use_pinned_memory", "use_non_blocking_copy")


def check_name(what: str, value: Any) -> str:
    """``value`` as a thread or metric name: a non-empty str without NUL."""
    if not isinstance(value, str):
        raise InvalidOptionTypeError(f"{what} must be a str, got {value!r} of type {type(value).__name__}")
    if not value or "\0" in value:
        raise InvalidOptionError(f"{what} must be a non-empty str without NUL, got {value!r}")
    return value
