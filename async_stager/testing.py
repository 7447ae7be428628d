"""Fakes of the device seam, shipped for tests without a GPU.

``SimulatedDevice`` and ``SimulatedBackend`` (``async_stager._core.copy.simulated``) run
the real accelerator copier on the CPU: each stream a queue run by its own thread,
copies landing after seeded random delays, freed device memory overwritten at once. A
stager given ``SimulatedBackend(sim)`` stages through exactly the code a GPU runs, below
the device primitives; use it to test your own ordering (fences, streams, sources
dropped or written while a stage is in flight). The fakes (``async_stager._core.copy.fakes``)
re-implement the copier instead, to inject failures and count calls. This module holds
only the names.

``FakeBackend`` treats CPU tensors as if they lived on an accelerator: copies are
*recorded* when the engine enqueues them and *executed* only when their completion
event fires, like DMA landing later. So a test that reads a staged result before the
completion was observed sees stale bytes: the fake makes ordering bugs visible.
The event fires after ``delay`` seconds, after ``polls`` queries, or by hand
(``complete()``). Failures are injected at enqueue instead (``fail_copy_at``,
``fail_copy_of``), where a real copy would raise too; so is a source whose shape does
not broadcast to its destination's.

Streams are modelled too: each fake device has the caller's current ``FakeStream``
(``FakeBackend.stream(device)``, switched with ``use_stream``), on which a test queues
work that has not run yet (``enqueue``: a producer kernel, a ``non_blocking`` copy into a
pinned CPU tensor). A capture marks the stream's position at the call; the copies of a
stage run that work first (the copy stream waits on the capture), the host copies of CPU
leaves (``host_copies=True``) run it before they copy (they wait for the captures), and
a fence queues a wait for the copies on the stream read at the call. A stream can be
marked ``capturing`` (a CUDA graph capture underway): captures and fences on it raise
``UnsupportedError``. The device scratch for gathering small storages can be limited
(``scratch_limit``), which makes the copier fall back to direct copies. A stage that
takes checksums has the fake device hash its big sources (WSUM64, as a GPU would,
``device_hashes`` counts them) when the completion fires, before the copies.

``FakePinner`` records pin registrations (and can refuse them), so tests check that
pinning happens once per arena and that close unpins everything.

The seam's types are exported here too, for writing another fake (or a real backend)
against them: ``Backend`` (makes a ``Copier`` per source device), ``Copier`` (enqueues
the copies of one device and returns a ``Completion``), ``Completion`` (says when the
copies have landed) and ``Pinner`` (page-locks host arenas).
"""

from async_stager._core.copy.device import Backend, Completion, Copier
from async_stager._core.copy.fakes import (
    FakeBackend,
    FakeCapture,
    FakeCopier,
    FakeEvent,
    FakePinner,
    FakeStream,
)
from async_stager._core.copy.primitives import DevicePrimitives
from async_stager._core.copy.simulated import (
    POISON,
    SimulatedBackend,
    SimulatedDevice,
    SimulatedPinner,
    SimulatedStream,
    UseAfterFree,
)
from async_stager._core.memory.arena import Pinner

__all__ = [
    "Backend",
    "Completion",
    "Copier",
    "DevicePrimitives",
    "FakeBackend",
    "FakeCapture",
    "FakeCopier",
    "FakeEvent",
    "FakePinner",
    "FakeStream",
    "POISON",
    "Pinner",
    "SimulatedBackend",
    "SimulatedDevice",
    "SimulatedPinner",
    "SimulatedStream",
    "UseAfterFree",
]
