"""Options and their machine-dependent defaults.

Options are resolved once, at construction, into a frozen StagerOptions: ``None`` means
"what this machine supports" (pinning and non-blocking copies need CUDA). Asking
explicitly for a CUDA-only feature on a machine without CUDA is an UnsupportedError
there and then, not a surprise at the first checkpoint.

Every option is checked here, in one place (``StagerOptions.__post_init__``, which runs
for ``Stager``, ``DefaultStager``, ``resolve_options``, ``StagerOptions(...)`` and
``StagerOptions.replace``): a bad type or value is an :class:`InvalidOptionError` that
names the option, the value given and what is allowed, raised before any thread or
buffer exists, so no bad option can fail (or hang) later. A value of the wrong type is
an :class:`InvalidOptionTypeError`, which is also a ``TypeError``; a value out of range
is an :class:`InvalidOptionError`, also a ``ValueError``. Both are UnsupportedErrors
(and so StagingErrors).

Integers are real integers (``int``, or what ``operator.index`` accepts, such as numpy
integers): ``bool``, ``float`` (even ``2.0``), strings and tensors are refused.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator
import os
import reprlib
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

import torch

from async_stager.errors import InvalidOptionError, InvalidOptionTypeError, UnsupportedError

__all__ = [
    "AUTO",
    "InvalidOptionError",
    "InvalidOptionTypeError",
    "StagerOptions",
    "auto_copy_threads",
    "cuda_available",
    "resolve_options",
]

#: Source storages up to this many bytes are batched on an accelerator: gathered on the
#: device by one fused kernel per dtype, then moved to the host by one copy per run.
DEFAULT_SMALL_TENSOR_BYTES = 64 * 1024
#: Upper bound of the device scratch memory (bytes) kept per plan for that batching.
DEFAULT_SCRATCH_BYTES = 256 * 1024 * 1024
#: Seconds a stage waits for a free buffer set before BuffersHeldError.
DEFAULT_BUFFER_WAIT_TIMEOUT = 60.0


#: Worker niceness range (Linux): -20 (highest priority; needs privileges, else ignored)
#: to 19 (lowest).
NICE_MIN, NICE_MAX = -20, 19
#: Most copy threads a stager may use: more than the cores only adds contention, and
#: OpenMP runtimes take the count as a C int.
MAX_COPY_THREADS = 1024


_repr = reprlib.Repr()
_repr.maxstring = 60
_repr.maxother = 60


def _shown(value: object) -> str:
    return _repr.repr(value)


def _wrong_type(name: str, value: object, allowed: str) -> InvalidOptionTypeError:
    return InvalidOptionTypeError(
        f"{name} must be {allowed}, got {_shown(value)} of type {type(value).__name__}"
    )


def _out_of_range(name: str, value: object, allowed: str) -> InvalidOptionError:
    return InvalidOptionError(f"{name} must be {allowed}, got {_shown(value)}")


def check_bool(name: str, value: object, *, none_means: str | None = None) -> bool | None:
    """``value`` if it is True or False (or None, when ``none_means`` says what None is);
    anything else, ``"yes"`` or ``1`` included, is an InvalidOptionTypeError."""
    if isinstance(value, bool):
        return value
    if value is None and none_means is not None:
        return None
    allowed = "True or False" if none_means is None else f"True, False or None ({none_means})"
    raise _wrong_type(name, value, allowed)


def check_int(name: str, value: object, minimum: int, maximum: int | None = None, *, also: str = "") -> int:
    """``value`` as an int within ``minimum..maximum``; bools, floats (``2.0`` too),
    strings and tensors are refused (InvalidOptionTypeError), values out of the range are
    an InvalidOptionError. ``also``: what else the option allows, for the message."""
    if maximum is None:
        allowed = f"an integer >= {minimum}"
    else:
        allowed = f"an integer from {minimum} to {maximum}"
    if also:
        allowed = f"{allowed} {also}"
    if isinstance(value, (bool, torch.Tensor)):
        raise _wrong_type(name, value, allowed)
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise _wrong_type(name, value, allowed) from None
    if number < minimum or (maximum is not None and number > maximum):
        raise _out_of_range(name, value, allowed)
    return number


def check_text(name: str, value: object) -> str | None:
    """``value`` if it is None or a non-empty string (a path or a name); an ``os.PathLike``
    becomes its string."""
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise _wrong_type(name, value, "a non-empty string, or None")
    if not value:
        raise _out_of_range(name, value, "a non-empty string, or None")
    return value


def check_seconds(name: str, value: object, *, maximum: float | None = None, zero_ok: bool = False) -> float:
    """``value`` as a float of seconds: a real number (int or float, not bool), not NaN,
    > 0 (>= 0 with ``zero_ok``) and <= ``maximum`` (None: infinity allowed)."""
    bounds = ">= 0" if zero_ok else "> 0"
    if maximum is not None:
        allowed = f"a finite number of seconds {bounds} and <= {maximum:g}"
    else:
        allowed = f"a number of seconds {bounds} (inf: no limit)"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _wrong_type(name, value, allowed)
    seconds = float(value)
    if math.isnan(seconds) or seconds < 0 or (seconds == 0 and not zero_ok):
        raise _out_of_range(name, value, allowed)
    if maximum is not None and not seconds <= maximum:
        raise _out_of_range(name, value, allowed)
    return seconds


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def loop_friendly_threads() -> int:
    """Copy threads that leave one core to the event loop (at least one, at most
    torch's intra-op thread count): ``Stager``'s default ``copy_threads``."""
    return max(1, min(torch.get_num_threads(), usable_cores() - 1))


#: ``copy_threads="auto"``: decided per copy program (``auto_copy_threads``).
AUTO = "auto"
#: Under ``"auto"``, a program copies with every core when at least this share of its
#: bytes is in tensors big enough to be cut into pieces (copied without the GIL at
#: memory bandwidth, where a second thread nearly doubles the speed); else with all
#: cores but one (the loop's), whose lag is then what a single copy thread costs.
AUTO_BIG_SHARE = 0.75


def auto_copy_threads(big_bytes: int, total_bytes: int, *, first: bool = False) -> int:
    """Threads for one copy program under ``copy_threads="auto"``: every core for a
    program mostly of big tensors (``big_bytes`` of ``total_bytes``, see
    ``AUTO_BIG_SHARE``), or for a first stage into new memory (``first``: page faults,
    which cores take in parallel), else ``loop_friendly_threads()``. The measured
    trade-off is in docs/benchmarks.md."""
    if first or (total_bytes > 0 and big_bytes >= AUTO_BIG_SHARE * total_bytes):
        return max(1, min(torch.get_num_threads(), usable_cores()))
    return loop_friendly_threads()


def cuda_available() -> bool:
    """True when torch was built with CUDA and a device is visible."""
    return bool(torch.cuda.is_available())


@dataclass(frozen=True, kw_only=True)
class StagerOptions:
    """How a stager stages; built by :func:`resolve_options`, never changed afterwards.
    The one source of every option's default (``Stager`` and ``DefaultStager`` take
    theirs from here); keyword-only.

    - ``pin_memory``: host arenas are registered with CUDA (one registration per arena),
      so device-to-host copies run at full bandwidth and can be asynchronous.
    - ``share_memory``: host arenas live in shared memory (one memfd per arena), so a
      writer process can map the staged tensors without a copy (see ``export``).
    - ``non_blocking``: device-to-host copies are enqueued on a dedicated stream and
      completion is found by polling an event; False copies synchronously.
    - ``max_buffer_sets``: how many independent sets of host buffers a stager may hold;
      a stage never writes into a set that is leased (see ``Stager.snapshot``).
    - ``small_tensor_bytes``: storages up to this size (bytes) are batched on a device.
    - ``scratch_bytes``: device scratch memory (bytes) per plan for that batching (a
      buffer set keeps up to four plans, one per state dict layout).
    - ``yield_interval``: the longest the event loop should wait for the GIL while the
      worker runs Python (seconds); applied as the interpreter's switch interval during
      staging (see docs/design.md).
    - ``worker_nice``: niceness added to the worker thread (Linux), 0 to leave it; the
      event loop then preempts host copies at once (see docs/design.md).
    - ``copy_threads``: threads for host-to-host copies, the worker and ``n - 1``
      helpers (see ``_hostcopy``); None: torch's intra-op thread count (what
      ``DefaultStager`` uses); ``"auto"`` (``Stager``'s default): decided per copy
      program, see ``auto_copy_threads``.
    - ``buffer_wait_timeout``: seconds a stage waits for a free buffer set before
      BuffersHeldError; None: for ever.
    - ``preflight``: before host memory is mapped (at ``reserve()``, and at the first
      stage into each buffer set), check that it fits this process's limits and raise
      HostLimitError if not (see ``_preflight``); False skips the check.
    - ``node_budget_bytes``: one host-memory budget (bytes) for every process of the
      job on this machine: each host arena is reserved from the node ledger before it
      is mapped and given back when it is unmapped (see ``_core/memory/ledger.py``);
      None (the default): no node budget. Every rank of the node must give the same.
    - ``node_budget_path``: the ledger's directory (default: one under ``/dev/shm``
      named from the job's identity); ``node_budget_job``: that identity (default:
      ``TORCHELASTIC_RUN_ID``, else ``MASTER_ADDR:MASTER_PORT``).

    Every field is checked at construction (and so by ``replace``):

    - ``pin_memory``, ``share_memory``, ``non_blocking``: True or False
      (``resolve_options``, ``Stager`` and ``DefaultStager`` also take None for
      ``pin_memory`` and ``non_blocking``: what this machine supports).
    - ``max_buffer_sets``: an integer >= 1.
    - ``small_tensor_bytes``, ``scratch_bytes``: integers >= 0.
    - ``yield_interval``: a finite number of seconds, > 0 and <= 1.
    - ``worker_nice``: an integer from -20 to 19.
    - ``copy_threads``: an integer from 1 to 1024, or None.
    - ``buffer_wait_timeout``: a number of seconds >= 0 (``inf`` allowed), or None.
    - ``preflight``: True or False.
    - ``node_budget_bytes``: an integer >= 1, or None; ``node_budget_path``,
      ``node_budget_job``: a non-empty string, or None.

    Integers exclude bools and floats (``2.0`` too). A value of the wrong type raises
    :class:`InvalidOptionTypeError` (also a ``TypeError``), one out of range
    :class:`InvalidOptionError` (also a ``ValueError``); both are UnsupportedErrors, and
    the message names the option, the value and what is allowed. Accepted values are
    normalized (a numpy integer becomes an ``int``, an int ``yield_interval`` a float).
    """

    pin_memory: bool
    non_blocking: bool
    share_memory: bool = False
    max_buffer_sets: int = 2
    small_tensor_bytes: int = DEFAULT_SMALL_TENSOR_BYTES
    scratch_bytes: int = DEFAULT_SCRATCH_BYTES
    yield_interval: float = 0.0002
    worker_nice: int = 5
    copy_threads: int | Literal["auto"] | None = None
    buffer_wait_timeout: float | None = DEFAULT_BUFFER_WAIT_TIMEOUT
    preflight: bool = True
    node_budget_bytes: int | None = None
    node_budget_path: str | None = None
    node_budget_job: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    def replace(self, **changes: object) -> StagerOptions:
        """A copy with some fields changed (validated again)."""
        _check_names(changes)
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def validate(self) -> None:
        """Check every field (see the class doc); raises InvalidOptionError naming the
        first bad one. Normalizes accepted values in place (numpy ints to int)."""
        fields: dict[str, Any] = {
            "pin_memory": check_bool("pin_memory", self.pin_memory),
            "share_memory": check_bool("share_memory", self.share_memory),
            "non_blocking": check_bool("non_blocking", self.non_blocking),
            "max_buffer_sets": check_int("max_buffer_sets", self.max_buffer_sets, 1),
            "small_tensor_bytes": check_int("small_tensor_bytes", self.small_tensor_bytes, 0),
            "scratch_bytes": check_int("scratch_bytes", self.scratch_bytes, 0),
            "yield_interval": check_seconds("yield_interval", self.yield_interval, maximum=1.0),
            "worker_nice": check_int("worker_nice", self.worker_nice, NICE_MIN, NICE_MAX),
            "preflight": check_bool("preflight", self.preflight),
            "node_budget_bytes": None
            if self.node_budget_bytes is None
            else check_int("node_budget_bytes", self.node_budget_bytes, 1, also="or None (no node budget)"),
            "node_budget_path": check_text("node_budget_path", self.node_budget_path),
            "node_budget_job": check_text("node_budget_job", self.node_budget_job),
            "buffer_wait_timeout": None
            if self.buffer_wait_timeout is None
            else check_seconds("buffer_wait_timeout", self.buffer_wait_timeout, zero_ok=True),
            "copy_threads": self.copy_threads
            if self.copy_threads is None or self.copy_threads == AUTO
            else check_int(
                "copy_threads", self.copy_threads, 1, MAX_COPY_THREADS, also="'auto', or None (the default)"
            ),
        }
        for name, value in fields.items():
            if getattr(self, name) is not value:
                object.__setattr__(self, name, value)


#: The options ``resolve_options`` (and so ``DefaultStager``) takes.
OPTION_NAMES = tuple(f.name for f in dataclasses.fields(StagerOptions))


def _check_names(given: dict[str, object]) -> None:
    unknown = sorted(set(given) - set(OPTION_NAMES))
    if unknown:
        raise InvalidOptionTypeError(
            f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
            f"the options are: {', '.join(OPTION_NAMES)}"
        )


#: A backend's pinner (``memory.arena.Pinner``, in a layer above).
PinnerT = TypeVar("PinnerT")
_PinnerT_co = TypeVar("_PinnerT_co", covariant=True)


class Seam(Protocol[_PinnerT_co]):
    """What ``resolve_options`` asks of the device seam (a ``copy.device.Backend``, in
    a layer above): whether its copies are asynchronous, and its pinner."""

    @property
    def asynchronous(self) -> bool: ...

    def pinner(self) -> _PinnerT_co | None: ...


def resolve_options(
    backend: Seam[PinnerT], pinner: PinnerT | None = None, /, **given: object
) -> tuple[StagerOptions, PinnerT | None]:
    """The options of a stager on ``backend``, and the pinner it pins with (None: not
    pinning). The one place ``None`` is resolved and a machine limit reported.

    ``given`` are StagerOptions fields (unknown names are an InvalidOptionTypeError);
    what is not given takes StagerOptions' default, so the defaults live only there.
    ``pin_memory`` and ``non_blocking`` may be None: what the backend can do
    (``Backend.pinner()``, ``Backend.asynchronous``). ``pinner``, when given, replaces
    the backend's own (a fake, in tests). Every option is checked (see StagerOptions)
    before a machine limit is reported: asking for pinning or non-blocking copies the
    backend cannot do is an UnsupportedError.
    """
    _check_names(given)
    # Types first: a truthy non-bool ("yes", 1) must not pass for True below.
    pin_memory = check_bool(
        "pin_memory", given.pop("pin_memory", None), none_means="what this machine supports"
    )
    non_blocking = check_bool(
        "non_blocking", given.pop("non_blocking", None), none_means="what this machine supports"
    )
    check_bool("share_memory", given.get("share_memory", False))
    if pinner is None:
        pinner = backend.pinner()
    if pin_memory is None:
        pin_memory = pinner is not None
    if non_blocking is None:
        non_blocking = backend.asynchronous
    # Everything else is checked before a machine limit is reported.
    opts = StagerOptions(pin_memory=pin_memory, non_blocking=non_blocking, **given)  # type: ignore[arg-type]
    if opts.pin_memory and pinner is None:
        raise UnsupportedError(
            "pin_memory=True needs CUDA, and no CUDA device is available (or the device "
            "backend cannot pin: Backend.pinner() is None; pass pinner=...)"
        )
    if opts.non_blocking and not backend.asynchronous:
        raise UnsupportedError("non_blocking=True needs CUDA, and no CUDA device is available")
    if opts.share_memory and not hasattr(os, "memfd_create") and not os.path.isdir("/dev/shm"):
        raise UnsupportedError("share_memory=True needs memfd_create or /dev/shm")
    return opts, pinner if opts.pin_memory else None
