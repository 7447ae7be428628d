"""The seed's API (PyTorch DCP's experimental staging module) on async_stager's engine.

``CheckpointStager`` (abstract), ``CheckpointStagerConfig`` (the four ``use_*`` flags)
and ``DefaultStager`` keep the seed's calls and results: ``stage()`` returns the staged
state dict, or a ``concurrent.futures.Future`` of it when ``use_async_staging``. A
DefaultStager also satisfies DCP's ``AsyncStager`` protocol, so it can be passed as
``async_stager=`` to ``torch.distributed.checkpoint.async_save``.

Differences from the seed, on purpose: flags left as None take what the machine
supports (so ``DefaultStager()`` works on a CPU-only machine), while asking explicitly
for a CUDA-only feature there raises UnsupportedError at construction; using a closed
stager raises ClosedError; ``close()`` is idempotent.
"""

from __future__ import annotations

import abc
import functools
from concurrent.futures import Future
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from ._engine import Engine, Staged
from ._errors import ClosedError
from ._options import resolve_options
from ._worker import Worker, WorkerStopped

__all__ = ["CheckpointStager", "CheckpointStagerConfig", "DefaultStager"]

STATE_DICT = dict[str, Any]


class CheckpointStager(abc.ABC):
    """Interface of a checkpoint stager: ``stage`` and ``close`` (as in the seed)."""

    @abc.abstractmethod
    def stage(self, state_dict: STATE_DICT, **kwargs: Any) -> STATE_DICT | Future[STATE_DICT]:
        """A staged copy of ``state_dict``, or a Future of it."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release every resource of the stager."""


@dataclass(frozen=True)
class CheckpointStagerConfig:
    """The seed's four flags. ``None``: what the machine supports.

    - ``use_pinned_memory``: pinned host arenas (needs CUDA).
    - ``use_shared_memory``: shared-memory host arenas (memfd; one descriptor each).
    - ``use_async_staging``: ``stage()`` returns a Future; staging runs in a worker.
    - ``use_non_blocking_copy``: asynchronous device-to-host copies (needs CUDA).
    """

    use_pinned_memory: bool | None = None
    use_shared_memory: bool = True
    use_async_staging: bool = True
    use_non_blocking_copy: bool | None = None


class DefaultStager(CheckpointStager):
    """The seed's DefaultStager on async_stager's engine.

    Results are valid until the next ``stage()`` on this stager (host buffers are
    reused, as in the seed); call ``stage()`` again only once the previous checkpoint
    has been written. Accepts PyTorch's ``StagingOptions`` as well as our config.
    """

    # DCP's AsyncStager protocol: async_save calls synchronize_staging() right after
    # starting the upload when this is True.
    _synchronize_after_execute: bool = True

    def __init__(self, config: Any = None, **engine_options: Any) -> None:
        if config is None:
            config = CheckpointStagerConfig()
        self._config = config
        pin = getattr(config, "use_pinned_memory", None)
        nb = getattr(config, "use_non_blocking_copy", None)
        backend = engine_options.pop("backend", None)
        pinner = engine_options.pop("pinner", None)
        options = resolve_options(
            pin_memory=pin,
            share_memory=bool(getattr(config, "use_shared_memory", True)),
            non_blocking=nb,
            seam=backend is not None or pinner is not None,
            pinner_given=pinner is not None,
            **engine_options,
        )
        self._async = bool(getattr(config, "use_async_staging", True))
        self._engine = Engine(options, backend=backend, pinner=pinner)
        self._worker = Worker("async-stager-dcp", nice=options.worker_nice)
        self._pending: Future[STATE_DICT] | None = None
        self._closed = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    def stage(self, state_dict: STATE_DICT, **kwargs: Any) -> STATE_DICT | Future[STATE_DICT]:
        """Stage ``state_dict``: the staged copy, or (async config) a Future of it.

        The snapshot point is this call. With a Future, do not modify the sources until
        it is done (or ``synchronize_staging()`` returned).
        """
        if self._closed:
            raise ClosedError("the DefaultStager is closed")
        captures = self._engine.capture()
        try:
            fut: Future[STATE_DICT] = self._worker.submit(
                functools.partial(self._stage_blocking, state_dict, captures)
            )
        except WorkerStopped:
            raise ClosedError("the DefaultStager is closed") from None
        self._pending = fut
        if self._async:
            return fut
        return fut.result()

    def _stage_blocking(self, state_dict: STATE_DICT, captures: dict[Any, Any]) -> STATE_DICT:
        staged: Staged = self._engine.run(state_dict, captures)
        # The worker waits for the copies (blocking this thread only).
        for c in staged.completions:
            c.synchronize()
        self._engine.settle(staged)
        result: STATE_DICT = staged.result
        return result

    def synchronize_staging(self) -> None:
        """Block until the last ``stage()`` has finished (errors are left to its Future)."""
        fut = self._pending
        if fut is not None:
            fut.exception()

    @property
    def host_bytes(self) -> int:
        """Host memory (bytes) held in arenas."""
        return self._engine.host_bytes

    def close(self) -> None:
        """Wait for a pending stage, release arenas and the worker; idempotent."""
        if self._closed:
            return
        self._closed = True
        fut = self._pending
        self._pending = None
        if fut is not None:
            fut.exception()
        self._engine.close()
        self._worker.stop()

    def __enter__(self) -> DefaultStager:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
