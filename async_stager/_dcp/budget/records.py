"""What the budgeted save's pipeline (``pipeline``) and its DCP glue (``streaming``) share:
the bytes-item stand-in and its marker, the pipeline's interface as the writer sees it,
the abort error, and the sizes of write items. Below both, so neither imports the other.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.planner import SavePlan, WriteItem

from async_stager._core.memory.ring import padded
from async_stager.errors import BudgetTooSmallError, StagingError, UnsupportedError

__all__ = ["Marker", "PipelineSide", "SaveAborted", "Streamed", "item_nbytes", "too_small"]


class SaveAborted(StagingError):
    """Raised inside DCP's writer when a budgeted save is cancelled: DCP then fails the
    save (on every rank) before writing the checkpoint's metadata."""


class Marker(bytearray):
    """The (empty) buffer a ``Streamed`` stand-in hands the writer: the writer's stream
    recognizes it (``memoryview.obj``) and writes the bytes item's pieces instead."""

    def __init__(self, pos: int) -> None:
        super().__init__()
        self.pos = pos


class Streamed(io.BytesIO):
    """What ``resolve_data`` returns for a bytes item: a stand-in whose ``getbuffer()``
    is the marker that the writer's stream turns into the item's streamed pieces. Its
    own content is empty; reading it is refused rather than wrong."""

    def __init__(self, marker: Marker, fqn: str) -> None:
        super().__init__()
        self._marker = marker
        self._fqn = fqn

    def getbuffer(self) -> memoryview:
        return memoryview(self._marker)

    def _refuse(self) -> UnsupportedError:
        return UnsupportedError(
            f"the storage writer read the bytes item {self._fqn!r} instead of writing "
            "data.getbuffer() to its stream; a budgeted save streams it and needs "
            "FileSystemWriter(thread_count=1, per_thread_copy_ahead=0)"
        )

    def getvalue(self) -> bytes:
        raise self._refuse()

    def read(self, size: int | None = -1, /) -> bytes:
        raise self._refuse()


class PipelineSide(Protocol):
    """The pipeline as DCP's planner, writer and file streams (``streaming``) use it."""

    source: Any
    lookup: Any
    #: DCP's flattened name (fqn) -> the value's path in the state dict (the planner's).
    path_of: Any

    def start(self, plan: SavePlan) -> None: ...

    def take(self, item: WriteItem) -> Any: ...

    def pump(self, marker: Marker, out: Any) -> int: ...

    def check_written(self) -> None: ...

    def finish(self) -> None: ...


def item_nbytes(item: WriteItem) -> int:
    """Bytes of a tensor write item's data."""
    assert item.tensor_data is not None
    n = 1
    for s in item.tensor_data.chunk.sizes:
        n *= int(s)
    return n * torch.empty((), dtype=item.tensor_data.properties.dtype).element_size()


def too_small(
    items: Sequence[WriteItem], budget: int, path_of: Callable[[str], tuple[Any, ...]]
) -> BudgetTooSmallError:
    """The error for a budget smaller than the biggest tensor item, naming its path in
    the state dict (``path_of``: DCP's flattened name -> the path) and the option."""
    item = max(items, key=item_nbytes)
    need = padded(item_nbytes(item))
    return BudgetTooSmallError(
        f"this tensor (write item {item.index.fqn!r}) takes {need} bytes of host memory, more "
        f"than host_budget_bytes={budget}; pass host_budget_bytes >= {need}",
        path=path_of(item.index.fqn),
        needed_bytes=need,
    )
