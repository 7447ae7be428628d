"""``AcceleratorCopier``: every ordering rule of a stage on an accelerator, over the
device primitives (``primitives``), so the same code runs on CUDA and, in the test
suite, on the simulated device.

One stage: ``capture`` (caller's thread: an event on the caller's current stream),
``begin`` (the copy stream waits on it), ``hash_sources`` (a second stream hashes the
sources as of the capture), ``copy`` (gathers into scratch, byte copies to the host),
``protect`` (``record_stream`` and an event hold on the sources), ``end`` (the copy
stream waits for the hash stream; one completion event).

Hazards handled here:
- Bytes, not values: CUDA's ``_foreach_copy_`` fast path converts bf16/fp16/fp8
  through float (``bytewise``).
- Lazy conj/neg bits: a view with them cannot be read as bytes, and ATen resolves the
  bits of an asynchronous device-to-host copy on the host right after enqueueing it,
  racing the DMA. Such a source is first resolved on the device, on the copy stream,
  into a temporary (``_resolved``); its bytes are then copied like any other.
- Streams: the copy and hash streams are drawn once per copier, never the default nor a
  caller's stream; a copier lives as long as its owner (the engine, a budget lane).
- Host waits are bounded (``wait_seconds``): a wedged device raises CopyError.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from async_stager._core.checksum.digest import Checksums
from async_stager._core.checksum.wordhash import (
    TABLE_WORDS,
    fill_tables,
    hash_layout,
    piece_hashes,
    raw_bytes,
    table_views,
)
from async_stager._core.copy.device import Completion
from async_stager._core.copy.primitives import DeviceEvent, DevicePrimitives, poll_until
from async_stager._core.copy.scratch import ScratchCopier, bytewise

__all__ = ["AcceleratorCopier", "HOST_WAIT_SECONDS"]

#: Seconds a host wait for device work may last before it fails (a healthy device
#: copies far more than the largest state dict in this time).
HOST_WAIT_SECONDS = 600.0


class AcceleratorCopier(ScratchCopier):
    """A dedicated copy stream on one accelerator device; completion is an event.

    ``non_blocking`` False: ``end`` waits for the copies and returns None.
    ``wait_seconds``: bound of every host wait (``end`` when blocking, ``close``)."""

    def __init__(
        self, prims: DevicePrimitives, *, non_blocking: bool, wait_seconds: float = HOST_WAIT_SECONDS
    ) -> None:
        super().__init__(prims.device)
        self.prims = prims
        self.non_blocking = non_blocking
        self.wait_seconds = wait_seconds
        #: The callers' current streams seen at captures (bounded): what a stream made
        #: later (the hash stream, in the worker) must not be.
        self._callers: list[Any] = [prims.current_stream()]
        # Made on the caller's thread (the first capture): not the caller's stream.
        self.stream = prims.new_stream()
        self._ctx: contextlib.ExitStack | None = None
        # Made at the first stage that takes checksums; see hash_sources.
        self._hash_stream: Any = None
        #: The WSUM64 constants (``fill_tables``) in device memory of the hash stream.
        self._tables: torch.Tensor | None = None
        self._hashing = False
        self._capture: DeviceEvent | None = None
        #: The current stage's device sources, until ``end`` gives them to its event.
        self._held: list[torch.Tensor] = []
        #: Device temporaries of this stage (resolved lazy-bit sources), freed in
        #: stream order at ``end``.
        self._temps: list[torch.Tensor] = []
        #: Stages whose device hash could not be had (device memory ran out): their
        #: destinations were hashed from the host copy instead.
        self.hash_fallbacks = 0

    def _event(self, stream: Any) -> DeviceEvent:
        return DeviceEvent(self.prims, stream, timeout=self.wait_seconds)

    def capture(self) -> Any:
        current = self.prims.current_stream()
        if len(self._callers) < 64 and all(current != s for s in self._callers):
            self._callers.append(current)
        return self._event(current)

    def begin(self, capture: Any) -> None:
        ctx = contextlib.ExitStack()
        ctx.enter_context(self.prims.using(self.stream))
        self._ctx = ctx
        self._capture = capture
        if capture is not None:
            capture.wait(self.stream)
        else:
            # No capture for this device (it had no context at the call, so no source
            # of the call lived there): order after its default stream.
            self.prims.wait_stream(self.stream, self.prims.default_stream())

    def copy(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        super().copy(dsts, self._resolved(srcs))

    def _resolved(self, srcs: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """``srcs`` with each view with lazy conj/neg bits replaced by a device
        temporary holding its values, filled on the copy stream (ordered after the
        capture like the copies; the temporary is freed in stream order at ``end``)."""
        if not any(s.is_conj() or s.is_neg() for s in srcs):
            return srcs
        out = list(srcs)
        for i, s in enumerate(out):
            if not (s.is_conj() or s.is_neg()) or not self.prims.owns(s):
                continue
            raw = self.prims.empty(max(1, s.numel() * s.element_size()))
            tmp = raw[: s.numel() * s.element_size()].view(s.dtype).view(s.shape)
            self.prims.copy([tmp], [s])  # elementwise on the device: the bits resolved
            self._temps.append(raw)
            out[i] = tmp
        return out

    def copy_now(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        if dsts:
            # Bytes, not values: see ``bytewise`` (bf16/fp16/fp8 through float).
            bd, bs = bytewise(dsts, srcs)
            self.prims.copy(bd, bs)

    def hash_sources(
        self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], checksums: Checksums
    ) -> None:
        # The hashes run on a second stream, so the SMs hash while the copy engine
        # copies: the hash stream waits for the stage's capture itself (the sources
        # as of the call; not for earlier stages' copies still on the copy stream);
        # end() makes the copy stream wait for the hash stream, so the stage's one
        # completion covers both. Temporaries and the constant tables are made with the
        # hash stream current (used and reused only in its order); the sources are
        # recorded on it (the allocator keeps them until it is done).
        #
        # A device hash is an optimization: when it cannot be had (device memory runs
        # out), nothing is recorded and the host copy is hashed later instead.
        layout, total = hash_layout(dsts, srcs)
        if not layout:
            return
        prims = self.prims
        if self._hash_stream is None:
            self._hash_stream = prims.new_stream((self.stream, *self._callers))
        stream = self._hash_stream
        # Pinned, so the result's copy is asynchronous; the Checksums keep it until
        # it is read.
        host = prims.host_empty(total, torch.int64)
        with prims.using(stream):
            if self._capture is not None:
                self._capture.wait(stream)
            else:
                prims.wait_stream(stream, prims.default_stream())
            self._hashing = True
            try:
                if self._tables is None:
                    # Device memory of the hash stream, written by its kernels (ready
                    # in its order only), kept as long as the copier.
                    self._tables = prims.empty(TABLE_WORDS * 8).view(torch.int64)
                    prims.launch(fill_tables, self._tables)
                out = prims.empty(total * 8).view(torch.int64)
                srcs = [src for _, src, _, _ in layout]
                for src in srcs:
                    if prims.owns(src):
                        prims.record_stream(src, stream)
                    self._held.append(src)
                spans = [(start, pieces) for _, _, start, pieces in layout]

                # The kernel gets every device tensor as an argument and holds none:
                # the sources live on through record_stream and the event's hold only.
                def run(out: torch.Tensor, table_mem: torch.Tensor, *srcs: torch.Tensor) -> None:
                    tables = table_views(table_mem)
                    for src, (start, pieces) in zip(srcs, spans):
                        piece_hashes(raw_bytes(src), out[start : start + pieces], tables)

                prims.launch(run, out, self._tables, *srcs)
                prims.copy([host], [out])
            except torch.OutOfMemoryError:
                self.hash_fallbacks += 1
                return
        for d, _, start, _ in layout:
            checksums.add_device(d, host, start)

    def protect(self, srcs: Sequence[torch.Tensor]) -> None:
        # Hazard: ``record_stream`` only tells the caching allocator; memory it does
        # not own (a tensor imported through DLPack, a CUDA IPC handle from another
        # process) is freed by its owner when the last tensor on it dies, copy or no
        # copy. So every source is also held by the stage's completion event until
        # the copies (and device hashes) have read it: ``end`` hands them over.
        for s in srcs:
            if self.prims.owns(s):
                self.prims.record_stream(s, self.stream)
            self._held.append(s)

    def end(self) -> Completion | None:
        if self._hashing and self._hash_stream is not None:
            self._hashing = False
            self.prims.wait_stream(self.stream, self._hash_stream)
        temps, self._temps = self._temps, []
        for t in temps:
            self.prims.free(t)  # stream order: the copies reading them come first
        done = self._event(self.stream)
        done.keep, self._held = self._held, []
        self._capture = None
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.close()
        self.release_scratch()
        if not self.non_blocking:
            done.synchronize()
            return None
        return done

    def fence_point(self) -> Any:
        return self.prims.current_stream()

    def fence_point_of(self, capture: Any) -> Any:
        return capture.stream if isinstance(capture, DeviceEvent) else None

    def fence(self, completion: Completion, point: Any) -> None:
        stream = point if point is not None else self.prims.current_stream()
        completion.wait(stream)  # type: ignore[attr-defined]

    # Scratch is allocated and re-materialized with the copy stream current, so its
    # blocks belong to that stream and are reused only in its order.

    def _alloc_scratch(self, nbytes: int) -> torch.Tensor:
        with self.prims.using(self.stream):
            return self.prims.empty(nbytes)

    def _grow_scratch(self, base: torch.Tensor) -> None:
        with self.prims.using(self.stream):
            self.prims.grow(base)

    def _free_scratch(self, base: torch.Tensor) -> None:
        self.prims.free(base)

    def close(self) -> None:
        """Free scratch, then wait (bounded: CopyError after ``wait_seconds``) for the
        copy and hash streams' work."""
        self.release_scratch()
        for s in (self.stream, self._hash_stream):
            if s is not None:
                event = self.prims.record(s)
                poll_until(
                    lambda e=event: self.prims.query(e),
                    self.wait_seconds,
                    f"closing the copier of {self.device}",
                )
