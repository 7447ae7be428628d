"""``CudaPrimitives``: the device primitives (``primitives``) on one CUDA device,
through ``torch.cuda``.

Hazards kept here (the ordering rules are the copier's):
- Contexts: event queries run with the event's device current: a CUDA runtime call
  from a thread without a current context (the event loop's, a worker's) would
  otherwise create one on that thread's device, GPU 0 by default.
- Streams come from torch's pool of 32 per device (``pool_stream``;
  ``DevicePrimitives.new_stream`` draws so they are never the default, the caller's or
  one the stager already uses).
- Host memory must be pinned for a device-to-host copy to be asynchronous; into
  pageable memory CUDA silently makes it synchronous (correct, slower).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from async_stager._core.copy.primitives import DevicePrimitives
from async_stager._core.memory.arena import CudaPinner, Pinner

__all__ = ["CudaPrimitives"]


class CudaPrimitives(DevicePrimitives):
    """One CUDA device's streams, events, copies and memory (``torch.cuda``)."""

    def __init__(self, device: torch.device) -> None:
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(device)

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def default_stream(self) -> torch.cuda.Stream:
        return torch.cuda.default_stream(self.device)

    def pool_stream(self) -> torch.cuda.Stream:
        with torch.cuda.device(self.device):
            return torch.cuda.Stream(device=self.device)

    def new_stream(self, avoid: Sequence[Any] = ()) -> torch.cuda.Stream:
        with torch.cuda.device(self.device):
            stream: torch.cuda.Stream = super().new_stream(avoid)
            return stream

    @contextlib.contextmanager
    def using(self, stream: Any) -> Iterator[Any]:
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            yield stream

    def wait_stream(self, stream: Any, other: Any) -> None:
        stream.wait_stream(other)

    def record(self, stream: Any) -> torch.cuda.Event:
        # blocking=True: a driver-level host wait sleeps instead of spinning a core.
        event = torch.cuda.Event(blocking=True)
        event.record(stream)
        return event

    def query(self, event: Any) -> bool:
        with torch.cuda.device(self.device):
            return bool(event.query())

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def empty(self, nbytes: int) -> torch.Tensor:
        with torch.cuda.device(self.device):
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def grow(self, base: torch.Tensor) -> None:
        with torch.cuda.device(self.device):
            super().grow(base)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)

    def owns(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cuda"

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        # torch's caching host allocator keeps the block until the copy into it is done.
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def pinner(self) -> Pinner | None:
        return CudaPinner()

    def copy(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        plain_d: list[torch.Tensor] = []
        plain_s: list[torch.Tensor] = []
        for d, s in zip(dsts, srcs, strict=True):
            if s.is_conj() or s.is_neg() or d.is_conj() or d.is_neg():
                # One copy_ each: its kernel resolves the bits on the device (the
                # copier only hands such pairs over device to device).
                d.copy_(s, non_blocking=True)
            else:
                plain_d.append(d)
                plain_s.append(s)
        if plain_d:
            torch._foreach_copy_(plain_d, plain_s, non_blocking=True)

    def capturing(self) -> bool:
        with torch.cuda.device(self.device):
            return bool(torch.cuda.is_current_stream_capturing())
