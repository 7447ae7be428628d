"""The budgeted save's pickling guard: ``torch.save`` of a bytes item into the ring.

A DCP *bytes item* (a value that is not a tensor: an int, a list, a dataclass, the
tensors inside it) is serialized exactly as DCP would (``torch.save`` of the value),
but into a sink (``RingSink``) whose writes go to the budget's ring instead of a
``BytesIO``; and with a pickle module (``checked_pickle_module``) that refuses, before
``torch.save`` goes on, what ``torch.save`` would hold whole in host memory beyond the
budget: the item's pickle itself, and a host copy of a device storage inside the value.
Neither can be cut into pieces, so each is BudgetTooSmallError naming the value.

Used by ``pipeline.Pipeline`` in its copier thread.
"""

from __future__ import annotations

import pickle
import types
from collections.abc import Callable
from typing import IO, Any, cast

import numpy as np
import torch

from async_stager.errors import BudgetTooSmallError

__all__ = ["ObjectStream", "RingSink", "Segment", "Stopped", "checked_pickle_module"]


class Stopped(Exception):
    """The copier's sink was told to stop (the save is aborted): unwinds ``torch.save``."""


def _storage_of(obj: Any) -> Any:
    return obj._untyped_storage if isinstance(obj, torch.storage.TypedStorage) else obj


def checked_pickle_module(
    budget: int,
    where: Callable[[], tuple[Any, ...]],
    generators: dict[int, tuple[Any, Any]] | None = None,
) -> types.ModuleType:
    """A pickle module for ``torch.save`` (which only uses its ``Pickler``) whose output
    is the same as ``pickle``'s, and which refuses, before ``torch.save`` goes on, what
    it would hold whole in host memory beyond ``budget`` bytes: the pickle itself
    (checked once dumped), a device storage (``torch.save`` subclasses the Pickler to
    add ``persistent_id``; ``__init_subclass__`` wraps it to check each storage).
    ``where()``: the path of the value being serialized (for the error). One module
    per save: building one per value would cost more than pickling a small value.
    ``generators``: per ``id``, (the generator, its reduction taken at the call),
    pickled instead of its state now."""

    def too_big(what: str, n: int) -> BudgetTooSmallError:
        return BudgetTooSmallError(
            f"{what} {n} bytes, which torch.save holds in host memory in one piece, more "
            f"than host_budget_bytes={budget}; store the data as a tensor of the state dict "
            "(DCP writes tensors in pieces of the budget) or pass "
            f"host_budget_bytes >= {n}",
            path=where(),
            needed_bytes=n,
        )

    class Pickler(pickle.Pickler):
        def __init__(self, file: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(file, *args, **kwargs)
            self._sink = file

        def __init_subclass__(cls, **kwargs: Any) -> None:
            super().__init_subclass__(**kwargs)
            inner = cls.__dict__.get("persistent_id")
            if inner is None:
                return

            def persistent_id(self: Any, obj: Any) -> Any:
                pid = inner(self, obj)
                if pid is not None and (isinstance(obj, torch.storage.TypedStorage) or torch.is_storage(obj)):
                    storage = _storage_of(obj)
                    if storage.device.type not in ("cpu", "meta") and storage.nbytes() > budget:
                        raise too_big(
                            f"this non-tensor value holds a {storage.device.type} tensor whose storage takes",
                            storage.nbytes(),
                        )
                return pid

            cls.persistent_id = persistent_id  # type: ignore[method-assign]

        if generators:

            def reducer_override(self: Any, obj: Any) -> Any:
                if isinstance(obj, torch.Generator):
                    taken = generators.get(id(obj))
                    if taken is not None and taken[0] is obj:
                        return taken[1]
                return NotImplemented

        def dump(self, obj: Any) -> None:
            super().dump(obj)
            n = self._sink.tell()
            if n > budget:
                raise too_big("this non-tensor value pickles to", n)

    mod = types.ModuleType("async_stager._budget_pickle")
    mod.Pickler = Pickler  # type: ignore[attr-defined]
    return mod


class RingSink:
    """The file ``torch.save`` writes one bytes item into (copier thread); the bytes go
    to ``write_large`` (the pipeline's ``_object_write``: into the ring), small ones
    straight into ``batch`` (the fast path: ``torch.save`` makes about twenty writes
    for a small value) while it stays within ``limit`` bytes. ``batch`` is owned by the
    pipeline (gathered across items). ``failure``: the first error raised here or by
    the checks; once set, later writes (``torch.save`` still writes the zip's directory
    on its way out) are dropped."""

    def __init__(self, write_large: Callable[[memoryview], None], batch: bytearray, limit: int) -> None:
        self._write_large = write_large
        self._batch = batch
        self._limit = limit
        self.failure: BaseException | None = None

    def write(self, data: Any) -> int:
        n = data.nbytes if type(data) is memoryview else len(data)
        if self.failure is None and len(self._batch) + n <= self._limit and n:
            self._batch += data
            return n
        if self.failure is not None or n == 0:
            return n
        try:
            self._write_large(memoryview(data).cast("B"))
        except BaseException as e:
            self.failure = e
            raise
        return n

    def flush(self) -> None:
        pass


#: What the writer is handed for bytes items, in ring order: (item position, bytes to
#: write or None, the item ends here, the piece is released after this segment).
Segment = tuple[int, "np.ndarray[Any, Any] | None", bool, bool]


class ObjectStream:
    """Bytes items into the ring (the pipeline's copier thread): ``torch.save`` of each
    value, as DCP's planner does, into a ``RingSink``. Small writes are gathered across
    items into one piece of at most ``small`` bytes (a small value costs one handover
    per batch, not one per value), larger ones cut into pieces of at most ``chunk``
    bytes, each copied into the ring and handed to the writer at once.

    ``piece(n)``: a uint8 numpy view of ``n`` new ring bytes (raises Stopped when the
    save was aborted); ``hand(segments)``: give segments to the writer; ``where(at)``:
    the path of bytes item ``at`` (errors). ``generators``: per ``id``, the pickle
    reduction of a ``torch.Generator`` taken at the call (its state then: training
    advances it right after), used instead of the generator's state when pickled."""

    def __init__(
        self,
        budget: int,
        *,
        chunk: int,
        small: int,
        piece: Callable[[int], np.ndarray[Any, Any]],
        hand: Callable[[list[Segment]], None],
        where: Callable[[int], tuple[Any, ...]],
        generators: dict[int, tuple[Any, Any]] | None = None,
    ) -> None:
        self._chunk = chunk
        self._small = min(small, chunk)
        self._piece = piece
        self._hand = hand
        self._where = where
        self._pickle = checked_pickle_module(budget, self._open_path, generators)
        self._batch = bytearray()
        self._batch_segments: list[tuple[int, int, int, bool]] = []  # (pos, start, end, last)
        self._open = 0  # the bytes item being serialized
        self._open_from = 0  # where its bytes not yet in a segment start in _batch

    def _open_path(self) -> tuple[Any, ...]:
        return self._where(self._open)

    def serialize(self, at: int, value: Any) -> None:
        """``torch.save`` of bytes item ``at``'s ``value`` into the ring."""
        self._open = at
        self._open_from = len(self._batch)
        sink = RingSink(self._write, self._batch, self._small)
        try:
            torch.save(value, cast("IO[bytes]", sink), pickle_module=self._pickle)
        except BaseException as e:
            failure = sink.failure
            if failure is not None and failure is not e:
                # torch.save raised again on its way out (the zip's end): the first
                # error is the one that says what happened.
                raise failure from None
            raise
        self._batch_segments.append((at, self._open_from, len(self._batch), True))
        self._open_from = len(self._batch)

    def _write(self, view: memoryview) -> None:
        n = view.nbytes
        if len(self._batch) + n > self._small:
            self.flush()
        if n <= self._small:
            self._batch += view
            return
        for a in range(0, n, self._chunk):
            part = view[a : a + self._chunk]
            piece = self._piece(part.nbytes)
            np.copyto(piece, np.frombuffer(part, dtype=np.uint8))
            self._hand([(self._open, piece, False, True)])

    def flush(self) -> None:
        """The batch into one piece of the ring, handed to the writer as its items'
        segments (the piece is released after the last one)."""
        if len(self._batch) > self._open_from:
            self._batch_segments.append((self._open, self._open_from, len(self._batch), False))
        if not self._batch_segments:
            return
        piece = self._piece(len(self._batch)) if self._batch else None
        if piece is not None:
            with memoryview(self._batch) as mv:
                np.copyto(piece, np.frombuffer(mv, dtype=np.uint8))
        segments: list[Segment] = [
            (pos, piece[a:b] if piece is not None else None, last, False)
            for pos, a, b, last in self._batch_segments
        ]
        if piece is not None:
            pos, data, last, _ = segments[-1]
            segments[-1] = (pos, data, last, True)
        self._batch.clear()
        self._batch_segments.clear()
        self._open_from = 0
        self._hand(segments)
