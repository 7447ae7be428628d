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
from dataclasses import dataclass
from typing import Any

from ._errors import InvalidOptionError, InvalidOptionTypeError
from ._stats import METRIC_PREFIX

__all__ = [
    "DEFAULT_METRIC_PREFIX",
    "DEFAULT_THREAD_NAME",
    "STATE_DICT",
    "CheckpointStager",
    "CheckpointStagerConfig",
    "check_name",
]

STATE_DICT = dict[str, Any]

DEFAULT_THREAD_NAME = "async-stager-dcp"
DEFAULT_METRIC_PREFIX = METRIC_PREFIX


class CheckpointStager(abc.ABC):
    """Interface of a checkpoint stager: ``stage`` and ``close`` (as in the seed), and
    ``pinned_num_bytes`` (0 unless a stager pins host memory)."""

    @abc.abstractmethod
    def stage(
        self, state_dict: STATE_DICT, keys_not_requiring_copy: Iterable[Any] = ()
    ) -> STATE_DICT | Future[STATE_DICT]:
        """A staged copy of ``state_dict`` (the top-level ``keys_not_requiring_copy``
        passed through as they are), or a Future of it."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release every resource of the stager."""

    def pinned_num_bytes(self) -> int:
        """Pinned (page-locked) host memory held, in bytes; 0 by default."""
        return 0


@dataclass(frozen=True)
class CheckpointStagerConfig:
    """The seed's four flags, and two of ours. ``None``: what the machine supports.

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


def check_name(what: str, value: Any) -> str:
    """``value`` as a thread or metric name: a non-empty str without NUL."""
    if not isinstance(value, str):
        raise InvalidOptionTypeError(f"{what} must be a str, got {value!r} of type {type(value).__name__}")
    if not value or "\0" in value:
        raise InvalidOptionError(f"{what} must be a non-empty str without NUL, got {value!r}")
    return value
