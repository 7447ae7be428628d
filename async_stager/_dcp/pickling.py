"""The budgeted save's pickling guard: ``torch.save`` of a bytes item into the ring.

A DCP *bytes item* (a value that is not a tensor: an int, a list, a dataclass, the
tensors inside it) is serialized exactly as DCP would (``torch.save`` of the value),
but into a sink (``RingSink``) whose writes go to the budget's ring instead of a
``BytesIO``; and with a pickle module (``checked_pickle_module``) that refuses, before
``torch.save`` goes on, what ``torch.save`` would hold whole in host memory beyond the
budget: the item's pickle itself, and a host copy of a device storage inside the value.
Neither can be cut into pieces, so each is BudgetTooSmallError naming the value.

Used by ``budget.Pipeline`` in its copier thread.
"""

from __future__ import annotations

import pickle
import types
from collections.abc import Callable
from typing import Any

import torch

from async_stager.errors import BudgetTooSmallError

__all__ = ["RingSink", "Stopped", "checked_pickle_module"]


class Stopped(Exception):
    """The copier's sink was told to stop (the save is aborted): unwinds ``torch.save``."""


def _storage_of(obj: Any) -> Any:
    return obj._untyped_storage if isinstance(obj, torch.storage.TypedStorage) else obj


def checked_pickle_module(budget: int, where: Callable[[], tuple[Any, ...]]) -> types.ModuleType:
    """A pickle module for ``torch.save`` (which only uses its ``Pickler``) whose output
    is the same as ``pickle``'s, and which refuses, before ``torch.save`` goes on, what
    it would hold whole in host memory beyond ``budget`` bytes: the pickle itself
    (checked once dumped), a device storage (``torch.save`` subclasses the Pickler to
    add ``persistent_id``; ``__init_subclass__`` wraps it to check each storage).
    ``where()``: the path of the value being serialized (for the error). One module
    per save: building one per value would cost more than pickling a small value."""

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
