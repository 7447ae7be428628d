"""The budgeted save's DCP glue: the planner, the storage writer and its file system.

``PipelinePlanner`` is DCP's default save planner whose ``resolve_data`` hands out the
pieces ``pipeline.Pipeline`` staged. ``PipelineWriter`` is DCP's ``FileSystemWriter``
with one thread and its serial loader (the order the pipeline stages in), starting and
finishing the pipeline around ``write_data``; its file system (``_StreamingFileSystem``)
opens write streams (``_StreamingStream``) that write a bytes item's pieces as they
land: ``resolve_data`` returns a stand-in (``Streamed``) whose ``getbuffer()`` is a
marker (``Marker``) the stream recognizes.

Limit of DCP's public API (documented in docs/design.md): the writer writes a bytes
item as ``stream.write(data.getbuffer())`` on the stream its file system opened. Should
a writer do anything else with the stand-in (read it, copy it), the save fails with
UnsupportedError before any metadata is written; it never writes a wrong item.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem

from async_stager._dcp.budget.records import Marker, PipelineSide, Streamed
from async_stager._dcp.files import naming_file_system

if TYPE_CHECKING:
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future as TorchFuture

__all__ = ["Marker", "PipelinePlanner", "PipelineWriter", "Streamed"]  # the stand-ins: records


class PipelinePlanner(DefaultSavePlanner):
    """DCP's default save planner whose ``resolve_data`` hands out staged pieces."""

    def __init__(self, pipeline: PipelineSide) -> None:
        super().__init__()
        self._pipeline = pipeline
        pipeline.source = self._source
        pipeline.lookup = self._lookup
        pipeline.path_of = self._path_of

    def _source(self, item: WriteItem) -> Any:
        return DefaultSavePlanner.resolve_data(self, item)

    def _lookup(self, item: WriteItem) -> Any:
        return self.lookup_object(item.index)

    def _path_of(self, fqn: str) -> tuple[Any, ...]:
        """The path in the state dict of DCP's flattened name ``fqn`` (the planner's
        mappings, set when it flattened the state dict; else the name itself)."""
        path = (getattr(self, "mappings", None) or {}).get(fqn)
        return tuple(path) if path is not None else (fqn,)

    def resolve_data(self, write_item: WriteItem) -> Any:
        return self._pipeline.take(write_item)


class _StreamingStream:
    """A file the writer opened (through ``_StreamingFileSystem``): writes pass through,
    except a bytes item's marker buffer, which becomes that item's pieces."""

    def __init__(self, raw: Any, pipeline: PipelineSide) -> None:
        self._raw = raw
        self._pipeline = pipeline

    def write(self, data: Any) -> int:
        if isinstance(data, memoryview) and isinstance(data.obj, Marker):
            return self._pipeline.pump(data.obj, self._raw)
        n: int = self._raw.write(data)
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class _StreamingFileSystem(naming_file_system()):  # type: ignore[misc]
    """DCP's local file system whose write streams are ``_StreamingStream``s (and name
    their file in a full disk's error: ``_dcp.files``)."""

    def __init__(self, pipeline: PipelineSide) -> None:
        super().__init__()
        self._pipeline = pipeline

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as stream:
            yield _StreamingStream(stream, self._pipeline) if "w" in mode else stream


class PipelineWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` with one thread and its serial loader (the order
    ``Pipeline`` stages in), starting and finishing the pipeline around the write; its
    file system's write streams write bytes items as they are streamed."""

    def __init__(self, path: Any, pipeline: PipelineSide, **kwargs: Any) -> None:
        super().__init__(path, thread_count=1, per_thread_copy_ahead=0, **kwargs)
        self._pipeline = pipeline
        self.fs = _StreamingFileSystem(pipeline)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> TorchFuture[list[WriteResult]]:
        try:
            self._pipeline.start(plan)
            result = super().write_data(plan, planner)
            self._pipeline.check_written()
            return result
        finally:
            self._pipeline.finish()
