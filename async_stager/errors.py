"""The error hierarchy: every failure async_stager raises on purpose is a StagingError.

Errors that concern one place in the state dict carry that place as ``path`` (a tuple of
keys and attribute names from the root) and show it as ``sd['optim']['state'][3]``.
The original exception, where there is one, is chained as ``__cause__``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "AcceleratorRequiredError",
    "AgentError",
    "AgentRefusedError",
    "AgentTimeoutError",
    "AgentUnavailableError",
    "BudgetTooSmallError",
    "BuffersHeldError",
    "CheckpointError",
    "ClosedError",
    "CopyError",
    "DeviceTimeoutError",
    "HostAllocationError",
    "HostLimitError",
    "IntegrityError",
    "InvalidOptionError",
    "InvalidOptionTypeError",
    "InvalidStateDictError",
    "NestingError",
    "NodeBudgetError",
    "PinningError",
    "StagingError",
    "StoreError",
    "UncopyableObjectError",
    "UnsupportedError",
    "UnsupportedTensorError",
    "format_path",
]


class Attr(str):
    """A path step that is an attribute (``.name``) rather than a key (``[key]``)."""

    __slots__ = ()


class Nth:
    """A path step to the ``index``-th object that iterating a container gives, where
    no key or attribute reaches it (a set member, a dict's key itself). Shown as
    Python that evaluates to it: ``list(sd['s'])[3]``."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"Nth({self.index})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Nth) and other.index == self.index

    def __hash__(self) -> int:
        return hash((Nth, self.index))


def format_path(path: Sequence[Any], root: str = "sd") -> str:
    """Render a path from the root as Python source: ``sd['optim']['state'][3].exp_avg``,
    ``list(sd['tags'])[2]`` for a set member."""
    out = root
    for step in path:
        if isinstance(step, Attr):
            out += f".{step}"
        elif isinstance(step, Nth):
            out = f"list({out})[{step.index}]"
        else:
            out += f"[{step!r}]"
    return out


class StagingError(Exception):
    """Base of every error async_stager raises on purpose.

    ``path`` is the place in the state dict the error concerns (empty when it concerns
    the stager as a whole; ``()`` is the root itself). The stager stays usable after any StagingError except
    ClosedError, which says it was closed.
    """

    def __init__(self, message: str, *, path: Sequence[Any] | None = None) -> None:
        self.path: tuple[Any, ...] | None = None if path is None else tuple(path)
        self.message = message
        super().__init__(message)

    def __str__(self) -> str:
        if self.path is None:
            return self.message
        return f"{format_path(self.path)}: {self.message}"


class ClosedError(StagingError):
    """The stager was closed; it cannot stage again."""


class BuffersHeldError(StagingError):
    """A stage waited ``buffer_wait_timeout`` seconds and every buffer set was still
    held: leased, or holding a staged result that is still reachable. Nothing was
    staged; the stager stays usable once a result is dropped or a lease released."""


class UnsupportedError(StagingError):
    """An option or feature this machine or this torch build cannot provide."""


class InvalidOptionError(UnsupportedError, ValueError):
    """An option with a value it does not allow (also a ValueError); the message names
    the option, the value given and what is allowed."""


class InvalidOptionTypeError(InvalidOptionError, TypeError):
    """An option with a value of the wrong type (also a TypeError)."""


class UnsupportedTensorError(StagingError):
    """A tensor that cannot be staged faithfully: meta, sparse, quantized, nested,
    freed storage (no data but elements), or a second accelerator device."""


class CheckpointError(StagingError):
    """A Checkpointer could not write, commit or restore a checkpoint; ``step`` names it
    (None when the failure concerns no one step). The cause is chained."""

    def __init__(self, message: str, *, step: int | None = None, path: Sequence[Any] | None = None) -> None:
        super().__init__(message, path=path)
        self.step = step


class IntegrityError(CheckpointError):
    """A committed checkpoint's data does not match the checksums taken from the staged
    copy when it was saved (or its checksums are missing): ``step`` and ``tensor`` (the
    flattened DCP name, e.g. ``model.layers.0.weight``) say where."""

    def __init__(self, message: str, *, step: int | None, tensor: str | None = None) -> None:
        super().__init__(message, step=step)
        self.tensor = tensor


class StoreError(CheckpointError):
    """An object store (``s3://bucket/prefix``, or a folder through the same interface)
    could not do what was asked. ``key`` names the object (its full URL, e.g.
    ``s3://bucket/run/step-10/rank0``) or the prefix; ``reason`` is a short code:
    ``"denied"`` (a write or read refused: 403 AccessDenied, a read-only folder),
    ``"credentials"`` (none found, or the store refused them), ``"quota"`` (a full
    bucket quota or disk), ``"unavailable"`` (transient errors, 503 SlowDown, 500,
    reset connections, still failing after ``tries`` attempts), ``"exists"`` (a
    conditional write found the object there), ``"missing"`` (no such object or
    bucket), ``"request"`` (any other refusal), ``"closed"`` (the store was closed).
    ``code`` is the store's own error code (``"SlowDown"``, ``"AccessDenied"``,
    ``"ENOSPC"``). The message is one line; the cause is chained."""

    def __init__(
        self, message: str, *, key: str = "", reason: str = "", code: str = "", tries: int = 0
    ) -> None:
        super().__init__(message)
        self.key = key
        self.reason = reason
        self.code = code
        self.tries = tries


class AcceleratorRequiredError(UnsupportedError, AssertionError):
    """A CUDA-only feature (``use_pinned_memory``, ``use_non_blocking_copy``) asked for
    where CUDA is not available. Also an AssertionError: torch_checkpointing's
    DefaultStager asserts the same condition, and callers catch that."""


class UncopyableObjectError(StagingError):
    """A non-tensor object in the state dict that cannot be copied (its reduce or copy
    raised); the original exception is the cause."""


class InvalidStateDictError(StagingError, TypeError):
    """What was given to stage is not a state dict (also a TypeError): a plain value
    with nothing to stage at its top (None, a number, a string), a torch.nn.Module or
    optimizer inside it (its ``state_dict()`` is the state), or, for ``dcp.save``,
    anything but a dict. ``path`` names where; nothing was staged, and the stager stays
    usable."""


class NestingError(UncopyableObjectError):
    """The structure is nested too deeply to walk (beyond Python's recursion limit)."""


class HostAllocationError(StagingError):
    """Host memory for a staging buffer could not be had (memory, /dev/shm full)."""


class HostLimitError(HostAllocationError):
    """Pre-flight: what staging this state needs does not fit a limit of this process or
    machine (memory, a cgroup's memory limit, RLIMIT_MEMLOCK, /dev/shm, RLIMIT_FSIZE,
    RLIMIT_NOFILE), found before anything was allocated. The stager stays usable.

    ``resource`` names the limit (``"RLIMIT_NOFILE"``, ``"cgroup v2 memory.max"``...),
    ``need`` and ``limit`` are in ``unit`` (``"bytes"`` or ``"descriptors"``; ``limit``
    is what is left of the limit for this stager), ``fix`` says what to change, and
    ``report`` (a ``PreflightReport``) holds every row checked."""

    def __init__(
        self,
        message: str,
        *,
        resource: str = "",
        need: int = 0,
        limit: int = 0,
        unit: str = "bytes",
        fix: str = "",
        report: Any = None,
    ) -> None:
        # Defaults only so that pickle (which calls the class with the message, then
        # restores the attributes) can rebuild it in another process.
        super().__init__(message)
        self.resource = resource
        self.need = need
        self.limit = limit
        self.unit = unit
        self.fix = fix
        self.report = report


class NodeBudgetError(HostLimitError):
    """The node-wide host-memory budget (``node_budget_bytes``, shared by the ranks of
    one machine through a node ledger) cannot give ``need`` bytes: either at once,
    because ``need`` is more than the whole budget (``limit``; ``waited`` is 0), or
    within the wait's bound (``waited`` seconds, in ticket order). ``what`` says what
    the bytes were for, ``holders`` maps each pid holding bytes of the budget to its
    bytes, and ``resource`` starts with ``"node budget"``. Also raised by the pre-flight
    (``reserve()``, a first stage) for a need the whole budget cannot hold, with its
    ``report``. Nothing was reserved; the stager (or the caller) stays usable."""

    def __init__(
        self,
        message: str,
        *,
        need: int = 0,
        limit: int = 0,
        fix: str = "",
        what: str = "",
        waited: float = 0.0,
        holders: dict[int, int] | None = None,
        resource: str = "node budget",
        unit: str = "bytes",
        report: Any = None,
    ) -> None:
        super().__init__(
            message, resource=resource, need=need, limit=limit, unit=unit, fix=fix, report=report
        )
        self.what = what
        self.waited = waited
        self.holders: dict[int, int] = dict(holders or {})


class PinningError(HostAllocationError):
    """Host memory could not be registered (pinned) with the accelerator."""


class CopyError(StagingError):
    """A device-to-host or host-to-host copy failed; the original error is the cause."""


class DeviceTimeoutError(CopyError, TimeoutError):
    """Copies on a device did not complete within their bound (``seconds``): the device
    looks wedged (a kernel that never ends, an Xid error; see nvidia-smi). The copies'
    host buffers stay reserved until they are seen to complete; the stager stays
    usable (a later stage takes another buffer set, or waits for this one)."""

    def __init__(self, message: str, *, seconds: float = 0.0) -> None:
        super().__init__(message)
        self.seconds = seconds


class BudgetTooSmallError(StagingError, ValueError):
    """What a budgeted save cannot cut into pieces is bigger than its
    ``host_budget_bytes``: a tensor item (a DTensor's local shard), a non-tensor value's
    pickle, or a device tensor inside such a value. Raised at the ``dcp.save`` call,
    before anything is staged, where it can be seen without pickling; otherwise by the
    save when the value is serialized, before any metadata is written. ``path`` names
    the tensor or value and ``needed_bytes`` is the smallest budget that fits it."""

    def __init__(self, message: str, *, path: Sequence[Any] | None = None, needed_bytes: int = 0) -> None:
        super().__init__(message, path=path)
        self.needed_bytes = needed_bytes


class AgentError(StagingError):
    """The memory tier's node agent (``python -m async_stager agent``) could not do what
    was asked; ``socket`` names the agent's socket path. Nothing is lost on the
    trainer's side: a snapshot the agent did not accept is not restorable from it."""

    def __init__(self, message: str, *, socket: str = "") -> None:
        super().__init__(message)
        self.socket = socket


class AgentUnavailableError(AgentError):
    """No agent answers at the socket (none started, it exited or was killed), or the
    connection to it broke mid-call."""


class AgentTimeoutError(AgentError, TimeoutError):
    """A call to the agent did not complete within its bound (``seconds``); the
    connection is closed (a late answer is never taken for the next call's)."""

    def __init__(self, message: str, *, socket: str = "", seconds: float = 0.0) -> None:
        super().__init__(message, socket=socket)
        self.seconds = seconds


class AgentRefusedError(AgentError):
    """The agent answered but refused: another user's connection, another protocol
    version, a snapshot over its memory bound, checksums that do not verify, or an
    unknown snapshot; ``reason`` is its short code (``"peer"``, ``"version"``,
    ``"memory"``, ``"checksum"``, ``"unknown"``, ``"request"``)."""

    def __init__(self, message: str, *, socket: str = "", reason: str = "") -> None:
        super().__init__(message, socket=socket)
        self.reason = reason
