"""The seed's API (PyTorch DCP's experimental staging module) on async_stager's engine.

``CheckpointStager`` (abstract), ``CheckpointStagerConfig`` (the four ``use_*`` flags)
and ``DefaultStager`` keep the seed's calls and results: ``stage()`` returns the staged
state dict, or a ``concurrent.futures.Future`` of it when ``use_async_staging``. A
DefaultStager also satisfies DCP's ``AsyncStager`` protocol, so it can be passed as
``async_stager=`` to ``torch.distributed.checkpoint.async_save``.

Differences from the seed, on purpose: flags left as None take what the machine
supports (so ``DefaultStager()`` works on a CPU-only machine), while asking explicitly
for a CUDA-only feature there raises UnsupportedError at construction; using a closed
stager raises ClosedError; ``close()`` is idempotent and never raises a stage's error
(nor CancelledError); ``synchronize_staging()`` skips stages whose Future was
cancelled (they staged nothing) instead of raising CancelledError; a stager cannot be
used in a process forked from the one that staged with it (ClosedError, at once).
"""

from __future__ import annotations

import abc
import concurrent.futures
import functools
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from ._engine import Cancelled, Engine, Staged
from ._errors import ClosedError, UnsupportedError
from ._options import resolve_options
from ._worker import Worker, WorkerForked, WorkerStopped

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

    A staged result is never overwritten while it is reachable (the dict, the Future
    holding it, a tensor or view taken from it): a later ``stage()`` then writes into
    another buffer set, or waits for one to be dropped. Host buffers are reused as in
    the seed once a result is dropped. Accepts PyTorch's ``StagingOptions`` as well as
    our config.
    """

    # DCP's AsyncStager protocol: async_save calls synchronize_staging() right after
    # starting the upload when this is True.
    _synchronize_after_execute: bool = True

    def __init__(self, config: Any = None, **engine_options: Any) -> None:
        if config is None:
            config = CheckpointStagerConfig()
        self._config = config
        use_async = getattr(config, "use_async_staging", True)
        if not isinstance(use_async, bool):
            raise UnsupportedError(
                f"use_async_staging must be True or False, got {use_async!r} "
                f"of type {type(use_async).__name__}"
            )
        backend = engine_options.pop("backend", None)
        pinner = engine_options.pop("pinner", None)
        # Passed through as given: resolve_options checks their types.
        options = resolve_options(
            pin_memory=getattr(config, "use_pinned_memory", None),
            share_memory=getattr(config, "use_shared_memory", True),
            non_blocking=getattr(config, "use_non_blocking_copy", None),
            seam=backend is not None or pinner is not None,
            pinner_given=pinner is not None,
            **engine_options,
        )
        self._async = use_async
        self._engine = Engine(options, backend=backend, pinner=pinner)
        self._worker = Worker("async-stager-dcp", nice=options.worker_nice)
        #: Stages submitted and not yet seen done, in submission order.
        self._futures: list[Future[STATE_DICT]] = []
        #: The error of the latest finished (not cancelled) stage, None if it succeeded.
        self._last_error: BaseException | None = None
        self._closed = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    def stage(self, state_dict: STATE_DICT, **kwargs: Any) -> STATE_DICT | Future[STATE_DICT]:
        """Stage ``state_dict``: the staged copy, or (async config) a Future of it.

        The snapshot point is this call. With a Future, do not modify the sources until
        it is done (or ``synchronize_staging()`` returned). Cancelling the Future before
        its stage started skips that stage. Raises ClosedError once closed, and in a
        process forked from the one that staged with this stager.
        """
        if self._closed:
            raise ClosedError("the DefaultStager is closed")
        if self._worker.forked:
            raise ClosedError(str(self._worker.forked_error()))
        # First: a finished stage's result held here would keep its buffer set busy.
        self._collect()
        captures = self._engine.capture()
        cancel = threading.Event()
        try:
            fut: Future[STATE_DICT] = self._worker.submit(
                functools.partial(self._stage_blocking, state_dict, captures, cancel), cancel=cancel
            )
        except WorkerForked as e:
            raise ClosedError(str(e)) from None
        except WorkerStopped:
            raise ClosedError("the DefaultStager is closed") from None
        if self._async:
            self._futures.append(fut)
            return fut
        # Synchronous: the error (if any) is raised here, and synchronize_staging()
        # has nothing to wait for (as PyTorch's).
        return fut.result()

    def _stage_blocking(
        self, state_dict: STATE_DICT, captures: dict[Any, Any], cancel: threading.Event
    ) -> STATE_DICT:
        try:
            staged: Staged = self._engine.run(state_dict, captures, cancel=cancel)
        except Cancelled:
            # Only the interpreter's exit cancels a running stage (see _worker).
            raise ClosedError("the stage was stopped: the interpreter is exiting") from None
        # The worker waits for the copies (blocking this thread only).
        for c in staged.completions:
            c.synchronize()
        self._engine.settle(staged)
        result: STATE_DICT = staged.result
        # The result goes to the Future only: a Staged record that kept it reachable
        # would hold its buffer set.
        staged.result = None
        return result

    def _collect(self) -> None:
        """Forget finished stages; the latest finished one that was not cancelled
        decides ``_last_error``. Stages run in submission order, so every finished
        stage that was not cancelled precedes every unfinished one."""
        keep: list[Future[STATE_DICT]] = []
        for f in self._futures:
            if not f.done():
                keep.append(f)
            elif not f.cancelled():
                self._last_error = f.exception()
        self._futures = keep

    def synchronize_staging(self) -> None:
        """Block until every stage submitted so far has finished; then, as PyTorch's,
        raise the error of the latest stage if it failed (synchronous staging: nothing
        to do, ``stage()`` raised it).

        A stage whose Future was cancelled (before it started) staged nothing: it is
        skipped, so this waits for the stages before it and reports the latest of those
        (never CancelledError). In a process forked from the one that staged, the
        parent's stages cannot finish here: ClosedError.
        """
        if self._worker.forked:
            raise ClosedError(str(self._worker.forked_error()))
        concurrent.futures.wait(list(self._futures))
        self._collect()
        if self._last_error is not None:
            raise self._last_error

    @property
    def host_bytes(self) -> int:
        """Host memory (bytes) held in arenas."""
        return self._engine.host_bytes

    def close(self) -> None:
        """Wait for the stages submitted (their errors are left to their Futures, and
        cancelled ones are skipped), then release the worker, the copy threads and
        every arena. Idempotent; releases everything even if a stage failed or was
        cancelled, or the wait was interrupted. In a forked child, the parent's stages
        are not waited for (they cannot finish there)."""
        if self._closed:
            return
        self._closed = True
        self._futures = []
        self._last_error = None
        try:
            # Runs the stages queued before (skipping cancelled ones), then ends the
            # thread; in a forked child there is none, and nothing to wait for.
            self._worker.stop()
        finally:
            self._engine.close()

    def __enter__(self) -> DefaultStager:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
