"""PyTorch DCP's staging API (``DefaultStager``) on async_stager's engine.

``CheckpointStager`` (abstract), ``CheckpointStagerConfig`` (the four ``use_*`` flags)
and ``DefaultStager`` keep the seed's calls and results: ``stage()`` returns the staged
state dict, or a ``concurrent.futures.Future`` of it when ``use_async_staging``. A
DefaultStager also satisfies DCP's ``AsyncStager`` protocol, so it can be passed as
``async_stager=`` to ``torch.distributed.checkpoint.async_save``.

A drop-in for torch_checkpointing's stager too: its config defaults, its interface
(``get_staged_state_dict`` abstract), its thread and metric-prefix names.

Differences from the seed, on purpose: flags defaulted take what the machine supports
(so ``DefaultStager()`` works on a CPU-only machine); ``use_pinned_memory=True`` where
nothing can pin warns and stages unpinned (as torch_checkpointing's stager), while
``use_non_blocking_copy=True`` there raises AcceleratorRequiredError (an
UnsupportedError and an AssertionError, which theirs asserts) at construction; results kept while staging again each get a buffer
set of their own, up to ``DEFAULT_MAX_BUFFER_SETS`` (a warning names the memory past
two), instead of being overwritten; using a closed
stager raises ClosedError; ``close()`` is idempotent and never raises a stage's error
(nor CancelledError); ``synchronize_staging()`` skips stages whose Future was
cancelled (they staged nothing) instead of raising CancelledError; a stager cannot be
used in a process forked from the one that staged with it (ClosedError, at once).

Additions (all optional): ``stage(sd, keys_not_requiring_copy)`` passes top-level
entries through uncopied (and refuses unknown keywords with TypeError, where the seed
forwarded them); ``get_staged_state_dict()``; ``pinned_num_bytes()``;
``DefaultStager(config, staging_executor=pool)`` stages in a caller-owned thread pool;
``CheckpointStagerConfig.thread_name`` and ``.metric_prefix``; every stage runs in the
caller's contextvars context and is logged (``async_stager.stage`` logger).
docs/migration.md lists every difference.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import copy
import functools
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from types import TracebackType
from typing import Any

from async_stager._core.aio.internals import Internals, register
from async_stager._core.options import StagerOptions
from async_stager._core.run.jobs import log_stage_done
from async_stager._core.run.make import build_engine
from async_stager._core.run.records import Cancelled, StageRecord
from async_stager._core.run.worker import FifoLock, Worker, WorkerForked, WorkerStopped, clear_locals
from async_stager._dcp.interface import (
    DEFAULT_METRIC_PREFIX,
    DEFAULT_THREAD_NAME,
    STATE_DICT,
    CheckpointStager,
    CheckpointStagerConfig,
    check_name,
)
from async_stager.errors import (
    AcceleratorRequiredError,
    ClosedError,
    InvalidOptionError,
    InvalidOptionTypeError,
    UnsupportedError,
)

__all__ = ["DEFAULT_MAX_BUFFER_SETS", "AcceleratorRequiredError", "DefaultStager"]

_log = logging.getLogger("async_stager.stage")

#: DefaultStager's bound on buffer sets (``max_buffer_sets``): torch_checkpointing's
#: callers may keep several staged results while staging again (its stager overwrites
#: them; ours never does), so the drop-in grows to this many sets, each one more host
#: copy of the state dict, before a stage waits for a result to be dropped. A warning
#: names the memory each time a set beyond ``_QUIET_BUFFER_SETS`` is made.
DEFAULT_MAX_BUFFER_SETS = 4
#: Sets a stager holds in the usual cycle (one being written, one staging): no warning.
_QUIET_BUFFER_SETS = 2


def _needs_accelerator(e: UnsupportedError) -> bool:
    # resolve_options raises a plain UnsupportedError (not a subclass: those are the
    # invalid-value errors) naming the flag for exactly these two machine limits.
    msg = str(e)
    return type(e) is UnsupportedError and (
        msg.startswith("pin_memory=True needs CUDA") or msg.startswith("non_blocking=True needs CUDA")
    )


def _passed_keys(state_dict: Any, keys: Any) -> dict[Any, Any]:
    """The top-level entries of ``state_dict`` not to copy (in its order), checked."""
    if isinstance(keys, (str, bytes)):
        raise TypeError(
            f"keys_not_requiring_copy must be a collection of keys, not a {type(keys).__name__} "
            f"(for one key: ({keys!r},))"
        )
    try:
        wanted = set(keys)
    except TypeError as e:
        raise TypeError(f"keys_not_requiring_copy must be a collection of hashable keys: {e}") from None
    if not wanted:
        return {}
    if not isinstance(state_dict, dict):
        raise TypeError(f"keys_not_requiring_copy needs a dict state_dict, got {type(state_dict).__name__}")
    return {k: v for k, v in state_dict.items() if k in wanted}


class DefaultStager(CheckpointStager):
    """The seed's DefaultStager on async_stager's engine.

    A staged result is never overwritten while it is reachable (the dict, the Future
    holding it, a tensor or view taken from it): a later ``stage()`` then writes into
    another buffer set (up to ``max_buffer_sets``, default ``DEFAULT_MAX_BUFFER_SETS``
    = 4, one host copy of the state dict each; a warning past two), or waits for one
    to be dropped. Host buffers are reused as in
    the seed once a result is dropped. Accepts PyTorch's ``StagingOptions`` as well as
    our config.

    Where a stage runs: by default in the stager's own worker thread (named
    ``config.thread_name``, also at OS level). With ``staging_executor=`` (a
    ``concurrent.futures.ThreadPoolExecutor`` the caller owns, which several stagers
    may share), the stage runs in one of the executor's threads instead, and
    ``stage()`` returns the executor's Future. The stages of one stager still run one
    at a time and in submission order (a FIFO lock per stager: the engine is not
    re-entrant), so with N stagers an executor of N threads runs them side by side;
    stages of one stager waiting their turn occupy an executor thread each. The copies
    run where they run best either way (the engine's copy threads and streams).
    ``close()`` waits for this stager's stages and leaves the executor running. Such a
    Future can be cancelled only before the executor started it. An executor with
    synchronous staging (``use_async_staging=False``) is refused (ValueError).

    Each stage runs in the caller's ``contextvars`` context (a copy taken at
    ``stage()``), and logs to the ``async_stager.stage`` logger: an INFO record at its
    start and one at its end with its latency, bytes and cache hits, as metrics named
    ``<metric_prefix>.stage_seconds``, ``.bytes`` and ``.cache_hits`` (in the message,
    and in the record's ``metrics`` attribute); DEBUG records for detail.
    """

    # DCP's AsyncStager protocol: async_save calls synchronize_staging() after starting
    # the upload when this is True, but only when stage() returned the staged dict
    # (synchronous staging). With a Future it returns at once: the caller must wait on
    # the response's staging_completion before changing the sources (docs/migration.md).
    _synchronize_after_execute: bool = True

    def __init__(
        self,
        config: Any = None,
        *,
        staging_executor: concurrent.futures.ThreadPoolExecutor | None = None,
        **engine_options: Any,
    ) -> None:
        if config is None:
            config = CheckpointStagerConfig()
        self._config = config
        use_async = getattr(config, "use_async_staging", True)
        if not isinstance(use_async, bool):
            raise UnsupportedError(
                f"use_async_staging must be True or False, got {use_async!r} "
                f"of type {type(use_async).__name__}"
            )
        if staging_executor is not None:
            if not isinstance(staging_executor, concurrent.futures.ThreadPoolExecutor):
                raise InvalidOptionTypeError(
                    "staging_executor must be a concurrent.futures.ThreadPoolExecutor, got "
                    f"{type(staging_executor).__name__}"
                )
            if not use_async:
                raise InvalidOptionError(
                    "staging_executor needs use_async_staging=True: synchronous staging "
                    "runs in the caller's thread"
                )
        thread_name = check_name("thread_name", getattr(config, "thread_name", DEFAULT_THREAD_NAME))
        self._metric_prefix = check_name(
            "metric_prefix", getattr(config, "metric_prefix", DEFAULT_METRIC_PREFIX)
        )
        backend = engine_options.pop("backend", None)
        pinner = engine_options.pop("pinner", None)
        engine_options.setdefault("max_buffer_sets", DEFAULT_MAX_BUFFER_SETS)
        # Flags our config filled in from the machine: the device backend decides them
        # (the same answer with the real one), as when they were None.
        machine: frozenset[str] = getattr(config, "machine_defaults", frozenset())
        pin = None if "use_pinned_memory" in machine else getattr(config, "use_pinned_memory", None)
        non_blocking = (
            None if "use_non_blocking_copy" in machine else getattr(config, "use_non_blocking_copy", None)
        )
        # Passed through as given: resolve_options checks their types.
        build = functools.partial(
            build_engine,
            backend=backend,
            pinner=pinner,
            share_memory=getattr(config, "use_shared_memory", True),
            non_blocking=non_blocking,
            **engine_options,
        )
        try:
            try:
                self._engine = build(pin_memory=pin)
            except UnsupportedError as e:
                if not (pin is True and _needs_accelerator(e) and str(e).startswith("pin_memory=")):
                    raise
                # As torch_checkpointing's stager (the one this replaces): pinned memory
                # asked for where nothing can pin is a warning, and staging goes on into
                # unpinned memory (torchtitan asks for it on CPU-only runs too).
                warnings.warn(
                    "Ignoring use_pinned_memory=True for checkpoint staging: pinning host memory "
                    "needs CUDA, which is not available here; staging into unpinned memory",
                    UserWarning,
                    stacklevel=2,
                )
                self._engine = build(pin_memory=False)
        except UnsupportedError as e:
            if _needs_accelerator(e):
                raise AcceleratorRequiredError(str(e)) from None
            raise
        # ``export_shared`` and the command line find the shared arenas through it.
        register(self, Internals(self._engine))
        #: The most buffer sets seen so far (a warning each time it passes the quiet two).
        self._sets_seen = 0
        options = self._engine.options
        self._async = use_async
        # Starts no thread before the first stage (never, with an executor).
        self._worker = Worker(thread_name, nice=options.worker_nice)
        self._executor = staging_executor
        self._turns = FifoLock()
        #: The process that first submitted to the executor (0: none yet).
        self._pid = 0
        #: Stages submitted and not yet seen done, in submission order.
        self._futures: list[Future[STATE_DICT]] = []
        #: The error of the latest finished (not cancelled) stage, None if it succeeded.
        self._last_error: BaseException | None = None
        #: The latest stage's result (see get_staged_state_dict) and its number.
        self._latest: STATE_DICT | None = None
        self._seq = 0
        self._latest_lock = threading.Lock()
        self._closed = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    def _forked_error(self) -> ClosedError | None:
        if self._worker.forked:
            return ClosedError(str(self._worker.forked_error()))
        if self._pid and self._pid != os.getpid():
            return ClosedError(
                f"this stager staged in process {self._pid}, and this is process "
                f"{os.getpid()}, forked from it: a stager cannot stage across os.fork(); "
                "create a new stager in the child"
            )
        return None

    def stage(
        self, state_dict: STATE_DICT, keys_not_requiring_copy: Iterable[Any] = ()
    ) -> STATE_DICT | Future[STATE_DICT]:
        """Stage ``state_dict``: the staged copy, or (async config) a Future of it.

        ``keys_not_requiring_copy``: top-level keys whose values are not copied: the
        staged dict holds those very objects (``staged[k] is state_dict[k]``); keys
        absent from ``state_dict`` are ignored. Any other keyword is a TypeError.

        The snapshot point is this call. With a Future, do not modify the sources until
        it is done (or ``synchronize_staging()`` returned). Cancelling the Future before
        its stage started skips that stage. Raises ClosedError once closed, and in a
        process forked from the one that staged with this stager.
        """
        if self._closed:
            raise ClosedError("the DefaultStager is closed")
        forked = self._forked_error()
        if forked is not None:
            raise forked
        passed = _passed_keys(state_dict, keys_not_requiring_copy)
        source: Any = state_dict
        if passed:
            # Staged without those values (None in their place), put back after.
            source = copy.copy(state_dict)
            for k in passed:
                source[k] = None
        # First: a finished stage's result held here would keep its buffer set busy.
        self._collect()
        t0 = time.perf_counter()
        captures = self._engine.capture(source)
        with self._latest_lock:
            # The stager lets go of the previous result now: held by nobody else, its
            # buffer set is free for this stage.
            self._seq += 1
            seq = self._seq
            self._latest = None
        cancel = threading.Event()
        job = functools.partial(
            contextvars.copy_context().run, self._stage_blocking, seq, source, passed, captures, cancel, t0
        )
        fut: Future[STATE_DICT]
        if self._executor is not None:
            fut = self._submit_to_executor(self._executor, job)
        else:
            try:
                fut = self._worker.submit(job, cancel=cancel)
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

    def _submit_to_executor(
        self, executor: concurrent.futures.ThreadPoolExecutor, job: Callable[[], STATE_DICT]
    ) -> Future[STATE_DICT]:
        ticket = self._turns.ticket()
        try:
            fut = executor.submit(self._in_turn, ticket, [job])
        except RuntimeError as e:
            self._turns.release(ticket)
            raise ClosedError(f"the staging executor refused the stage: {e}") from e
        if not self._pid:
            self._pid = os.getpid()
        # A Future cancelled before the executor ran it gives its turn up.
        fut.add_done_callback(functools.partial(_release_if_cancelled, self._turns, ticket))
        return fut

    def _in_turn(self, ticket: int, box: list[Callable[[], STATE_DICT]]) -> STATE_DICT:
        self._turns.acquire(ticket)
        try:
            # Popped, not named: no frame of this call keeps the job (the sources).
            return box.pop()()
        except BaseException as e:
            # As the worker does: the error lives on in the Future; its frames must
            # not keep a half-built result (its buffer set) or the sources alive.
            clear_locals(e)
            raise
        finally:
            self._turns.release(ticket)

    def _stage_blocking(
        self,
        seq: int,
        state_dict: STATE_DICT,
        passed: dict[Any, Any],
        captures: dict[Any, Any],
        cancel: threading.Event,
        t0: float,
    ) -> STATE_DICT:
        _log.info("stage %d started (%.6f s after the call)", seq, time.perf_counter() - t0)
        try:
            staged: StageRecord = self._engine.run(state_dict, captures, cancel=cancel)
            # The stage waits for the copies (blocking this thread only).
            for c in staged.completions:
                c.synchronize()
        except BaseException as e:
            _log.info("stage %d failed after %.6f s: %r", seq, time.perf_counter() - t0, e)
            if isinstance(e, Cancelled):
                # Only the interpreter's exit cancels a running stage (see _worker).
                raise ClosedError("the stage was stopped: the interpreter is exiting") from None
            raise
        self._engine.settle(staged)
        self._warn_if_grown()
        result: STATE_DICT = staged.result
        # The result goes to the Future only: a StageRecord that kept it reachable
        # would hold its buffer set.
        staged.result = None
        for k, v in passed.items():
            result[k] = v
        seconds = time.perf_counter() - t0
        log_stage_done(f"stage {seq}", seconds, staged.nbytes, staged.hits, self._metric_prefix)
        _log.debug(
            "stage %d: %d tensors, %d storages, %d cache misses, fast path %s, buffer set %d, "
            "%d keys passed through, %d host bytes, %.6f s walking",
            seq,
            staged.tensors,
            staged.storages,
            staged.misses,
            staged.fast_path,
            -1 if staged.bufset is None else staged.bufset.index,
            len(passed),
            self._engine.host_bytes,
            staged.worker_seconds,
        )
        with self._latest_lock:
            if seq == self._seq and not self._closed:
                self._latest = result
        return result

    def _warn_if_grown(self) -> None:
        """Log a warning when this stage made a buffer set beyond the usual two: every
        set costs one more host copy of the state dict, for the stager's lifetime."""
        sets = self._engine.buffer_sets
        if sets <= self._sets_seen:
            return
        self._sets_seen = sets
        if sets > _QUIET_BUFFER_SETS:
            _log.warning(
                "DefaultStager now holds %d buffer sets (%d host bytes in all, about %d per "
                "set): earlier staged results are still reachable, and a stage never "
                "overwrites one. Each further set costs one more host copy of the state "
                "dict; at max_buffer_sets=%d a stage waits for a result to be dropped. Drop "
                "staged results once written (del staged) to stay at one or two sets.",
                sets,
                self._engine.host_bytes,
                self._engine.host_bytes // sets,
                self._engine.options.max_buffer_sets,
            )

    def get_staged_state_dict(self) -> STATE_DICT | None:
        """The latest stage's staged dict, once it is done: None before the first
        stage, while a stage is in flight, after a failed (or cancelled) one, and once
        closed.

        The stager lets go of it when the next ``stage()`` is called, but holding it
        (as any staged result) keeps its buffer set in use: the next stage then writes
        into a second buffer set (or waits for one)."""
        return self._latest

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
        forked = self._forked_error()
        if forked is not None:
            raise forked
        concurrent.futures.wait(list(self._futures))
        self._collect()
        if self._last_error is not None:
            raise self._last_error

    @property
    def host_bytes(self) -> int:
        """Host memory (bytes) held in arenas."""
        return self._engine.host_bytes

    def pinned_num_bytes(self) -> int:
        """Pinned host memory (bytes) held in arenas: 0 unless ``use_pinned_memory``."""
        return self._engine.host_bytes if self._engine.options.pin_memory else 0

    @property
    def options(self) -> StagerOptions:
        """The resolved engine options (what the config asked for, machine defaults
        filled in)."""
        return self._engine.options

    def close(self) -> None:
        """Wait for the stages submitted (their errors are left to their Futures, and
        cancelled ones are skipped), then release the worker, the copy threads and
        every arena (a ``staging_executor`` is left running). Idempotent; releases
        everything even if a stage failed or was cancelled, or the wait was
        interrupted. In a forked child, the parent's stages are not waited for (they
        cannot finish there)."""
        if self._closed:
            return
        self._closed = True
        pending, self._futures = self._futures, []
        self._last_error = None
        with self._latest_lock:
            self._latest = None
        try:
            if self._executor is not None and self._forked_error() is None:
                concurrent.futures.wait(pending)
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


def _release_if_cancelled(turns: FifoLock, ticket: int, fut: Future[Any]) -> None:
    if fut.cancelled():
        turns.release(ticket)
