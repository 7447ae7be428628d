"""``dcp.save(..., host_budget_bytes=N)``: the call, the coroutine and cancellation.

The pipeline itself is ``budget`` (ring, copier thread), ``copies`` (its copies
through the device seam), ``pickling`` (bytes items into the ring) and ``streaming``
(DCP's planner, writer and file system). The device seam is the stager's, through its
internal interface ``Stager.lanes`` (``_core.run.lanes``): its ``Backend`` (a
``SimulatedBackend`` or ``FakeBackend`` in CPU tests) answers the device questions at
the call, a lane's copiers (their streams kept from one save to the next) copy, the
lane's ring (kept too, unless a node budget reserved it) holds the pieces, pinned with
the stager's pinner; ``Stager.add_fence_hook`` makes the stager's ``fence()`` wait for
the save.

What the budget bounds: the ring, ``N`` bytes of host memory at most, through which
every byte DCP writes passes in pieces: tensor items (a tensor, a DTensor's local
shard: each must fit the ring whole), and the serialized non-tensor values (DCP's
bytes items: ints, lists, tuples, dataclasses, user objects), CPU tensors inside them
included, which are cut into pieces of any size. What ``torch.save`` builds whole for
one value at a time (its pickle, without the CPU tensors' data; a host copy of a
device tensor's storage inside it) is not in pieces, so each must be at most ``N``:
BudgetTooSmallError otherwise, naming the value (or the device tensor inside it) and
the budget it needs. The call checks what it can see without pickling (``survey``:
tensor items, bytes-likes, strings, numpy arrays, numbers, device tensors, inside
plain containers and objects); the rest is checked as each value is serialized, and
the save then fails with that error before any metadata is written.
"""

from __future__ import annotations

import copyreg
import functools
import os
import time
import weakref
from collections.abc import Callable, Coroutine, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import torch

from async_stager._core.aio.threads import start_thread
from async_stager._core.aio.waiting import wait_future, wait_future_uninterrupted
from async_stager._core.copy.device import caller_cuda_device, graph_capture_error
from async_stager._core.memory.arena import Pinner
from async_stager._core.memory.ring import ALIGN, padded
from async_stager._core.walk.objects import stateful_object_error
from async_stager._dcp.budget import BudgetStats, Pipeline
from async_stager._dcp.streaming import PipelinePlanner, PipelineWriter
from async_stager.errors import (
    Attr,
    BudgetTooSmallError,
    ClosedError,
    InvalidOptionError,
    Nth,
    StagingError,
    UnsupportedError,
)

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

    from async_stager._core.aio.stager import Stager
    from async_stager._core.memory.ledger import NodeLedger

__all__ = ["BudgetedJob", "abandon", "budgeted_save", "budgeted_save_job", "largest_tensor", "survey"]


#: Nodes the call's look inside non-tensor values may visit, per save (the event loop
#: waits for it): what it does not reach is checked when the value is serialized.
_SURVEY_NODES = 20_000
#: About what ``torch.save`` writes for a value besides its data (zip records).
_ITEM_OVERHEAD = 1536


def _dcp_terminal(value: Any) -> bool:
    """DCP's ``traverse_state_dict`` rule: a mapping is walked into; a list only when
    it holds a tensor or a container that is walked into; anything else (a tuple too)
    is one value, written as a tensor item or pickled as one bytes item."""
    if isinstance(value, Mapping):
        return False
    if not isinstance(value, list):
        return True
    for entry in value:
        if isinstance(entry, (Mapping, list)) and not _dcp_terminal(entry):
            return False
        if isinstance(entry, torch.Tensor):
            return False
    return True


def _dcp_values(state_dict: Any) -> Iterator[tuple[tuple[Any, ...], str, Any]]:
    """``(path, fqn, value)`` for each value DCP's default planner (flattening) makes
    write items of: ``path`` with the state dict's own keys, ``fqn`` DCP's flattened
    name. A top-level Stateful is left out: DCP calls its ``state_dict()`` later."""
    from torch.distributed.checkpoint.stateful import Stateful

    def walk(
        path: tuple[Any, ...], names: tuple[Any, ...], value: Any
    ) -> Iterator[tuple[tuple[Any, ...], str, Any]]:
        if isinstance(value, Mapping):
            for k, v in value.items():
                yield from walk((*path, k), (*names, str(k)), v)
        elif _dcp_terminal(value):
            yield path, ".".join(map(str, names)), value
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                yield from walk((*path, i), (*names, i), v)

    if not isinstance(state_dict, Mapping):
        return
    for key, value in state_dict.items():
        if isinstance(value, Stateful) and not isinstance(value, torch.Tensor):
            continue
        yield from walk((key,), (str(key),), value)


def _local_nbytes(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def largest_tensor(state_dict: Any) -> tuple[tuple[Any, ...], int]:
    """The path and ring bytes (padded) of the biggest tensor DCP writes as a tensor
    item (a DTensor counts its local shard: what this rank writes). Tensors inside
    non-tensor values are not tensor items: they are streamed in pieces."""
    best: tuple[tuple[Any, ...], int] = ((), 0)
    for path, _, value in _dcp_values(state_dict):
        if isinstance(value, torch.Tensor):
            n = padded(_local_nbytes(value))
            if n > best[1]:
                best = (path, n)
    return best


_PLAIN_PICKLING = frozenset({"builtins", "collections"})


def _plainly_pickled(tp: type) -> bool:
    """Whether pickle saves an instance of ``tp`` by its contents (``__dict__``,
    ``__slots__``, items): its reduce and getstate are those of a builtin or of
    ``collections``, not the class's own (which may drop or add anything), and no
    ``copyreg`` reducer is registered for it."""
    if tp in copyreg.dispatch_table:
        return False
    for name in ("__reduce_ex__", "__reduce__", "__getstate__"):
        owner = next((c for c in tp.__mro__ if name in c.__dict__), object)
        if owner.__module__ not in _PLAIN_PICKLING:
            return False
    return True


class _Survey:
    """What ``dcp.save`` can see at the call of the values DCP pickles (its bytes
    items), without pickling them: a lower bound of each one's pickle (bytes-likes,
    strings, numpy arrays, numbers, walked into plain containers and objects), the
    device tensors inside them (which ``torch.save`` moves to host memory whole) and
    the CPU tensors' storage bytes (streamed in pieces; they only size the ring).
    At most ``_SURVEY_NODES`` nodes in all: the rest is checked when serialized."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.nodes = _SURVEY_NODES
        self.ring_bytes = 0  # estimated bytes streamed through the ring, all values
        self.refusal: BudgetTooSmallError | None = None
        #: Generators met, by id: (the generator, its pickle reduction now).
        self.generators: dict[int, tuple[Any, Any]] = {}
        #: A value may hold a CPU tensor (one was seen, or the look stopped short):
        #: serializing must first wait on the host for the captures.
        self.host_tensors = False

    def value(self, path: tuple[Any, ...], value: Any) -> None:
        seen: set[int] = set()
        storages: set[int] = set()
        pickled = 0
        stack: list[tuple[tuple[Any, ...], Any]] = [(path, value)]
        while stack and self.nodes > 0:
            where, v = stack.pop()
            self.nodes -= 1
            if isinstance(v, torch.Tensor):
                try:
                    storage = v.untyped_storage()
                except Exception:  # noqa: BLE001 - a wrapper subclass without storage
                    continue
                key = storage.data_ptr() or id(storage)
                if key in storages or v.device.type == "meta":
                    continue
                self.host_tensors = self.host_tensors or v.device.type == "cpu"
                storages.add(key)
                n = storage.nbytes()
                if v.device.type != "cpu" and n > self.budget and self.refusal is None:
                    self.refusal = BudgetTooSmallError(
                        f"this {v.device.type} tensor sits inside a value DCP pickles whole, and "
                        f"torch.save moves its storage of {n} bytes to host memory in one piece, "
                        f"more than host_budget_bytes={self.budget}; make it a tensor of the state "
                        "dict (a dict or list entry: DCP writes those in pieces of the budget), "
                        f"or pass host_budget_bytes >= {n}",
                        path=where,
                        needed_bytes=n,
                    )
                self.ring_bytes += n
                continue
            refused = stateful_object_error(v)
            if refused is not None:
                # As a stage refuses it: no loader takes a pickled module or optimizer.
                refused.path = where
                raise refused
            if isinstance(v, torch.Generator):
                # Its state as of the call: training advances it right after (a
                # dropout), and torch.save would read it when serialized.
                if id(v) not in self.generators:
                    self.generators[id(v)] = (v, v.__reduce__())
                continue
            if isinstance(v, float):
                pickled += 9
                continue
            if isinstance(v, (bool, int)) or v is None:
                pickled += 1
                continue
            if id(v) in seen:  # pickle's memo: written once
                continue
            seen.add(id(v))
            if isinstance(v, (bytes, bytearray, str)):
                pickled += len(v)
            elif isinstance(v, np.ndarray):
                pickled += int(v.nbytes) if v.dtype != object else 0
            elif not _plainly_pickled(type(v)):
                continue
            elif isinstance(v, Mapping):
                for k, x in v.items():
                    if isinstance(k, (str, bytes)) and id(k) not in seen:
                        seen.add(id(k))
                        pickled += len(k)
                    stack.append(((*where, k), x))
            elif isinstance(v, (list, tuple)):
                stack.extend(((*where, i), x) for i, x in enumerate(v))
            elif isinstance(v, (set, frozenset)):
                stack.extend(((*where, Nth(i)), x) for i, x in enumerate(v))
            else:
                self._attributes(where, v, stack)
        if stack:
            self.host_tensors = True  # not looked at: may hold one
        self.ring_bytes += pickled + _ITEM_OVERHEAD
        if pickled > self.budget and self.refusal is None:
            self.refusal = BudgetTooSmallError(
                f"this value is not a tensor: DCP pickles it, and its pickle (at least {pickled} "
                f"bytes) is held in host memory in one piece, more than host_budget_bytes="
                f"{self.budget}; store its data as a tensor (torch.from_numpy, torch.frombuffer: "
                f"DCP writes tensors in pieces of the budget), or pass host_budget_bytes >= {pickled}",
                path=path,
                needed_bytes=pickled,
            )

    @staticmethod
    def _attributes(where: tuple[Any, ...], v: Any, stack: list[tuple[tuple[Any, ...], Any]]) -> None:
        # object.__getattribute__: never a class's __getattr__ (no user code runs here).
        try:
            attrs = object.__getattribute__(v, "__dict__")
        except AttributeError:
            attrs = None
        if isinstance(attrs, dict):
            stack.extend(((*where, Attr(k)), x) for k, x in attrs.items() if isinstance(k, str))
        for cls in type(v).__mro__:
            slots = cls.__dict__.get("__slots__", ())
            for name in (slots,) if isinstance(slots, str) else slots:
                if name in ("__dict__", "__weakref__"):
                    continue
                try:
                    stack.append(((*where, Attr(name)), object.__getattribute__(v, name)))
                except AttributeError:
                    continue


def survey(
    state_dict: Any, budget: int
) -> tuple[int, dict[str, tuple[Any, ...]], dict[int, tuple[Any, Any]], bool]:
    """Check ``state_dict`` against ``budget`` at the call, before anything is staged:
    BudgetTooSmallError naming the first tensor item bigger than the budget, else the
    first non-tensor value (or device tensor inside one) that ``torch.save`` would hold
    whole beyond it. Returns the estimated ring bytes of the non-tensor values (to size
    the ring), each one's path by DCP name (for errors found when serialized), the
    ``torch.Generator``s inside them with their state taken now (by id), and whether
    they may hold a CPU tensor (their serialization then waits for the captures)."""
    path, need = largest_tensor(state_dict)
    if need > budget:
        raise BudgetTooSmallError(
            f"this tensor takes {need} bytes of host memory, more than host_budget_bytes={budget}; "
            f"pass host_budget_bytes >= {need}",
            path=path,
            needed_bytes=need,
        )
    look = _Survey(budget)
    paths: dict[str, tuple[Any, ...]] = {}
    for where, fqn, value in _dcp_values(state_dict):
        if isinstance(value, torch.Tensor) or hasattr(value, "__create_write_items__"):
            continue
        paths[fqn] = where
        look.value(where, value)
    if look.refusal is not None:
        raise look.refusal
    if look.nodes <= 0:
        look.host_tensors = True  # values not looked at may hold one
    return look.ring_bytes, paths, look.generators, look.host_tensors


def budgeted_save(
    state_dict: dict[str, Any],
    *,
    stager: Stager,
    budget: int,
    checkpoint_id: str | os.PathLike[str] | None,
    storage_writer: Any,
    planner: Any,
    process_group: Any,
    no_dist: bool,
    on_stats: Callable[[BudgetStats], None] | None,
    digests: dict[str, dict[str, Any]] | None = None,
    ledger: NodeLedger | None = None,
    owns_ledger: bool = False,
) -> Coroutine[Any, Any, Metadata]:
    """Checks and the snapshot point at the call; the save in the coroutine.
    ``digests`` (the Checkpointer's): filled with each written chunk's manifest entry
    (``_integrity``), hashed from its ring piece as it lands, before it is written.
    ``ledger``: a node budget the ring's bytes are reserved from (``Pipeline``): the
    ring is then at most ``min(budget, ledger.budget)`` and at least the largest tensor
    item, a share waited for at most the stager's ``buffer_wait_timeout`` seconds;
    ``owns_ledger``: the save closes it when it ends (also when never awaited, or when
    the call raises).

    Raises at the call: InvalidOptionError, UnsupportedError (also when the caller's
    current stream of a device is capturing a CUDA graph), ClosedError, and
    BudgetTooSmallError (``survey``) for a tensor item or a value seen to need more than
    ``budget`` in one piece. The coroutine raises BudgetTooSmallError itself (not DCP's
    CheckpointException around it) for a value found too big when serialized."""
    try:
        job = _budgeted_save(
            state_dict,
            stager=stager,
            budget=budget,
            checkpoint_id=checkpoint_id,
            storage_writer=storage_writer,
            planner=planner,
            process_group=process_group,
            no_dist=no_dist,
            on_stats=on_stats,
            digests=digests,
            ledger=ledger,
            owns_ledger=owns_ledger,
        )
    except BaseException:
        if owns_ledger and ledger is not None:
            ledger.close()
        raise
    coro = _run(job)
    # Never awaited: nothing was staged; the fence must not wait for it.
    _ABANDON[coro] = weakref.finalize(coro, job.forget)
    return coro


def budgeted_save_job(
    state_dict: dict[str, Any],
    *,
    stager: Stager,
    budget: int,
    checkpoint_id: str | os.PathLike[str],
    process_group: Any,
    no_dist: bool,
    on_stats: Callable[[BudgetStats], None] | None,
    digests: dict[str, dict[str, Any]] | None = None,
    ledger: NodeLedger | None = None,
    captures: Mapping[torch.device, Any] | None = None,
) -> BudgetedJob:
    """``budgeted_save``'s checks and snapshot point at the call, as a ``BudgetedJob``
    whose ``run()`` (blocking, any thread) is the save. ``captures``: a snapshot point
    taken earlier on the caller's streams (``Stager.snapshot_point``, for a save its
    caller's policy deferred) instead of one taken now; its generator states too."""
    return _budgeted_save(
        state_dict,
        stager=stager,
        budget=budget,
        checkpoint_id=checkpoint_id,
        storage_writer=None,
        planner=None,
        process_group=process_group,
        no_dist=no_dist,
        on_stats=on_stats,
        digests=digests,
        ledger=ledger,
        owns_ledger=False,
        captures=captures,
    )


def _budgeted_save(
    state_dict: dict[str, Any],
    *,
    stager: Stager,
    budget: int,
    checkpoint_id: str | os.PathLike[str] | None,
    storage_writer: Any,
    planner: Any,
    process_group: Any,
    no_dist: bool,
    on_stats: Callable[[BudgetStats], None] | None,
    digests: dict[str, dict[str, Any]] | None,
    ledger: NodeLedger | None,
    owns_ledger: bool,
    captures: Mapping[torch.device, Any] | None = None,
) -> BudgetedJob:
    t0 = time.perf_counter()
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < ALIGN:
        raise InvalidOptionError(
            f"host_budget_bytes must be an int of at least {ALIGN} (bytes), not {budget!r}"
        )
    if ledger is not None:
        budget = min(budget, ledger.budget)
        path, need = largest_tensor(state_dict)
        if need > ledger.budget:
            raise BudgetTooSmallError(
                f"this tensor takes {need} bytes of host memory, more than the whole node budget "
                f"(node_budget_bytes={ledger.budget}) that the ranks of this machine share; pass "
                f"node_budget_bytes >= {need} (every rank the same)",
                path=path,
                needed_bytes=need,
            )
    if storage_writer is not None or planner is not None:
        raise UnsupportedError(
            "a budgeted save brings its own planner and FileSystemWriter: pass checkpoint_id "
            "(a folder) and leave storage_writer and planner None"
        )
    if checkpoint_id is None:
        raise InvalidOptionError("a budgeted save needs checkpoint_id (the checkpoint's folder)")
    if stager.closed:
        raise ClosedError("the stager is closed")
    object_hint, object_paths, generators, host_tensors = survey(state_dict, budget)
    # The stager's device seam (``Stager(backend=...)``): what its stages copy with.
    lanes = stager.lanes
    backend = lanes.backend
    devices = list(dict.fromkeys(backend.known_devices()))
    # Checked before anything is made or recorded on a device (as stage() does): an
    # event recorded on a capturing stream belongs to the graph, so the copies could
    # not be ordered with it.
    for d in devices:
        if backend.capturing(d):
            raise graph_capture_error("dcp.save(host_budget_bytes=...)", d)
    # The snapshot point: a capture on the caller's current stream of every device a
    # source may live on, by the copier there of the lane this save takes (made on this
    # thread the first time: its copy stream is not the caller's; kept for the next
    # save). The stager's own copiers belong to its worker.
    lane = lanes.take(devices)
    try:
        if captures is None:
            taken = {d: lane.copiers[d].capture() for d in devices}
        else:
            # Taken at the caller's earlier call (an event on its stream, which any
            # stream may wait on), with the generator states read then.
            taken = {d: captures.get(d) for d in devices}
            generators = {**generators, **getattr(captures, "generators", {})}
        pipeline = Pipeline(
            budget,
            captures=taken,
            t0=t0,
            lanes=lanes,
            lane=lane,
            pinner=_ring_pinner(lanes.pinner, bool(captures)),
            generators=generators,
            host_wait=host_tensors,
            digests=digests,
            object_hint=object_hint,
            object_paths=object_paths,
            ledger=ledger,
            ledger_wait=stager.options.buffer_wait_timeout,
            owns_ledger=owns_ledger,
        )
    except BaseException:
        lanes.give_back(lane, settled=True)
        raise
    remove = stager.add_fence_hook(pipeline.fence)
    save = functools.partial(
        _save_blocking_lazy,
        state_dict,
        no_dist=no_dist,
        cuda_device=caller_cuda_device(),
        storage_writer=PipelineWriter(checkpoint_id, pipeline),
        planner=PipelinePlanner(pipeline),
        process_group=process_group,
    )
    return BudgetedJob(pipeline, remove, save, on_stats)


def _save_blocking_lazy(state_dict: dict[str, Any], **kwargs: Any) -> Any:
    from async_stager._dcp.blocking import _save_blocking

    return _save_blocking(state_dict, **kwargs)


class BudgetedJob:
    """A budgeted save made at the call (its checks, its snapshot point, its fence
    hook), run later by one blocking ``run()`` in any thread: a caller that runs it in
    a thread of its own (the Checkpointer's write) needs no event loop turn for the
    whole save. ``abort()`` stops it from any thread (DCP then fails it before writing
    metadata); ``forget()`` drops one never run (its fence hook goes at once)."""

    def __init__(
        self,
        pipeline: Pipeline,
        remove: Callable[[], None],
        save: Callable[[], Any],
        on_stats: Callable[[BudgetStats], None] | None,
    ) -> None:
        self.pipeline = pipeline
        self._remove = remove
        self._save = save
        self._on_stats = on_stats

    @property
    def started(self) -> bool:
        return self.pipeline.started

    def run(self) -> Metadata:
        """The whole save, blocking: DCP's save through the ring. Raises its failure (a
        BudgetTooSmallError found when serializing is raised as itself)."""
        pipeline = self.pipeline
        pipeline.started = True
        try:
            result: Any = None
            error: BaseException | None = None
            try:
                result = self._save()
            except BaseException as e:  # noqa: BLE001 - raised below, once the ring is freed
                error = e
                own = pipeline.error
                if isinstance(own, StagingError) and own is not e:
                    # DCP wraps what failed in its writer (CheckpointException); a
                    # refusal of ours (a value beyond the budget, found when
                    # serialized) is raised as itself.
                    error = own
            # Before the waiter wakes: the ring is freed and the stats are delivered.
            pipeline.finish()  # also when DCP failed before write_data
            if self._on_stats is not None:
                try:
                    self._on_stats(pipeline.stats(time.perf_counter() - pipeline.t0))
                except Exception as e:  # noqa: BLE001 - a failing callback fails the save
                    error = error or e
            if error is not None:
                raise error
            metadata: Metadata = result
            return metadata
        finally:
            self._remove()

    def abort(self) -> None:
        """Stop the save (any thread): its copies stop, DCP fails it."""
        self.pipeline.abort()

    def forget(self) -> None:
        """Drop it if it never ran (idempotent; nothing once it started)."""
        if not self.pipeline.started:
            self.pipeline.started = True  # it never runs now
            _forget(self.pipeline, self._remove)


def _ring_pinner(pinner: Pinner | None, devices_in_use: bool) -> Pinner | None:
    """The ring pins as the stager's arenas do, with the engine's pinner (None when the
    stager does not pin): one registration, exact size. Not with a pinner that needs a
    device context while no device is in use (``Engine._skips_pinning``'s rule: no
    context is created for memory no device copy reads)."""
    if pinner is None or (getattr(pinner, "needs_context", False) and not devices_in_use):
        return None
    return pinner


#: Per budgeted save not yet awaited: what lets its fence hook and pipeline go.
_ABANDON: weakref.WeakKeyDictionary[Any, weakref.finalize[Any, Any]] = weakref.WeakKeyDictionary()


def abandon(coro: Coroutine[Any, Any, Any]) -> None:
    """Drop a budgeted save that will never be awaited, now: its fence hook is removed
    (a ``fence()`` waiting on it returns) and its pipeline stopped. Waiting for the
    coroutine to be collected is not enough: a traceback that holds a frame holding it
    would keep every later ``fence()`` waiting. No-op for a save already started."""
    fin = _ABANDON.pop(coro, None)
    info = fin.peek() if fin is not None else None
    job = getattr(info[1], "__self__", None) if info is not None else None
    if not isinstance(job, BudgetedJob) or job.started:
        return  # running (or done): it cleans up after itself
    coro.close()
    assert fin is not None
    fin()


def _forget(pipeline: Pipeline, remove: Callable[[], None]) -> None:
    remove()
    pipeline.abort()
    pipeline.finish()


async def _run(job: BudgetedJob) -> Metadata:
    """``dcp.save``'s coroutine: the job in a thread of its own. Cancellation: the
    copies stop, DCP fails the save before any metadata is written, and the thread is
    waited for (shielded: the ring must not be in use after)."""
    pipeline = job.pipeline
    pipeline.started = True  # (before the thread: abandon() leaves it alone now)
    try:
        fut = start_thread(job.run, name="async-stager-dcp-save")
    except BaseException:
        pipeline.started = False
        job.forget()
        raise
    try:
        return await wait_future(fut)
    except BaseException:
        if not fut.done():
            pipeline.abort()
            with anyio.CancelScope(shield=True):
                try:
                    await wait_future_uninterrupted(fut)
                except BaseException:  # noqa: BLE001 - DCP's CheckpointException is one; the cancellation is raised
                    pass
        raise
