"""Model-based test of the Checkpointer: a hypothesis state machine drives one open
Checkpointer and checks it, after every rule, against a small reference model of what
must be on disk.

The machine (``CheckpointerMachine``) opens a Checkpointer (format, policy,
``max_in_flight``, ``keep``, ``host_budget_bytes`` and the event loop drawn per
example: asyncio, uvloop or trio) in a *driver* task, the user's task, that runs each
rule's command as a training loop would, and applies: saves (plain, fenced, cancelled,
concurrent from several tasks, blocked on a full ``"wait"``, failing to stage, with a
bad step), writes held open and released in any order, writes failing as a full disk
would (an injected ``ENOSPC`` in the write), ``wait()``, a second Checkpointer on the
same folder, a corrupted byte of a committed step, restores of a named step, an
``on_saved`` that raises, and a close and reopen. Values differ per save (each carries
its sequence number, and the Linear/AdamW/StepLR train one step per save), so a step
that mixes two saves is seen.

Writes are held open by a ``Gate`` value in the state: staging copies it through the
pickle protocol, and the write pickles that copy, which waits for its release (or
raises the injected disk-full error) and pickles as a ``torch.Size`` (what it restores
as, in both formats). A held write is in flight for certain: the model knows which
saves the ``"skip"`` policy must refuse and which ``"coalesce"`` must queue. Where the
model cannot know (a released write that waits for an older commit: does it still hold
its slot?), it accepts either answer and follows the one observed.

Invariants after every rule: the commits reported (``on_saved`` and ``saved()``) are
the model's, in commit (= save call) order; ``steps()`` and ``latest`` follow the
model's commit order with ``keep`` retention (the newest commit never deleted); every
committed step on disk restores bit-exact into fresh objects (tensors, module,
optimizer state, scheduler, plain values); a corrupted one never restores; ``restore()``
returns the newest commit that verifies; ``dropped`` (coalesce) is the model's; no
``.tmp-``, ``.del-`` or ``.old-`` folder outlives its writer; the driver task (user
code) was never cancelled by the library.

A second, smaller machine (``CrashMachine``) starts ``model_child.py``, which saves in
a loop, opens Checkpointers on the same folder in this process while it writes (they
must not disturb it), SIGKILLs it at a random moment, reopens and checks that the dead
writer's leftovers are gone and that what is on disk is the commit sequence the child
reported, each step bit-exact. ``test_disk_full_in_a_child`` runs a real short write
(``RLIMIT_FSIZE``).

Sequences the machines found are kept as ``test_replay_*`` tests (the rules called
in order, the checks after each), with ``test_a_kept_failure_record_does_not_stall_saves``.

The default run (derandomized: the same examples each time) takes about a minute on
2 cores; ``ASYNC_STAGER_STRESS=1`` runs random, longer ones. A failure prints
hypothesis' shortest rule sequence; the machine is concurrent, so a sequence may need a
few runs to fail again (hypothesis then says "Flaky"), and the shortening is slower.
"""

from __future__ import annotations

import concurrent.futures
import copy
import errno
import itertools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import zipfile
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import pytest
import torch
from hypothesis import HealthCheck, Phase, settings, strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import model_child
from helpers import bits

from async_stager import (
    Checkpointer,
    CheckpointError,
    IntegrityError,
    InvalidOptionError,
    InvalidOptionTypeError,
    StagingError,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).resolve().parent / "model_child.py"

#: Seconds a rule waits for a command, a commit or a gate before it calls it a hang.
TIMEOUT = 20.0
#: Seconds a held write waits for its release before it gives up (a test bug or hang).
GATE_TIMEOUT = 60.0
#: The first element of the ``torch.Size`` a gate value saves as.
GATE_TAG = 7
#: Steps the saves use: few, so steps repeat, come lower than committed ones, and one
#: wider than the 8 digits of a folder name.
STEPS = st.sampled_from([0, 1, 2, 3, 5, 8, 123_456_789])
#: What one save rule does (plain twice: the commonest).
SAVE_KINDS = (
    "plain",
    "plain",
    "fresh",
    "fenced",
    "fenced_in_task",
    "cancelled",
    "uncopyable",
    "raising_callback",
)
#: Seconds after its call a cancelled save is cancelled (0: at its first checkpoint).
DELAYS = (0.0, 0.0005, 0.002, 0.01)
#: A budget small enough that a save goes through the ring in several pieces.
BUDGET = 8192
#: Every failed write is raised (once) by a later save()/wait()/close; False: a raise
#: stands for every failure pending at that moment (only the first is raised).
EVERY_FAILURE_RAISED = True
#: A flipped byte that no restored value depends on (a zip header of a stored tensor
#: item) may go unnoticed if every value restores intact; False: every flipped byte
#: of a committed step must make it fail verification.
BENIGN_DAMAGE_MAY_RESTORE = False
#: What the machines ran in this process: sequences (examples), and rules checked
#: (``checks``: one per rule, plus one per open). Printed by the model tests (-s).
RUNS: Counter[str] = Counter()
#: Sequence numbers, unique in the process (gates are found by them).
SEQ = itertools.count(1)

_log_records: list[logging.LogRecord] = []


class _Capture(logging.Handler):
    """Keeps the library's log records as text: a record that kept ``exc_info`` would
    keep a failed write's frames, and so its staged buffers, reachable (see
    ``test_a_kept_failure_record_does_not_stall_saves``)."""

    def emit(self, record: logging.LogRecord) -> None:
        record.msg, record.args, record.exc_info, record.exc_text = _text(record), (), None, None
        _log_records.append(record)


# -- held and failing writes ------------------------------------------------------------


@dataclass
class GateCtl:
    """Controls the write of one save: ``release`` lets it go on; ``fail`` makes it
    raise a disk-full OSError instead; ``fired`` is set once the write got past it."""

    seq: int
    fail: bool
    release: threading.Event = field(default_factory=threading.Event)
    entered: threading.Event = field(default_factory=threading.Event)
    fired: threading.Event = field(default_factory=threading.Event)


GATES: dict[int, GateCtl] = {}


class Gate:
    """A value that holds a save's write open (see the module docstring). The original
    (in the user's state) pickles as a marked copy, which staging rebuilds; the copy,
    pickled by the write, waits for ``GATES[seq].release``."""

    def __init__(self, seq: int, copy: bool = False) -> None:
        self.seq = seq
        self.copy = copy

    def __reduce_ex__(self, protocol: Any) -> Any:
        if not self.copy:
            return (_gate_copy, (self.seq,))
        ctl = GATES[self.seq]
        ctl.entered.set()
        try:
            if not ctl.release.wait(GATE_TIMEOUT):
                raise TimeoutError(f"gate {self.seq} was never released")
            if ctl.fail:
                raise OSError(errno.ENOSPC, f"No space left on device (injected, save {self.seq})")
        finally:
            ctl.fired.set()
        return (torch.Size, ((GATE_TAG, self.seq),))


def _gate_copy(seq: int) -> Gate:
    return Gate(seq, copy=True)


class Bomb:
    """A value that cannot be copied: staging it fails (UncopyableObjectError)."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise ValueError("this value cannot be copied (injected)")


def injected_write_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it chains or groups) is a write failure this test
    injected."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EFBIG):
            return True
        if "injected, save" in str(e):
            return True
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
        todo.extend(getattr(e, "exceptions", ()))
    return False


# -- states, snapshots, comparisons -----------------------------------------------------


def fill(seq: int, w: torch.Tensor, x: dict[str, Any]) -> None:
    """Write save ``seq``'s values into its tensors and nested plain values."""
    w.copy_(torch.arange(w.numel(), dtype=torch.float32) + float(seq))
    x["h"].fill_(seq % 30000)
    x["v"].copy_(torch.full((3, 5), float(seq), dtype=torch.float64) / 7)
    x["nested"]["t"].fill_(seq)
    x["nested"]["l"][0] = seq
    x["nested"]["l"][1]["name"] = f"n{seq}"


def blank_x() -> dict[str, Any]:
    return {
        "h": torch.zeros(2048, dtype=torch.int16),
        "v": torch.zeros(3, 5, dtype=torch.float64),
        "nested": {"t": torch.zeros(64, dtype=torch.int64), "l": [-1, {"name": ""}]},
    }


def is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


class Live:
    """The training side of one example: a Linear, its AdamW and a StepLR that train one
    step per save, and tensors rewritten in place. ``scribble`` overwrites every source
    (allowed once a save returned or a fence covered it); ``advance`` puts them back
    before the next training step."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Linear(8, 4)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=0.01)
        self.sched = torch.optim.lr_scheduler.StepLR(self.optim, step_size=2, gamma=0.5)
        self.w = torch.zeros(1024)
        self.x = blank_x()
        self._backup: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._epoch = 0

    def _sources(self) -> list[torch.Tensor]:
        out = [*self.model.parameters(), self.w, self.x["h"], self.x["v"], self.x["nested"]["t"]]
        for st_ in self.optim.state.values():
            out.extend(v for v in st_.values() if isinstance(v, torch.Tensor))
        return out

    def scribble(self, extra: list[dict[str, Any]] | None = None) -> None:
        if self._backup is None:
            self._backup = [(t, t.detach().clone()) for t in self._sources()]
            self._epoch = self.sched.last_epoch
        with torch.no_grad():
            for t in self._sources():
                t.fill_(-3)
        self.sched.last_epoch = -99
        self.x["nested"]["l"][0] = -3
        self.x["nested"]["l"][1]["name"] = "scribbled"
        for state in extra or []:
            state["w"].fill_(-3)
            state["x"]["h"].fill_(-3)
            state["x"]["nested"]["l"][0] = -3

    def advance(self, seq: int) -> None:
        if self._backup is not None:
            with torch.no_grad():
                for t, saved in self._backup:
                    t.copy_(saved)
            self.sched.last_epoch = self._epoch
            self._backup = None
        g = torch.Generator().manual_seed(seq)
        self.model(torch.randn(2, 8, generator=g)).square().mean().backward()
        self.optim.step()
        self.optim.zero_grad()
        self.sched.step()

    def state(self, seq: int, *, fresh: bool, gate: Any) -> dict[str, Any]:
        """Save ``seq``'s state: the live objects, its own tensors when ``fresh``."""
        w, x = (torch.zeros(1024), blank_x()) if fresh else (self.w, self.x)
        fill(seq, w, x)
        return {
            "model": self.model,
            "optim": self.optim,
            "sched": self.sched,
            "w": w,
            "x": x,
            "seq": seq,
            "ratio": seq / 7,
            "name": f"save-{seq}",
            "gate": gate,
            # The same values in a new tensor every save: what an incremental save
            # references (by content, not by identity).
            "frozen": torch.arange(512, dtype=torch.float32) * 0.5,
        }


def snapshot(state: dict[str, Any], seq: int | None = None) -> dict[str, Any]:
    """What restoring ``state`` must give: deep copies taken now (the snapshot point)."""
    out: dict[str, Any] = {}
    for k, v in state.items():
        if k == "gate" and seq is not None:
            out[k] = torch.Size((GATE_TAG, seq))
        elif is_stateful(v) and not isinstance(v, torch.Tensor):
            out[k] = copy.deepcopy(v.state_dict())
        else:
            out[k] = copy.deepcopy(v)
    return out


def fresh_state() -> dict[str, Any]:
    """A restore target: new objects of the saved kinds, with other values; the
    optimizer has no state yet, the scheduler is new, plain values are placeholders."""
    torch.manual_seed(4242)
    model = nn.Linear(8, 4)
    optim = torch.optim.AdamW(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=5, gamma=0.9)
    return {
        "model": model,
        "optim": optim,
        "sched": sched,
        "w": torch.zeros(1024),
        "x": blank_x(),
        "seq": -1,
        "ratio": -1.0,
        "name": "",
        "gate": None,
        "frozen": torch.zeros(512),
    }


def same(got: Any, want: Any, path: str) -> None:
    """Deep equality of a restored value with its snapshot: tensors by dtype, shape
    and bits; dict keys as sets; other values by type and ==."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{path}: {type(got).__name__}, saved a tensor"
        assert got.dtype == want.dtype and got.shape == want.shape, (
            f"{path}: {got.dtype}{list(got.shape)}, saved {want.dtype}{list(want.shape)}"
        )
        assert torch.equal(bits(got), bits(want)), (
            f"{path}: values differ: {got.flatten()[:4]} vs {want.flatten()[:4]}"
        )
        return
    if isinstance(want, Mapping):
        assert isinstance(got, Mapping), f"{path}: {type(got).__name__}, saved a mapping"
        assert set(got) == set(want), f"{path}: keys {sorted(map(str, got))}, saved {sorted(map(str, want))}"
        for k in want:
            same(got[k], want[k], f"{path}[{k!r}]")
        return
    if isinstance(want, (list, tuple)) and not isinstance(want, torch.Size):
        assert type(got) is type(want), f"{path}: {type(got).__name__}, saved a {type(want).__name__}"
        assert len(got) == len(want), f"{path}: length {len(got)}, saved {len(want)}"
        for i, (a, b) in enumerate(zip(got, want)):
            same(a, b, f"{path}[{i}]")
        return
    assert type(got) is type(want) and got == want, f"{path}: {got!r}, saved {want!r}"


def compare(state: dict[str, Any], want: dict[str, Any], where: str) -> None:
    """A restored state against a snapshot: statefuls through their ``state_dict()``."""
    for k, v in want.items():
        got = state[k]
        if is_stateful(got) and not isinstance(got, torch.Tensor):
            got = got.state_dict()
        same(got, v, f"{where}[{k!r}]")


def leftovers(directory: Path) -> list[str]:
    """Folders a writer leaves while it works: temporary, being deleted, being replaced."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.startswith((".tmp-", ".del-", ".old-")))


def fingerprint(folder: Path) -> tuple[tuple[str, int, int], ...]:
    out = []
    for dirpath, _dirs, files in os.walk(folder):
        for name in files:
            p = Path(dirpath) / name
            s = p.stat()
            out.append((str(p.relative_to(folder)), s.st_size, s.st_mtime_ns))
    return tuple(sorted(out))


def inode(path: Path) -> tuple[int, int]:
    s = path.stat()
    return s.st_dev, s.st_ino


def linked_files(c: Any) -> set[tuple[int, int]]:
    """The data files (device, inode) of a committed step's folder."""
    return {inode(p) for p in Path(c.path).glob("*.distcp")} if c.path is not None else set()


def byte_ranges(folder: Path, kind: str) -> list[tuple[Path, int, int]]:
    """(file, start, end) ranges of a committed step's files holding one kind of
    stored data: ``tensor`` data, a non-tensor ``value``, DCP's ``metadata``, the
    ``checksums`` file, ``torch`` (the state.pt file, whole), or ``any`` file but
    the ``COMMIT`` record (the folder's place in commit order, not stored state)."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != "COMMIT")
    whole = [(p, 0, p.stat().st_size) for p in files if p.stat().st_size > 0]
    if kind == "any":
        return whole
    if kind == "checksums":
        return [r for r in whole if "checksum" in r[0].name]
    if kind == "metadata":
        return [r for r in whole if r[0].name == ".metadata"]
    if kind == "torch":
        return [r for r in whole if r[0].suffix == ".pt"]
    pt = [p for p in files if p.suffix == ".pt"]
    if pt:  # torch format: the zip's members (data/N: tensor storages; data.pkl: the rest)
        out = []
        with zipfile.ZipFile(pt[0]) as z, open(pt[0], "rb") as f:
            for info in z.infolist():
                f.seek(info.header_offset + 26)
                n, m = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
                start = info.header_offset + 30 + n + m
                is_tensor = "/data/" in info.filename and not info.filename.endswith(".pkl")
                if (
                    info.compress_size
                    and (is_tensor == (kind == "tensor"))
                    and (is_tensor or info.filename.endswith("data.pkl"))
                ):
                    out.append((pt[0], start, start + info.compress_size))
        return out
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    md = dcp.FileSystemReader(str(folder)).read_metadata()
    want = TensorStorageMetadata if kind == "tensor" else BytesStorageMetadata
    out = []
    for index, info in (md.storage_data or {}).items():
        if isinstance(md.state_dict_metadata.get(index.fqn), want) and info.length > 0:
            out.append((folder / info.relative_path, info.offset, info.offset + info.length))
    return out


# -- the driver: the user's task, in the portal's event loop ---------------------------


class LoopThread:
    """An event loop (any anyio backend) in a daemon thread, reached through a
    BlockingPortal. A daemon, so that a library hang fails the test instead of holding
    the interpreter at exit (``start_blocking_portal``'s thread would be joined)."""

    def __init__(self, backend: str, options: dict[str, Any]) -> None:
        ready: concurrent.futures.Future[anyio.from_thread.BlockingPortal] = concurrent.futures.Future()

        async def host() -> None:
            async with anyio.from_thread.BlockingPortal() as portal:
                ready.set_result(portal)
                await portal.sleep_until_stopped()

        self.thread = threading.Thread(
            target=anyio.run,
            args=(host,),
            kwargs={"backend": backend, "backend_options": options},
            name="model-event-loop",
            daemon=True,
        )
        self.thread.start()
        self.portal = ready.result(TIMEOUT)

    def stop(self, cancel: bool, timeout: float) -> bool:
        """Stop the loop (cancelling what still runs if ``cancel``); False if it did not
        end within ``timeout`` s (it is then left behind, a daemon)."""
        try:
            self.portal.start_task_soon(self.portal.stop, cancel)
        except RuntimeError:
            pass  # already stopped
        self.thread.join(timeout)
        return not self.thread.is_alive()


class Driver:
    """Opens the Checkpointer in one task of the portal's loop and runs the rules'
    commands in that task, one at a time, as a training loop would. Background work
    (concurrent and blocked saves) runs in a task group inside it. A cancellation that
    reaches a command from outside (the library cancelling its caller) is recorded."""

    def __init__(
        self, portal: anyio.from_thread.BlockingPortal, directory: Path, options: dict[str, Any]
    ) -> None:
        self.portal = portal
        self.directory = directory
        self.options = options
        self.saved: list[int] = []
        self.paths: list[str] = []
        self.streamed: list[int] = []
        self.raise_in_callback = 0
        self.callback_raised = 0
        self.cancelled: str | None = None
        self.ckpt: Checkpointer | None = None
        self.tg: anyio.abc.TaskGroup | None = None
        send, receive = anyio.create_memory_object_stream[tuple[Any, concurrent.futures.Future[Any]]](100)
        self._send, self._receive = send, receive
        self.done: concurrent.futures.Future[Any] | None = None

    def on_saved(self, stats: Any) -> None:
        self.saved.append(stats.step)
        self.paths.append(stats.path)
        if self.raise_in_callback:
            self.raise_in_callback -= 1
            self.callback_raised += 1
            raise RuntimeError("on_saved raised (injected)")

    async def _stream(self, ckpt: Checkpointer) -> None:
        async with ckpt.saved() as stream:
            async for stats in stream:
                self.streamed.append(stats.step)

    async def _run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        async with (
            anyio.create_task_group() as outer,
            Checkpointer(self.directory, on_saved=self.on_saved, **self.options) as ckpt,
        ):
            self.ckpt = ckpt
            outer.start_soon(self._stream, ckpt)
            async with anyio.create_task_group() as tg:
                self.tg = tg
                task_status.started()
                async with self._receive:
                    async for fn, fut in self._receive:
                        try:
                            result = await fn()
                        except anyio.get_cancelled_exc_class():
                            self.cancelled = traceback.format_exc()
                            fut.set_exception(AssertionError("the driver (user code) was cancelled"))
                            raise
                        except BaseException as exc:  # noqa: BLE001 - handed to the rule
                            fut.set_exception(exc)
                        else:
                            fut.set_result(result)

    def start(self) -> None:
        self.done, _ = self.portal.start_task(self._run)

    def call(self, fn: Callable[[], Awaitable[Any]], timeout: float | None = None) -> Any:
        """Run ``fn()`` in the driver task and return its result (or raise its error)."""
        timeout = TIMEOUT if timeout is None else timeout
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        if self.done is not None and self.done.done():
            raise AssertionError(f"the driver task ended: {self.done.exception()!r}\n{self.cancelled or ''}")
        self.portal.call(self._send.send_nowait, (fn, fut))
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            raise AssertionError(f"a command did not return within {timeout} s (a hang)") from None

    def close(self, timeout: float | None = None) -> BaseException | None:
        """End the driver: the Checkpointer closes (drains). Returns what it raised."""
        try:
            self.portal.call(self._send.close)
        except RuntimeError:
            pass
        assert self.done is not None
        try:
            self.done.result(TIMEOUT if timeout is None else timeout)
        except concurrent.futures.TimeoutError:
            raise AssertionError("closing the Checkpointer did not finish (a hang)") from None
        except BaseException as exc:  # noqa: BLE001 - returned to the caller
            # What __aexit__ raised, out of this driver's own task group's wrapper.
            while len(getattr(exc, "exceptions", ())) == 1:
                exc = exc.exceptions[0]  # type: ignore[attr-defined]
            return exc
        return None


# -- the model --------------------------------------------------------------------------


@dataclass
class Save:
    """One save() call and what the model says became of it."""

    seq: int
    step: int
    expected: dict[str, Any]
    ctl: GateCtl | None
    how: str
    #: new, writing, queued, committed, dropped, skipped, failed, cancelled, refused
    state: str = "new"
    path: str | None = None

    @property
    def held(self) -> bool:
        return self.ctl is not None and not self.ctl.release.is_set()

    @property
    def fail(self) -> bool:
        return self.ctl is not None and self.ctl.fail

    def __repr__(self) -> str:
        return f"<save {self.seq} step {self.step} {self.state}{' held' if self.held else ''}>"


class Model:
    """What must be on disk and what the policy must answer, given the calls so far."""

    def __init__(self, policy: str, max_in_flight: int, keep: int) -> None:
        self.policy, self.k, self.keep = policy, max_in_flight, keep
        self.saves: list[Save] = []
        #: Committed and not retired, oldest commit first.
        self.commits: list[Save] = []
        #: Steps of every commit of the open Checkpointer, in commit order.
        self.history: list[int] = []
        #: Failed writes not yet raised (their steps), and those whose slot may be held.
        self.pending_failures: list[int] = []
        #: Cancelled saves: their stage or write may take a moment to end (a slot).
        self.maybe_busy: list[Save] = []
        #: Failures that may still be raised, or not (``EVERY_FAILURE_RAISED`` off).
        self.excused: list[int] = []
        self.unresolved: list[Save] = []
        self.dropped: Counter[int] = Counter()
        self.corrupted: set[int] = set()
        self.damage: dict[int, str] = {}
        #: (device, inode) of data files with a flipped byte: incremental steps link
        #: them, so every step that links one is damaged.
        self.damaged_files: set[tuple[int, int]] = set()
        #: A write failed (or a save was cancelled) since the last wait(): its folder
        #: may still be going.
        self.failed_since_wait = False

    def writing(self) -> list[Save]:
        return [s for s in self.saves if s.state == "writing"]

    def queued(self) -> list[Save]:
        return [s for s in self.saves if s.state == "queued"]

    def in_flight(self) -> bool:
        return bool(self.writing() or self.queued() or self.unresolved)

    def skip_answers(self, batch: tuple[Save, ...] = ()) -> set[bool]:
        """What ``skip`` may answer now: False when max_in_flight saves are in flight
        for certain (held writes; saves of this ``batch`` of concurrent calls accepted
        before, which were staging at this call), True when fewer could be, either in
        between."""
        certain = sum(1 for s in self.writing() if s.held or s in batch)
        most = len(self.writing()) + len(self.unresolved) + len(self.maybe_busy)
        if certain >= self.k:
            return {False}
        if most < self.k:
            return {True}
        return {True, False}

    def accept(self, s: Save) -> None:
        """``s`` was accepted (save returned True): it writes, or queues (coalesce)."""
        self.saves.append(s)
        if self.policy == "coalesce" and len(self.writing()) >= self.k:
            for old in self.queued():
                old.state = "dropped"
                self.dropped[old.step] += 1
            s.state = "queued"
        else:
            s.state = "writing"

    def committed(self, s: Save, path: str) -> None:
        s.state, s.path = "committed", path
        self.history.append(s.step)
        self.commits = [c for c in self.commits if c.step != s.step]
        self.commits.append(s)
        self.commits = self.commits[-self.keep :]
        self._next_queued()

    def failed(self, s: Save) -> None:
        s.state = "failed"
        self.failed_since_wait = True
        self.pending_failures.append(s.step)
        self.unresolved.append(s)
        self._next_queued()

    def _next_queued(self) -> None:
        if self.policy == "coalesce" and len(self.writing()) < self.k:
            for q in self.queued():
                q.state = "writing"

    def failure_raised(self, exc: CheckpointError) -> None:
        """A save()/wait()/close raised a write failure: one of those pending."""
        assert injected_write_failure(exc), f"a failure that is not the injected one: {exc!r}"
        step = getattr(exc, "step", None)
        if step in self.pending_failures:
            self.pending_failures.remove(step)
        elif step in self.excused:
            self.excused.remove(step)
        elif step is None and (self.pending_failures or self.excused):
            pass  # one error for all of them
        else:
            raise AssertionError(f"raised a failure of step {step}, pending {self.pending_failures}: {exc!r}")
        if step is None or not EVERY_FAILURE_RAISED:
            # The others pending may be raised later (if they failed after this raise)
            # or never; not both (each failure once).
            self.excused += self.pending_failures
            self.pending_failures.clear()
        for s in self.unresolved:
            if s.step == step or step is None:
                self.unresolved.remove(s)
                break

    def newest_good(self) -> Save | None:
        good = [c for c in self.commits if c.seq not in self.corrupted]
        return good[-1] if good else None


# -- the state machine ------------------------------------------------------------------


def _guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Marks the machine broken while a rule runs, so teardown after a failure only
    cleans up (its checks would hide the first failure)."""

    def wrapper(self: CheckpointerMachine, *args: Any, **kwargs: Any) -> Any:
        self.broken = True
        result = fn(self, *args, **kwargs)
        self.broken = False
        return result

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


class CheckpointerMachine(RuleBasedStateMachine):
    """See the module docstring."""

    FORMATS: tuple[str, ...] = ("dcp", "torch")
    BACKENDS: tuple[str, ...] = ("asyncio", "uvloop", "trio")

    def __init__(self) -> None:
        super().__init__()
        self.broken = False
        self.opened = False
        self.loop: LoopThread | None = None
        self.driver: Driver | None = None
        self.directory = Path(tempfile.mkdtemp(prefix="ckpt-model-"))
        self.verified: dict[int, Any] = {}
        self.newest_checked: Any = None
        self.logs_seen = len(_log_records)
        self.logs_start = len(_log_records)
        self.callbacks_raised = 0  # by the Checkpointers closed before the open one
        self.gates: list[GateCtl] = []

    # -- plumbing --

    @property
    def ckpt(self) -> Checkpointer:
        assert self.driver is not None and self.driver.ckpt is not None
        return self.driver.ckpt

    def call(self, fn: Callable[[], Awaitable[Any]], timeout: float | None = None) -> Any:
        assert self.driver is not None
        return self.driver.call(fn, timeout)

    def sync(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a plain function on the event loop thread."""
        assert self.loop is not None
        return self.loop.portal.call(fn, *args)

    def new_driver(self) -> None:
        assert self.loop is not None
        self.driver = Driver(self.loop.portal, self.directory, self.options)
        self.driver.start()

    @initialize(data=st.data())
    def open(self, data: st.DataObject) -> None:
        fmt = data.draw(st.sampled_from(self.FORMATS), label="format")
        backend = data.draw(st.sampled_from(self.BACKENDS), label="backend")
        policy = data.draw(st.sampled_from(["wait", "skip", "coalesce"]), label="policy")
        mif = data.draw(st.integers(1, 3), label="max_in_flight")
        keep = data.draw(st.integers(1, 3), label="keep")
        budget = None
        if fmt == "dcp" and policy != "coalesce":
            budget = data.draw(st.sampled_from([None, None, BUDGET]), label="host_budget_bytes")
        incremental = fmt == "dcp" and data.draw(st.booleans(), label="incremental")
        self.start(fmt, backend, policy, mif, keep, budget, incremental)

    def start(
        self,
        fmt: str,
        backend: str,
        policy: str,
        mif: int,
        keep: int,
        budget: int | None,
        incremental: bool = False,
    ) -> None:
        """Open the example's Checkpointer (also for a sequence replayed by hand)."""
        self.fmt, self.policy, self.budget = fmt, policy, budget
        self.options: dict[str, Any] = {
            "format": fmt,
            "policy": policy,
            "max_in_flight": mif,
            "keep": keep,
            "host_budget_bytes": budget,
            "checksum_threads": 1,
            "incremental": incremental,
        }
        self.model = Model(policy, mif, keep)
        self.live = Live()
        name, opts = ("asyncio", {"use_uvloop": True}) if backend == "uvloop" else (backend, {})
        self.loop = LoopThread(name, opts)
        self.new_driver()
        self.opened = True

    # -- gates and waiting --

    def gate_for(self, seq: int, hold: bool, fail: bool) -> tuple[Any, GateCtl | None]:
        """The state's ``gate`` value: a Gate (held open or not, failing or not) where
        the write pickles a staged copy, else the plain value a gate restores as."""
        if self.budget is not None:
            return torch.Size((GATE_TAG, seq)), None
        if self.policy == "coalesce":
            hold = True  # every write held: the model then knows what is queued
        if not hold and not fail:
            return torch.Size((GATE_TAG, seq)), None
        ctl = GATES[seq] = GateCtl(seq, fail)
        self.gates.append(ctl)
        if not hold:
            ctl.release.set()
        return Gate(seq), ctl

    def wait_for_commits(self, n: int, what: Save) -> None:
        assert self.driver is not None
        deadline = time.monotonic() + TIMEOUT
        while len(self.driver.saved) < n:
            bad = [
                r for r in _log_records[self.logs_seen :] if r.levelno >= logging.WARNING and not _expected(r)
            ]
            if bad:
                raise AssertionError(f"expected {what} to commit; the library logged: {bad[0].getMessage()}")
            if self.driver.done is not None and self.driver.done.done():
                raise AssertionError(f"the driver ended waiting for {what}: {self.driver.done.exception()!r}")
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{what} did not commit within {TIMEOUT} s (commits: {self.driver.saved})"
                )
            time.sleep(0.002)

    def settle(self) -> None:
        """Wait for every write the model says can finish now: commits in call order
        up to the first write held open; a failing write once it failed."""
        assert self.driver is not None
        for s in self.model.writing():
            # A write fails when it fails, whatever the commit order.
            if s.fail and not s.held:
                assert s.ctl is not None
                assert s.ctl.fired.wait(TIMEOUT), f"{s}: its write never reached its gate"
                self.model.failed(s)
        while True:
            writing = self.model.writing()
            if not writing:
                break
            oldest = writing[0]
            if oldest.held:
                break
            if oldest.fail:
                assert oldest.ctl is not None
                assert oldest.ctl.fired.wait(TIMEOUT), f"{oldest}: its write never started"
                self.model.failed(oldest)
                continue
            n = len(self.model.history) + 1
            self.wait_for_commits(n, oldest)
            got = self.driver.saved[n - 1]
            assert got == oldest.step, (
                f"commit {n} was step {got}; the model's next commit (save-call order) is {oldest}"
            )
            self.model.committed(oldest, self.driver.paths[n - 1])
        self.call(anyio.wait_all_tasks_blocked)

    def release_all(self) -> None:
        for ctl in self.gates:
            ctl.release.set()

    # -- one save, any way --

    def outcome(self, s: Save, kind: str, value: Any, batch: tuple[Save, ...] = ()) -> None:
        """Apply one save call's result to the model (and check it against the policy)."""
        m = self.model
        if kind == "cancelled":
            s.state = "cancelled"
            m.failed_since_wait = True  # its folder (if it had one) may still be going
            m.maybe_busy.append(s)
            return
        if kind == "raised":
            if isinstance(value, CheckpointError) and injected_write_failure(value):
                m.failure_raised(value)
                s.state = "refused"
                return
            raise value
        assert isinstance(value, bool), f"save returned {value!r}, not a bool"
        if self.policy == "skip":
            allowed = m.skip_answers(batch)
            busy = [w for w in m.writing() if w.held]
            assert value in allowed, (
                f"skip answered {value} for {s}; allowed {allowed} "
                f"(writes in flight: {m.writing()}, held: {busy}, max_in_flight {m.k}, accepted before it in its batch: {batch})"
            )
            if not value:
                s.state = "skipped"
                return
        else:
            assert value is True, f"{self.policy} save returned {value} for {s}"
        m.accept(s)

    def make_save(
        self, step: int, *, hold: bool, fail: bool, fresh: bool, how: str
    ) -> tuple[Save, dict[str, Any]]:
        seq = next(SEQ)
        if not fresh:
            self.live.advance(seq)
        gate, ctl = self.gate_for(seq, hold, fail)
        state = self.live.state(seq, fresh=fresh, gate=gate)
        return Save(seq, step, snapshot(state, seq), ctl, how), state

    def can_save(self, n: int = 1) -> bool:
        if self.policy != "wait":
            return True
        writing = len(self.model.writing())
        return writing == 0 or writing + n <= self.model.k

    def make_room(self, n: int = 1) -> None:
        """Under ``"wait"``, release held writes (oldest first) until ``n`` saves can be
        made without waiting on a write that never ends. (Rules adapt like this rather
        than through preconditions: the model's state depends on what the library
        answered, and hypothesis needs the same draws whatever the answers.)"""
        while not self.can_save(n):
            held = [s for s in self.model.writing() if s.held]
            if not held:
                break
            assert held[0].ctl is not None
            held[0].ctl.release.set()
            self.settle()

    # -- rules --

    @rule(
        step=STEPS,
        kind=st.sampled_from(SAVE_KINDS),
        hold=st.booleans(),
        fail=st.booleans(),
        delay=st.sampled_from(DELAYS),
    )
    @_guarded
    def save(self, step: int, kind: str, hold: bool, fail: bool, delay: float) -> None:
        """One save() call, of one ``kind``: ``plain`` (its sources the live ones) or
        ``fresh`` (tensors of its own), awaited, its write held open (``hold``) and/or
        failing (``fail``); ``fenced``/``fenced_in_task``; ``cancelled`` ``delay`` s
        after the call; ``uncopyable`` (its stage fails); ``raising_callback`` (plain,
        and the next ``on_saved`` raises: logged, never raised into the caller)."""
        self.save_kind(step, kind, hold, fail, delay)

    @rule(
        step=STEPS,
        kind=st.sampled_from(SAVE_KINDS),
        hold=st.booleans(),
        fail=st.booleans(),
        delay=st.sampled_from(DELAYS),
    )
    @_guarded
    def save_again(self, step: int, kind: str, hold: bool, fail: bool, delay: float) -> None:
        """``save`` once more: a second rule (and a third), so that saves are most of
        the steps (hypothesis also turns rules off per example)."""
        self.save_kind(step, kind, hold, fail, delay)

    @rule(
        step=STEPS,
        kind=st.sampled_from(SAVE_KINDS),
        hold=st.booleans(),
        fail=st.booleans(),
        delay=st.sampled_from(DELAYS),
    )
    @_guarded
    def save_more(self, step: int, kind: str, hold: bool, fail: bool, delay: float) -> None:
        """``save`` once more (see ``save_again``)."""
        self.save_kind(step, kind, hold, fail, delay)

    def save_kind(self, step: int, kind: str, hold: bool, fail: bool, delay: float) -> None:
        if kind == "raising_callback":
            assert self.driver is not None
            self.driver.raise_in_callback += 1
            kind = "plain"
        if kind in ("plain", "fresh"):
            self.save_awaited(step, hold, fail, fresh=kind == "fresh")
        elif kind in ("fenced", "fenced_in_task"):
            self.save_then_fence(step, hold, started=kind == "fenced_in_task")
        elif kind == "cancelled":
            self.cancelled_save(step, delay, hold)
        elif self.budget is None:
            self.stage_fails(step)
        else:
            self.save_awaited(step, hold, fail, fresh=False)

    def save_awaited(self, step: int, hold: bool, fail: bool, fresh: bool) -> None:
        """A save, awaited; its sources are overwritten once it returned."""
        self.make_room()
        if self.policy == "wait" and len(self.model.writing()) + 1 > self.model.k:
            hold = fail = False  # it may wait for a slot: only for writes that finish
        s, state = self.make_save(step, hold=hold, fail=fail, fresh=fresh, how="save")
        ckpt = self.ckpt

        async def cmd() -> tuple[str, Any]:
            try:
                r = await ckpt.save(state, step=step)
            except StagingError as exc:
                return "raised", exc
            self.live.scribble([state] if fresh else [])
            return "returned", r

        self.outcome(s, *self.call(cmd))
        self.settle()

    def save_then_fence(self, step: int, hold: bool, started: bool) -> None:
        """``save()`` called (its coroutine run in a task of its own if ``started``,
        else not yet awaited), then ``fence()`` awaited, then the sources overwritten,
        then the save awaited: the fence covers the call either way (the snapshot point
        is the call; a budgeted save's pipeline runs in its coroutine: started only)."""
        self.make_room()
        if self.policy == "wait" and len(self.model.writing()) + 1 > self.model.k:
            hold = False
        started = started or self.budget is not None
        s, state = self.make_save(step, hold=hold, fail=False, fresh=False, how="fenced" + "/task" * started)
        ckpt = self.ckpt

        async def cmd() -> tuple[str, Any]:
            result: list[tuple[str, Any]] = []

            async def run(coro: Awaitable[bool]) -> None:
                try:
                    result.append(("returned", await coro))
                except StagingError as exc:
                    result.append(("raised", exc))

            try:
                coro = ckpt.save(state, step=step)
            except StagingError as exc:
                return "raised", exc
            async with anyio.create_task_group() as tg:
                if started:
                    tg.start_soon(run, coro)
                with anyio.move_on_after(TIMEOUT / 2) as scope:
                    await ckpt.fence()
                fenced = not scope.cancelled_caught
                if not fenced:
                    tg.cancel_scope.cancel()
                else:
                    self.live.scribble()
                    if not started:
                        await run(coro)
            if not fenced:
                if not started:
                    coro.close()  # never awaited: once unreachable, the Checkpointer forgets it
                del coro
                raise AssertionError(
                    f"fence() did not return within {TIMEOUT / 2} s after a save() "
                    + ("whose coroutine runs in a task" if started else "whose coroutine is not awaited yet")
                )
            return result[0]

        self.outcome(s, *self.call(cmd))
        self.settle()

    @rule(
        n=st.integers(2, 3),
        steps=st.lists(STEPS, min_size=3, max_size=3),
        holds=st.lists(st.booleans(), min_size=3, max_size=3),
    )
    @_guarded
    def concurrent_saves(self, n: int, steps: list[int], holds: list[bool]) -> None:
        """``n`` tasks call save() at once, each with its own tensors and values (the
        module, optimizer and scheduler shared, unchanged until all returned)."""
        self.make_room(n)
        writing = len(self.model.writing())
        if self.policy == "wait" and writing + n > self.model.k:
            holds = [False] * 3
        self.live.advance(next(SEQ))
        ckpt, live = self.ckpt, self.live
        order: list[tuple[Save, dict[str, Any]]] = []
        results: dict[int, tuple[str, Any]] = {}

        async def one(i: int) -> None:
            seq = next(SEQ)
            gate, ctl = self.gate_for(seq, holds[i], False)
            state = live.state(seq, fresh=True, gate=gate)
            s = Save(seq, steps[i], snapshot(state, seq), ctl, "concurrent")
            order.append((s, state))  # the call order: nothing awaits between this and the call
            try:
                results[seq] = ("returned", await ckpt.save(state, step=steps[i]))
            except StagingError as exc:
                results[seq] = ("raised", exc)

        async def cmd() -> None:
            async with anyio.create_task_group() as tg:
                for i in range(n):
                    tg.start_soon(one, i)
            live.scribble([st_ for _, st_ in order])

        self.call(cmd)
        for i, (s, _) in enumerate(order):
            earlier = tuple(t for t, _ in order[:i] if results[t.seq] == ("returned", True))
            self.outcome(s, *results[s.seq], batch=earlier)
        self.settle()

    @precondition(lambda self: self.policy == "wait" and self.budget is None)
    @rule(step=STEPS)
    @_guarded
    def save_waits_for_a_slot(self, step: int) -> None:
        """With every slot held by a write, a ``"wait"`` save does not return until a
        write commits; then it does. (A no-op unless every slot is held.)"""
        writing = self.model.writing()
        if len(writing) != self.model.k or not all(s.held for s in writing):
            return
        s, state = self.make_save(step, hold=False, fail=False, fresh=False, how="blocked")
        ckpt = self.ckpt
        fut: concurrent.futures.Future[tuple[str, Any]] = concurrent.futures.Future()

        async def background() -> None:
            try:
                fut.set_result(("returned", await ckpt.save(state, step=step)))
            except StagingError as exc:
                fut.set_result(("raised", exc))
            except BaseException as exc:
                fut.set_exception(exc)
                raise

        async def start() -> None:
            assert self.driver is not None and self.driver.tg is not None
            self.driver.tg.start_soon(background)
            await anyio.sleep(0.05)

        self.call(start)
        assert not fut.done(), f"a 'wait' save returned {fut.result()} while {self.model.k} writes were held"
        oldest = self.model.writing()[0]
        assert oldest.ctl is not None
        oldest.ctl.release.set()
        self.settle()
        try:
            result = fut.result(TIMEOUT)
        except concurrent.futures.TimeoutError:
            raise AssertionError("a 'wait' save did not return after a slot freed") from None
        self.outcome(s, *result)
        self.live.scribble()
        self.settle()

    def cancelled_save(self, step: int, delay: float, hold: bool) -> None:
        """A save cancelled ``delay`` s after its call: nothing saved if it did not
        return; saved as any other if it did."""
        if self.policy == "wait" and len(self.model.writing()) + 1 > self.model.k:
            hold = False
        s, state = self.make_save(step, hold=hold, fail=False, fresh=False, how="cancelled")
        ckpt = self.ckpt

        async def cmd() -> tuple[str, Any]:
            r: Any = None
            try:
                with anyio.move_on_after(delay) as scope:
                    r = await ckpt.save(state, step=step)
            except StagingError as exc:
                return "raised", exc
            if scope.cancelled_caught:
                return "cancelled", None
            return "returned", r

        kind, value = self.call(cmd)
        if kind == "cancelled" and s.ctl is not None:
            s.ctl.release.set()  # whatever the library does with it, never hang on it
        self.outcome(s, kind, value)
        self.live.scribble()
        self.settle()

    def stage_fails(self, step: int) -> None:
        """A save whose state cannot be staged raises a StagingError and saves nothing
        (a coalesce save: the one it would have replaced is still written)."""
        self.make_room()
        seq = next(SEQ)
        state = {**self.live.state(seq, fresh=True, gate=None), "bomb": Bomb()}
        s = Save(seq, step, {}, None, "bomb")
        ckpt = self.ckpt

        async def cmd() -> tuple[str, Any]:
            try:
                r = await ckpt.save(state, step=step)
            except StagingError as exc:
                return "raised", exc
            return "returned", r

        kind, value = self.call(cmd)
        if kind == "returned":
            assert value is False and self.policy == "skip", f"a save of an uncopyable value returned {value}"
            assert False in self.model.skip_answers()
            s.state = "skipped"
        else:
            if isinstance(value, CheckpointError) and injected_write_failure(value):
                self.model.failure_raised(value)
            s.state = "refused"
        self.settle()

    @rule(value=st.sampled_from([-1, -(2**40), True, False, 1.0, 2.5, "3", None, [1]]))
    @_guarded
    def bad_step(self, value: Any) -> None:
        """A step that is not an int >= 0 (bools included) is refused, naming ``step``."""
        ckpt = self.ckpt
        state = {"w": torch.ones(4)}

        async def cmd() -> BaseException | None:
            try:
                await ckpt.save(state, step=value)
            except BaseException as exc:
                if isinstance(exc, anyio.get_cancelled_exc_class()):
                    raise
                return exc
            return None

        exc = self.call(cmd)
        if isinstance(exc, CheckpointError) and injected_write_failure(exc):
            self.model.failure_raised(exc)
            return
        assert isinstance(exc, (InvalidOptionError, InvalidOptionTypeError)), (
            f"save(step={value!r}) raised {exc!r}, not InvalidOptionError/InvalidOptionTypeError"
        )
        assert "step" in str(exc), f"save(step={value!r}): the error does not name step: {exc}"
        self.settle()

    def releasable(self) -> list[Save]:
        writing = self.model.writing()
        if self.policy == "coalesce":
            return writing[:1] if writing and writing[0].held else []
        return [s for s in writing if s.held]

    @rule(pick=st.integers(0, 255))
    @_guarded
    def release(self, pick: int) -> None:
        """Let one held write go on (``pick`` modulo those held: writes finish out of
        order, commits stay in call order; coalesce: the oldest only)."""
        choices = self.releasable()
        if not choices:
            return
        s = choices[pick % len(choices)]
        assert s.ctl is not None
        s.ctl.release.set()
        if s.fail and self.policy == "coalesce":
            self.drain()
            return
        self.settle()

    def drain(self) -> None:
        """Release every held write and wait(): each failure raised once, then none; no
        temporary folder left; everything else committed."""
        self.release_all()
        self.settle()
        ckpt = self.ckpt

        async def wait() -> BaseException | None:
            try:
                await ckpt.wait()
            except CheckpointError as exc:
                return exc
            return None

        for _ in range(len(self.model.saves) + 2):
            exc = self.call(wait)
            if exc is None:
                break
            self.model.failure_raised(exc)  # type: ignore[arg-type]
        assert not self.model.pending_failures, (
            f"wait() returned, but the failures of steps {self.model.pending_failures} were never raised"
        )
        self.model.unresolved.clear()
        self.model.excused.clear()
        self.model.maybe_busy.clear()
        self.settle()
        assert not self.model.in_flight(), f"after wait(): still in flight {self.model.writing()}"
        assert leftovers(self.directory) == [], f"after wait(): {leftovers(self.directory)} remain"
        self.model.failed_since_wait = False

    @rule()
    @_guarded
    def wait(self) -> None:
        """``wait()`` (every held write released first)."""
        self.drain()

    @rule()
    @_guarded
    def second_checkpointer(self) -> None:
        """A second Checkpointer on the folder, for a restore, while the first writes:
        it restores the newest good commit and deletes none of the first's folders."""
        # (A failed or cancelled save's folder may be going away on its own meanwhile.)
        before = set(leftovers(self.directory)) if not self.model.failed_since_wait else set()
        options = {k: self.options[k] for k in ("format", "keep")}
        directory = self.directory
        want = self.model.newest_good()

        async def cmd() -> tuple[Any, dict[str, Any]]:
            target = fresh_state()
            async with Checkpointer(directory, checksum_threads=1, **options) as other:
                got: Any
                try:
                    got = await other.restore(target)
                except IntegrityError as exc:
                    got = exc
            return got, target

        got, target = self.call(cmd)
        after = set(leftovers(self.directory))
        assert before <= after, f"a second Checkpointer deleted the first's folders {sorted(before - after)}"
        self.check_restored(got, target, want, "second Checkpointer's restore()")
        self.settle()

    @rule(
        pick=st.integers(0, 255),
        kind=st.sampled_from(["tensor", "value", "metadata", "checksums", "any"]),
        where=st.integers(0, 2**32),
        flip=st.integers(1, 255),
    )
    @_guarded
    def corrupt(self, pick: int, kind: str, where: int, flip: int) -> None:
        """Flip one stored byte (``where``: which range and byte, modulo; ``flip``: the
        xor) of a committed step (``pick``, modulo the good ones): it must never
        restore again."""
        good = [c for c in self.model.commits if c.seq not in self.model.corrupted]
        if not good:
            return
        c = good[pick % len(good)]
        assert c.path is not None
        ranges = byte_ranges(Path(c.path), kind)
        if not ranges:
            ranges = byte_ranges(Path(c.path), "any")
        path, start, end = ranges[where % len(ranges)]
        offset = start + (where // len(ranges)) % (end - start)
        with open(path, "r+b") as f:
            f.seek(offset)
            b = f.read(1)
            f.seek(offset)
            f.write(bytes([b[0] ^ flip]))
        self.model.corrupted.add(c.seq)
        self.model.damage[c.seq] = f"{path.relative_to(c.path)} byte {offset} of {start}..{end} ^ {flip:#04x}"
        if path.name.endswith(".distcp"):
            # An incremental step links the data files of the step it references: the
            # flipped byte is in each step that links the file.
            node = inode(path)
            self.model.damaged_files.add(node)
            for other in good:
                if other is not c and node in linked_files(other):
                    self.model.corrupted.add(other.seq)
                    self.model.damage[other.seq] = f"links {path.relative_to(self.directory)} (damaged)"

    @rule(pick=st.integers(0, 255))
    @_guarded
    def restore_named(self, pick: int) -> None:
        """``restore(step=s)`` of a committed step (``pick`` modulo the commits and one
        more): bit-exact, or IntegrityError if it was corrupted; of a step never
        committed: CheckpointError."""
        commits = self.model.commits
        i = pick % (len(commits) + 1)
        c = commits[i] if i < len(commits) else None
        if c is None:
            missing = max([s.step for s in commits], default=0) + 1000

            async def absent() -> BaseException | None:
                try:
                    await self.ckpt.restore(fresh_state(), step=missing)
                except CheckpointError as exc:
                    return exc
                return None

            assert isinstance(self.call(absent), CheckpointError), "restore of a step never committed"
            return
        self.verify(c, force=True)

    @rule()
    @_guarded
    def reopen(self) -> None:
        """Close (every held write released; a failure not yet raised comes out of the
        close) and open a new Checkpointer on the folder."""
        self.close_driver()
        assert self.driver is not None
        self.callbacks_raised += self.driver.callback_raised
        self.model.history.clear()
        self.model.dropped.clear()
        self.new_driver()

    def close_driver(self) -> None:
        assert self.driver is not None
        self.release_all()
        self.settle()
        exc = self.driver.close()
        assert self.driver.cancelled is None, f"user code was cancelled:\n{self.driver.cancelled}"
        if exc is not None:
            if isinstance(exc, CheckpointError) and injected_write_failure(exc):
                self.model.failure_raised(exc)
            else:
                raise AssertionError(f"closing the Checkpointer raised {exc!r}") from exc
        assert not self.model.pending_failures, f"closed: failures {self.model.pending_failures} never raised"
        self.model.unresolved.clear()
        self.model.excused.clear()
        self.model.maybe_busy.clear()
        assert not self.model.in_flight(), f"closed with {self.model.writing()} not committed"
        assert self.driver.saved == self.model.history, (
            f"commits reported {self.driver.saved}, the model's {self.model.history}"
        )
        assert leftovers(self.directory) == [], f"after close: {leftovers(self.directory)} remain"
        self.model.failed_since_wait = False
        writers = [n for n in os.listdir(self.directory) if n.startswith(".writer")]
        assert writers == [], f"after close: the writer's lock file {writers} remains"

    # -- checks --

    def check_restored(self, got: Any, target: dict[str, Any], want: Save | None, what: str) -> None:
        if want is None:
            if self.model.commits:
                assert isinstance(got, IntegrityError), f"{what}: no commit verifies, yet it returned {got!r}"
            else:
                assert got is None, f"{what}: nothing committed, returned {got!r}"
            return
        assert got == want.step, (
            f"{what} returned {got!r}; the newest good commit is {want} "
            f"(commits, oldest first: {self.model.commits}, corrupted: {self.model.damage})"
        )
        compare(target, want.expected, f"{what}: step {want.step} (save {want.seq}, {want.how})")

    def verify(self, c: Save, force: bool = False) -> None:
        assert c.path is not None
        key = fingerprint(Path(c.path))
        if not force and self.verified.get(c.seq) == key:
            return
        ckpt = self.ckpt

        async def cmd() -> tuple[Any, dict[str, Any]]:
            target = fresh_state()
            try:
                return await ckpt.restore(target, step=c.step), target
            except IntegrityError as exc:
                return exc, target

        got, target = self.call(cmd)
        # Committed after the damage, referencing the damaged file: damaged if it
        # references the flipped byte's tensor, else whole (its own digests cover the
        # file's other bytes as they were at its commit). Either, never wrong.
        damaged_base = self.model.damaged_files & linked_files(c)
        if c.seq not in self.model.corrupted and damaged_base and isinstance(got, IntegrityError):
            self.model.corrupted.add(c.seq)
            self.model.damage[c.seq] = f"references a damaged file: {got}"
        if c.seq in self.model.corrupted and BENIGN_DAMAGE_MAY_RESTORE and got == c.step:
            compare(target, c.expected, f"step {c.step} (save {c.seq}, damaged: {self.model.damage[c.seq]})")
            self.model.corrupted.discard(c.seq)  # a byte no value depends on: restored intact
        elif c.seq in self.model.corrupted:
            assert isinstance(got, IntegrityError), (
                f"step {c.step} (save {c.seq}) had a byte corrupted ({self.model.damage.get(c.seq)}), "
                f"yet restore(step={c.step}) returned {got!r}" + _intact(target, c)
            )
        else:
            assert got == c.step, f"restore(step={c.step}) of {c}: {got!r}"
            compare(target, c.expected, f"step {c.step} (save {c.seq}, {c.how})")
        self.verified[c.seq] = key

    @invariant()
    def check(self) -> None:
        RUNS["checks"] += 1  # once after every rule (and once after the open)
        if not self.opened or self.broken:
            return
        self.broken = True
        assert self.driver is not None
        m = self.model
        assert self.driver.cancelled is None, (
            f"user code was cancelled by the library:\n{self.driver.cancelled}"
        )
        assert self.driver.saved == m.history, (
            f"commits reported {self.driver.saved}, the model's {m.history}"
        )
        assert self.driver.streamed == self.driver.saved, (
            f"saved() gave {self.driver.streamed}, on_saved {self.driver.saved}"
        )
        logged = [r for r in _log_records[self.logs_start :] if "on_saved raised (injected)" in _text(r)]
        raised = self.callbacks_raised + self.driver.callback_raised
        assert len(logged) >= raised, f"on_saved raised {raised} times, logged {len(logged)}"
        steps = self.sync(self.ckpt.steps)
        assert steps == [c.step for c in m.commits], (
            f"steps() is {steps}; the model's commits (oldest first) are {m.commits}"
        )
        if m.commits:
            latest = (self.directory / "latest").read_text(encoding="utf-8").strip()
            assert m.commits[-1].path is not None
            assert latest == Path(m.commits[-1].path).name, (
                f"latest names {latest}, the newest commit is {m.commits[-1]}"
            )
        if self.policy == "coalesce":
            assert Counter(self.ckpt.dropped) == m.dropped, (
                f"dropped {self.ckpt.dropped}, the model's {m.dropped}"
            )
        if not m.in_flight() and not m.failed_since_wait:
            # (A failed write's folder goes before wait() returns, maybe not sooner.)
            assert leftovers(self.directory) == [], (
                f"nothing in flight, yet {leftovers(self.directory)} remain"
            )
        for c in m.commits:
            self.verify(c)
        key = tuple((c.seq, self.verified.get(c.seq)) for c in m.commits)
        if key != self.newest_checked:

            async def newest() -> tuple[Any, dict[str, Any]]:
                target = fresh_state()
                try:
                    return await self.ckpt.restore(target), target
                except IntegrityError as exc:
                    return exc, target

            got, target = self.call(newest)
            self.check_restored(got, target, m.newest_good(), "restore()")
            self.newest_checked = key
        self.logs_seen = len(_log_records)
        self.broken = False

    def teardown(self) -> None:
        RUNS["sequences"] += 1
        broken = self.broken or not self.opened
        clean = False
        stopped = True
        try:
            if self.opened:
                for ctl in self.gates:
                    ctl.release.set()
                if not broken:
                    self.close_driver()
                    self.final_check()
                    clean = True
                elif self.driver is not None:
                    try:
                        self.driver.close(timeout=5)
                    except AssertionError:
                        pass
        finally:
            if self.loop is not None:
                stopped = self.loop.stop(cancel=not clean, timeout=TIMEOUT if clean else 5.0)
            for ctl in self.gates:
                ctl.release.set()
                GATES.pop(ctl.seq, None)
            if stopped:  # else a write may still run there: the folder is left behind
                shutil.rmtree(self.directory, ignore_errors=True)
        assert stopped, "the event loop did not stop after the Checkpointer closed (a task hangs)"

    def final_check(self) -> None:
        """A brand-new Checkpointer finds every commit, each bit-exact."""
        self.new_driver()
        steps = self.sync(self.ckpt.steps)
        assert steps == [c.step for c in self.model.commits], (
            f"reopened: steps() {steps}, model {self.model.commits}"
        )
        self.verified.clear()
        for c in self.model.commits:
            self.verify(c)
        assert self.driver is not None
        assert self.driver.close() is None


def _text(record: logging.LogRecord) -> str:
    text = record.getMessage()
    if record.exc_info and record.exc_info[1] is not None:
        text += " " + "".join(traceback.format_exception(record.exc_info[1]))
    return text


def _expected(record: logging.LogRecord) -> bool:
    """A log record this test caused on purpose (an injected failure, a corrupted step
    skipped by restore)."""
    text = _text(record)
    return "injected" in text or "does not verify" in text or "verif" in text


def _intact(target: dict[str, Any], c: Save) -> str:
    try:
        compare(target, c.expected, "")
    except AssertionError as exc:
        return f" (the values it loaded differ: {exc})"
    return " (its values are intact: the flipped byte is covered by no check)"


# -- the crash machine ------------------------------------------------------------------


def run_child_until_killed(
    directory: Path, config: dict[str, Any], delay: float, readers: int, check_reader: Callable[[], None]
) -> tuple[list[str], int | None]:
    """Start a saving child, let it run ``delay`` s after it is ready (opening
    ``readers`` Checkpointers here meanwhile), SIGKILL it; its output lines and exit."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), "loop", str(directory), json.dumps(config)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.strip())
            if line.strip() == "ready":
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        if not ready.wait(120):
            proc.kill()
            raise AssertionError(f"the child never got ready: {proc.communicate()[1]}")
        t0 = time.monotonic()
        for i in range(readers):
            time.sleep(max(0.0, t0 + delay * (i + 1) / (readers + 1) - time.monotonic()))
            check_reader()
        time.sleep(max(0.0, t0 + delay - time.monotonic()))
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        reader.join(30)
        stderr = proc.stderr.read() if proc.stderr is not None else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(30)
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
    assert proc.returncode == -signal.SIGKILL, (
        f"the child exited {proc.returncode}:\n{lines[-5:]}\n{stderr[-3000:]}"
    )
    assert not [x for x in lines if x.startswith("failure")], f"the child's save failed: {lines[-5:]}"
    return lines, proc.returncode


def retained(order: list[tuple[int, int]], keep: int, trim_last: bool = True) -> list[tuple[int, int]]:
    """The commits (seq, step) on disk after committing ``order`` with ``keep``: the
    last commit untrimmed when a crash came between its commit and its retention."""
    out: list[tuple[int, int]] = []
    for i, (seq, step) in enumerate(order):
        out = [c for c in out if c[1] != step]
        out.append((seq, step))
        if trim_last or i < len(order) - 1:
            out = out[-keep:]
    return out


class CrashMachine(RuleBasedStateMachine):
    """A child saves in a loop; Checkpointers opened here read while it writes; it is
    SIGKILLed; a reopen finds the commit sequence it reported, each step bit-exact, and
    none of its leftovers."""

    def __init__(self) -> None:
        super().__init__()
        self.directory = Path(tempfile.mkdtemp(prefix="ckpt-crash-"))
        self.on_disk: list[tuple[int, int]] = []
        self.seq0 = 1

    @initialize(data=st.data())
    def configure(self, data: st.DataObject) -> None:
        fmt = data.draw(st.sampled_from(["dcp", "torch"]), label="format")
        policy = data.draw(st.sampled_from(["wait", "skip"]), label="policy")
        budget = (
            data.draw(st.sampled_from([None, 2**18 + 8192]), label="host_budget_bytes")
            if fmt == "dcp"
            else None
        )
        self.config: dict[str, Any] = {
            "format": fmt,
            "policy": policy,
            "keep": data.draw(st.integers(1, 3), label="keep"),
            "max_in_flight": data.draw(st.integers(1, 3), label="max_in_flight"),
            "budget": budget,
            "incremental": fmt == "dcp" and data.draw(st.booleans(), label="incremental"),
        }

    def restore_all(self, steps: list[int]) -> list[tuple[int, int]]:
        """Restore each step with a new Checkpointer: the (seq, step) it holds, each
        bit-exact with ``build(seq)``."""
        directory, fmt = self.directory, self.config["format"]

        async def main() -> tuple[list[int], list[tuple[int, int]]]:
            out = []
            async with Checkpointer(
                directory, format=fmt, keep=self.config["keep"], checksum_threads=1
            ) as ckpt:
                listed = ckpt.steps()
                writers = [n for n in os.listdir(directory) if n.startswith(".writer-")]
                assert len(writers) == 1, f"reopened: writer lock files {writers} (one is this process's)"
                assert leftovers(directory) == [], (
                    f"reopened: the dead writer's {leftovers(directory)} remain"
                )
                for step in listed:
                    target = model_child.fresh()
                    assert await ckpt.restore(target, step=step) == step
                    seq = target["meta"]["seq"]
                    compare(target, snapshot(model_child.build(seq)), f"step {step} (save {seq})")
                    out.append((seq, step))
            return listed, out

        listed, out = anyio.run(main)
        assert steps == [] or listed == steps
        return out

    def read_while_writing(self) -> None:
        """A second Checkpointer (this process) restores the newest commit while the
        child writes: bit-exact if it returns one; a restore that raises is tolerated
        (retention may delete what it reads), a wrong one is not."""
        directory, fmt = self.directory, self.config["format"]

        async def main() -> None:
            async with Checkpointer(
                directory, format=fmt, keep=self.config["keep"], checksum_threads=1
            ) as other:
                target = model_child.fresh()
                try:
                    step = await other.restore(target)
                except CheckpointError:
                    return
                if step is not None:
                    seq = target["meta"]["seq"]
                    compare(target, snapshot(model_child.build(seq)), f"reader: step {step} (save {seq})")

        anyio.run(main)

    @rule(delay=st.floats(0.05, 1.5), readers=st.integers(0, 2), seed=st.integers(0, 2**16))
    def crash(self, delay: float, readers: int, seed: int) -> None:
        config = {**self.config, "seq0": self.seq0, "seed": seed}
        lines, _ = run_child_until_killed(self.directory, config, delay, readers, self.read_while_writing)
        calls = [(int(a), int(b)) for _, a, b in (x.split() for x in lines if x.startswith("call "))]
        rets = {int(x.split()[1]): x.split()[2] == "True" for x in lines if x.startswith("ret ")}
        commits = [int(x.split()[1]) for x in lines if x.startswith("commit ")]
        if calls:
            self.seq0 = calls[-1][0] + 1
        accepted = [(seq, step) for seq, step in calls if rets.get(seq, True)]
        assert [step for _, step in accepted[: len(commits)]] == commits, (
            f"commits reported {commits}, not in save-call order of {accepted}"
        )
        on_disk = self.restore_all([])
        seqs = [seq for seq, _ in on_disk]
        assert seqs == sorted(seqs), f"steps() is not in commit order: {on_disk}"
        base = self.on_disk + accepted[: len(commits)]
        rest = accepted[len(commits) :]
        keep = self.config["keep"]
        candidates = [
            retained(base + rest[:j], keep, trim) for j in range(len(rest) + 1) for trim in (True, False)
        ]
        assert on_disk in candidates, (
            f"after the kill the disk holds {on_disk} (seq, step); the reported commits "
            f"{base[-6:]} then any of {rest[:4]} allow {candidates[:4]}"
        )
        self.on_disk = on_disk

    def teardown(self) -> None:
        RUNS["crash_sequences"] += 1
        shutil.rmtree(self.directory, ignore_errors=True)


# -- the tests --------------------------------------------------------------------------

_HEALTH = list(HealthCheck)
_NO_SHRINK = [Phase.explicit, Phase.reuse, Phase.generate]


def machine(fmt: str) -> type[CheckpointerMachine]:
    return type(f"CheckpointerMachine_{fmt}", (CheckpointerMachine,), {"FORMATS": (fmt,)})


def _with_log_capture(run: Callable[[], None]) -> None:
    """Run a machine with the library's log captured, and ``Gate`` a type that
    ``torch.load(weights_only=True)`` accepts (so the torch format takes it at save;
    its copy pickles as a torch.Size anyway)."""
    logger = logging.getLogger("async_stager")
    handler = _Capture(logging.DEBUG)
    logger.addHandler(handler)
    try:
        with torch.serialization.safe_globals([Gate]):
            run()
    finally:
        logger.removeHandler(handler)
        _log_records.clear()
        for seq in list(GATES):
            GATES.pop(seq).release.set()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("fmt", ["dcp", "torch"])
def test_model(fmt: str) -> None:
    """The default run: a fixed set of examples (derandomized), about 10 s a format
    on a 2-core machine (the stress run: 150 random ones, shrunk)."""
    examples = 18 if fmt == "dcp" else 28
    cfg = settings(
        max_examples=examples,
        stateful_step_count=20,
        deadline=None,
        derandomize=True,
        # No shrinking here: a concurrent machine shrinks slowly (minutes) and flakily;
        # the failing sequence is printed as it ran (the stress run shrinks).
        phases=_NO_SHRINK,
        suppress_health_check=_HEALTH,
        print_blob=True,
    )
    _run_and_report(fmt, cfg)


@pytest.mark.stress
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("fmt", ["dcp", "torch"])
def test_model_stress(fmt: str) -> None:
    """The long run: random examples, longer sequences."""
    cfg = settings(
        max_examples=150,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=_HEALTH,
        print_blob=True,
    )
    _run_and_report(fmt, cfg)


def _run_and_report(fmt: str, cfg: settings) -> None:
    before = Counter(RUNS)
    t0 = time.monotonic()
    _with_log_capture(lambda: run_state_machine_as_test(machine(fmt), settings=cfg))
    ran = RUNS - before
    print(
        f"model[{fmt}]: {ran['sequences']} sequences, {ran['checks']} rules checked, "
        f"{time.monotonic() - t0:.1f} s"
    )


@pytest.mark.timeout(600)
def test_crash_machine() -> None:
    """A few SIGKILLs of a saving child (each costs a process start)."""
    cfg = settings(
        max_examples=2,
        stateful_step_count=2,
        deadline=None,
        derandomize=True,
        phases=_NO_SHRINK,
        suppress_health_check=_HEALTH,
        print_blob=True,
    )
    before = Counter(RUNS)
    run_state_machine_as_test(CrashMachine, settings=cfg)
    print(f"crash machine: {(RUNS - before)['crash_sequences']} sequences")


@pytest.mark.stress
@pytest.mark.timeout(3600)
def test_crash_machine_stress() -> None:
    cfg = settings(
        max_examples=12,
        stateful_step_count=4,
        deadline=None,
        suppress_health_check=_HEALTH,
        print_blob=True,
    )
    before = Counter(RUNS)
    run_state_machine_as_test(CrashMachine, settings=cfg)
    print(f"crash machine: {(RUNS - before)['crash_sequences']} sequences")


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("fmt", "budget"),
    # Each value of each axis in the default run; the third pair in CI's second call.
    [("torch", None), ("dcp", 2**19), pytest.param("dcp", None, marks=pytest.mark.slow)],
)
def test_disk_full_in_a_child(tmp_path: Path, fmt: str, budget: int | None) -> None:
    """A write that fails for want of space (RLIMIT_FSIZE: EFBIG): raised once as a
    CheckpointError by the next wait() and by the next save(), no temporary folder
    left, the caller's own task not cancelled, and the next save commits."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [
            sys.executable,
            str(CHILD),
            "fsize",
            str(tmp_path / "ckpt"),
            fmt,
            *([str(budget)] if budget else []),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (
        out["wait"] is not None and out["wait"]["type"] in ("CheckpointError",) and out["wait"]["step"] == 2
    ), out
    assert out["wait_again"] is None, f"a failure raised twice: {out}"
    assert not [n for n in out["after_wait"] if n.startswith(".tmp-")], f"after wait(): {out['after_wait']}"
    assert out["save"] is not None and out["save"]["step"] == 3, f"the next save() did not raise: {out}"
    assert out["steps"] == [1, 5], out
    assert not [n for n in out["final"] if n.startswith((".tmp-", ".del-", ".old-"))], out
    assert not out["cancelled"], "the caller's task was cancelled"


def test_gate_value_restores_as_a_plain_value() -> None:
    """The test's own gate: its copy pickles as a torch.Size that torch.load(weights_only)
    accepts, after its release."""
    import io

    seq = next(SEQ)
    ctl = GATES[seq] = GateCtl(seq, False)
    try:
        copied = copy.deepcopy(Gate(seq))
        assert copied.copy and not ctl.entered.is_set()
        ctl.release.set()
        buf = io.BytesIO()
        torch.save({"g": copied}, buf)
        buf.seek(0)
        assert torch.load(buf, weights_only=True) == {"g": torch.Size((GATE_TAG, seq))}
    finally:
        GATES.pop(seq, None)


# -- sequences the machines found, replayed as they were -------------------------------


def replay(
    fmt: str,
    backend: str,
    policy: str,
    mif: int,
    keep: int,
    budget: int | None,
    steps: list[tuple[str, dict[str, Any]]],
) -> None:
    """Run one rule sequence on the machine (its checks after every step), as
    hypothesis would: a failure the machines found, kept as a regression test."""

    def body() -> None:
        m = machine(fmt)()
        m.start(fmt, backend, policy, mif, keep, budget)
        m.opened = True
        try:
            m.check()
            for name, kwargs in steps:
                getattr(m, name)(**kwargs)
                m.check()
        finally:
            m.teardown()

    _with_log_capture(body)


def _plain(step: int, hold: bool = False, fail: bool = False) -> tuple[str, dict[str, Any]]:
    return ("save", {"step": step, "kind": "plain", "hold": hold, "fail": fail, "delay": 0.0})


@pytest.mark.timeout(120)
def test_replay_coalesce_cancelled_after_its_stage_keeps_the_queued_save() -> None:
    """Coalesce, two writes held and a save queued: saves cancelled at various moments
    after their call. One cancelled after its stage finished (it had replaced the
    queued save) but before save() returned must save nothing and leave the queued
    save to be written (found dropping both, asyncio)."""
    delays = DELAYS * 12
    replay(
        "torch",
        "asyncio",
        "coalesce",
        2,
        1,
        None,
        [
            _plain(1, hold=True),
            _plain(2, hold=True),
            _plain(3, hold=True),
            *[
                ("save", {"step": 8, "kind": "cancelled", "hold": True, "fail": False, "delay": d})
                for d in delays
            ],
        ],
    )


@pytest.mark.timeout(120)
def test_replay_coalesce_concurrent_saves_keep_one_queued() -> None:
    """Coalesce with one write held: three saves called at once (trio runs them in a
    random order, so their stages finish in any order). Only the newest stays queued;
    the others are dropped, and none waits for the held write (found: two stayed
    queued, and the third found no buffer set and waited)."""
    steps: list[tuple[str, dict[str, Any]]] = []
    for _ in range(5):
        steps += [
            _plain(1, hold=True),
            ("concurrent_saves", {"n": 3, "steps": [2, 3, 5], "holds": [True, True, True]}),
            ("wait", {}),
        ]
    replay("dcp", "trio", "coalesce", 1, 2, None, steps)


@pytest.mark.timeout(120)
def test_replay_every_failed_write_is_raised() -> None:
    """Writes fail while others are held, then those fail too: each failure is raised
    once, by the next save()/wait() calls (found: while one failure waited to be
    raised, the later ones were only logged, never raised)."""
    replay(
        "torch",
        "asyncio",
        "wait",
        3,
        3,
        None,
        [
            _plain(3),
            _plain(2, fail=True),
            _plain(8, hold=True, fail=True),
            _plain(3, hold=True, fail=True),
            _plain(5, fail=True),
            ("wait", {}),
        ],
    )


class _KeepRecords(logging.Handler):
    """A handler that keeps records whole, exc_info included (as pytest's caplog,
    or an error reporter, does)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["dcp", "torch"])
@pytest.mark.anyio
async def test_a_kept_failure_record_does_not_stall_saves(
    tmp_path: Path, fmt: Any, anyio_backend: Any
) -> None:
    """A write that failed is logged, the exception in the record; a handler that
    keeps the record keeps the exception's traceback, so the failed write's frames,
    reachable. The next saves must still stage at once (found: those frames held the
    staged copy's buffer set, and the next stage waited for it: 60 s, then
    BuffersHeldError)."""
    handler = _KeepRecords()
    logger = logging.getLogger("async_stager")
    logger.addHandler(handler)
    gates: list[GateCtl] = []
    try:
        with torch.serialization.safe_globals([Gate]):
            async with Checkpointer(tmp_path, format=fmt, checksum_threads=1) as ckpt:
                for i in range(3):
                    seq = next(SEQ)
                    ctl = GATES[seq] = GateCtl(seq, fail=True)
                    ctl.release.set()
                    gates.append(ctl)
                    # Hang guards (the failure was a 60 s wait); a loaded machine took over 5 s.
                    with anyio.fail_after(40):
                        await ckpt.save({"w": torch.full((1024,), float(i)), "g": Gate(seq)}, step=i)
                    with pytest.raises(CheckpointError):
                        await ckpt.wait()
                with anyio.fail_after(40):
                    await ckpt.save({"w": torch.ones(1024), "g": torch.Size((GATE_TAG, 0))}, step=9)
                    await ckpt.wait()
                assert ckpt.steps() == [9]
        assert handler.records, "the failures were not logged"
    finally:
        logger.removeHandler(handler)
        for ctl in gates:
            GATES.pop(ctl.seq, None)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["dcp", "torch"])
def test_replay_a_flipped_header_byte_of_a_stored_tensor_is_caught(fmt: str) -> None:
    """Byte 10 of a stored tensor item (in DCP: the zip ``torch.save`` wraps each
    tensor in, whose local header's time field no reader checks; in the torch format:
    the same field of a tensor's zip record) flipped: restore must not return that
    step (found, DCP: it restored, the values intact, the damage unnoticed)."""

    def body() -> None:
        m = machine(fmt)()
        m.start(fmt, "asyncio", "wait", 1, 2, None)
        m.opened = True
        try:
            m.save(step=1, kind="plain", hold=False, fail=False, delay=0.0)
            m.save(step=2, kind="plain", hold=False, fail=False, delay=0.0)
            m.check()
            newest = m.model.commits[-1]
            assert newest.path is not None
            ranges = byte_ranges(Path(newest.path), "tensor")
            m.corrupt(pick=1, kind="tensor", where=len(ranges) * 10, flip=0x4C)
            m.check()
        finally:
            m.teardown()

    _with_log_capture(body)
