"""Fakes of the device seam, shipped for tests without a GPU.

``FakeBackend`` treats CPU tensors as if they lived on an accelerator: copies are
*recorded* when the engine enqueues them and *executed* only when their completion
event fires, like DMA landing later. So a test that reads a staged result before the
completion was observed sees stale bytes: the fake makes ordering bugs visible.
The event fires after ``delay`` seconds, after ``polls`` queries, or by hand
(``complete()``), and can be told to fail.

``FakePinner`` records pin registrations (and can refuse them), so tests check that
pinning happens once per arena and that close unpins everything.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._device import Backend, Copier
from ._errors import PinningError

__all__ = ["FakeBackend", "FakeCopier", "FakeEvent", "FakePinner"]


class FakeEvent:
    """A completion that the test controls; runs its recorded copies when it fires."""

    def __init__(
        self, ops: list[Callable[[], None]], *, delay: float, polls: int | None, manual: bool
    ) -> None:
        self._ops = ops
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._due = time.perf_counter() + delay
        self._polls_left = polls
        self._manual = manual
        self.queries = 0
        self.failed: BaseException | None = None

    def complete(self) -> None:
        """Fire now: run the recorded copies (idempotent)."""
        with self._lock:
            if self._done.is_set():
                return
            ops, self._ops = self._ops, []
            try:
                with torch.no_grad():
                    for op in ops:
                        op()
            finally:
                self._done.set()

    @property
    def fired(self) -> bool:
        return self._done.is_set()

    def query(self) -> bool:
        self.queries += 1
        if self._done.is_set():
            return True
        if self._manual:
            return False
        if self._polls_left is not None:
            self._polls_left -= 1
            if self._polls_left <= 0:
                self.complete()
                return True
            return False
        if time.perf_counter() >= self._due:
            self.complete()
            return True
        return False

    def synchronize(self) -> None:
        if self._manual:
            self._done.wait()
            return
        self.complete()


class FakeCopier(Copier):
    """An 'accelerator' copier over CPU tensors, with deferred, batched copies."""

    asynchronous = True
    batch_small = True

    def __init__(self, backend: FakeBackend, device: torch.device) -> None:
        super().__init__(device)
        self._backend = backend
        self._ops: list[Callable[[], None]] = []
        self._held: list[torch.Tensor] = []

    def capture(self) -> Any:
        self._backend.captures += 1
        return ("capture", self._backend.captures)

    def begin(self, capture: Any) -> None:
        self._ops = []
        self._held = []
        self._backend.begun.append(capture)

    def copy(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        if not dsts:
            return
        fail_at = self._backend.fail_copy_at
        if fail_at is not None:
            self._backend.copies_seen += len(dsts)
            if self._backend.copies_seen > fail_at:
                raise RuntimeError("injected copy failure")
        bad = self._backend.fail_copy_of
        if bad is not None and bad.numel():
            bad_ptr = bad.untyped_storage().data_ptr()
            if any(t.untyped_storage().data_ptr() == bad_ptr for t in srcs):
                raise RuntimeError("injected copy failure of one source")
        d, s = list(dsts), list(srcs)
        # Shapes are checked now, like a real enqueue would.
        for a, b in zip(d, s):
            if a.shape != b.shape and a.numel() != b.numel():
                raise RuntimeError(f"shape mismatch {tuple(a.shape)} vs {tuple(b.shape)}")
        self._backend.launches += 1
        self._ops.append(lambda: torch._foreach_copy_(d, s))

    def protect(self, srcs: Sequence[torch.Tensor]) -> None:
        self._held = list(srcs)

    def end(self) -> FakeEvent:
        ev = FakeEvent(
            self._ops, delay=self._backend.delay, polls=self._backend.polls, manual=self._backend.manual
        )
        self._ops = []
        self._backend.events.append(ev)
        return ev

    def fence(self, completion: Any) -> None:
        self._backend.fences.append(completion)


class FakeBackend(Backend):
    """Every device is a fake accelerator (see module doc).

    ``delay``: seconds until an event fires by itself; ``polls``: fire after that many
    queries instead; ``manual``: fire only via ``complete()`` or ``complete_all()``.
    ``fail_copy_at``: raise in the copy that would take the total past this count.
    ``fail_copy_of``: raise in every copy that reads this tensor's storage (a fault
    tied to one source, so the error can name its path).
    """

    def __init__(
        self,
        *,
        delay: float = 0.0,
        polls: int | None = None,
        manual: bool = False,
        fail_copy_at: int | None = None,
        fail_copy_of: torch.Tensor | None = None,
    ) -> None:
        self.delay = delay
        self.polls = polls
        self.manual = manual
        self.fail_copy_at = fail_copy_at
        self.fail_copy_of = fail_copy_of
        self.copies_seen = 0
        self.launches = 0
        self.captures = 0
        self.begun: list[Any] = []
        self.events: list[FakeEvent] = []
        self.fences: list[Any] = []

    def copier(self, device: torch.device) -> Copier:
        return FakeCopier(self, device)

    def known_devices(self) -> Sequence[torch.device]:
        return (torch.device("cpu"),)

    def complete_all(self) -> None:
        for ev in list(self.events):
            ev.complete()


class FakePinner:
    """Records registrations; ``fail`` makes the next registrations raise."""

    def __init__(self, *, fail: bool = False) -> None:
        self.fail = fail
        self.registered: dict[int, int] = {}
        self.total_registrations = 0

    def register(self, ptr: int, nbytes: int) -> None:
        if self.fail:
            raise PinningError(f"injected pinning failure ({nbytes} bytes)")
        self.registered[ptr] = nbytes
        self.total_registrations += 1

    def unregister(self, ptr: int) -> None:
        del self.registered[ptr]
