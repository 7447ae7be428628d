"""A Checkpointer's options and the statistics of one commit (frozen records)."""

from __future__ import annotations

import os
import re
import urllib.parse
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from async_stager.errors import InvalidOptionError, InvalidOptionTypeError

#: ``scheme://`` at the start of a directory given as a string (RFC 3986's scheme).
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")

if TYPE_CHECKING:
    from async_stager._core.aio.stager import Stager
    from async_stager._dcp.budget import BudgetStats

__all__ = [
    "CheckpointerOptions",
    "Format",
    "Policy",
    "SaveStats",
    "buffer_sets_needed",
    "check_loop",
    "check_stager",
    "check_step",
]

Policy = Literal["wait", "skip", "coalesce"]
Format = Literal["dcp", "torch"]


@dataclass(frozen=True)
class CheckpointerOptions:
    """A Checkpointer's settings (see ``Checkpointer``), checked at construction."""

    directory: Path
    keep: int = 3
    format: Format = "dcp"
    max_in_flight: int = 1
    policy: Policy = "wait"
    checksums: bool = True
    checksum_threads: int = 1
    host_budget_bytes: int | None = None
    node_budget_bytes: int | None = None
    node_budget_path: str | None = None  # a path-like given is kept as its string
    node_budget_job: str | None = None
    incremental: bool = False
    #: The object store's URL (``s3://bucket/prefix``) the steps go to; None: they are
    #: in ``directory``, which is then only the saves' local scratch folder.
    url: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.keep, int) or isinstance(self.keep, bool) or self.keep < 1:
            raise InvalidOptionError(f"keep must be an int >= 1, got {self.keep!r}")
        if self.format not in ("dcp", "torch"):
            raise InvalidOptionError(f"format must be 'dcp' or 'torch', got {self.format!r}")
        if not isinstance(self.max_in_flight, int) or self.max_in_flight < 1:
            raise InvalidOptionError(f"max_in_flight must be an int >= 1, got {self.max_in_flight!r}")
        if self.policy not in ("wait", "skip", "coalesce"):
            raise InvalidOptionError(f"policy must be 'wait', 'skip' or 'coalesce', got {self.policy!r}")
        if not isinstance(self.checksum_threads, int) or self.checksum_threads < 1:
            raise InvalidOptionError(f"checksum_threads must be an int >= 1, got {self.checksum_threads!r}")
        _check_incremental(self)
        budget = self.host_budget_bytes
        if budget is not None:
            if isinstance(budget, bool) or not isinstance(budget, int) or budget < 4096:
                raise InvalidOptionError(
                    f"host_budget_bytes must be None or an int >= 4096 (bytes), got {budget!r}"
                )
            if self.format != "dcp":
                raise InvalidOptionError(
                    "host_budget_bytes needs format='dcp' (a torch.save file is written whole)"
                )
            if self.policy == "coalesce":
                raise InvalidOptionError(
                    "host_budget_bytes cannot coalesce: a queued save would need a full staged copy; "
                    "use policy 'wait' or 'skip'"
                )
        node = self.node_budget_bytes
        if node is None:
            if self.node_budget_path is not None or self.node_budget_job is not None:
                raise InvalidOptionError("node_budget_path and node_budget_job need node_budget_bytes")
            return
        if isinstance(node, bool) or not isinstance(node, int) or node < 4096:
            raise InvalidOptionError(
                f"node_budget_bytes must be None or an int >= 4096 (bytes), got {node!r}"
            )
        if self.format != "dcp":
            raise InvalidOptionError(
                "node_budget_bytes needs format='dcp' (a save that does not fit streams through DCP)"
            )
        if self.policy == "coalesce":
            raise InvalidOptionError(
                "node_budget_bytes cannot coalesce: a save that streams has no staged copy to queue; "
                "use policy 'wait' or 'skip'"
            )
        for name in ("node_budget_path", "node_budget_job"):
            value = getattr(self, name)
            if name == "node_budget_path" and isinstance(value, os.PathLike):
                value = os.fspath(value)  # a Path, as Stager takes it
                object.__setattr__(self, name, value)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidOptionError(f"{name} must be None or a non-empty string, got {value!r}")


def _check_incremental(options: CheckpointerOptions) -> None:
    if not isinstance(options.incremental, bool):
        raise InvalidOptionTypeError(f"incremental must be True or False, got {options.incremental!r}")
    if not options.incremental:
        return
    if options.format != "dcp":
        raise InvalidOptionError(
            f"incremental=True needs format='dcp', got format={options.format!r}: a torch.save file is "
            "one pickle that cannot reference tensors stored by an earlier step"
        )
    if not options.checksums:
        raise InvalidOptionError(
            "incremental=True needs checksums=True: the manifest's digests are how a save knows "
            "which tensors are unchanged since the previous commit"
        )
    if options.url is not None:
        raise InvalidOptionError(
            f"incremental=True is for a local folder, not {options.url!r}: a step references its "
            "base's files by hard links, which an object store has none of (docs/object_storage.md)"
        )


@dataclass(frozen=True)
class SaveStats:
    """One committed checkpoint. Seconds and bytes.

    ``stage_seconds``: from ``save`` starting to stage until the staged copy was ready
    (what ``save`` blocked the caller for, besides a ``wait``-policy wait, which is
    ``queued_seconds``). ``write_seconds``: the background write of this rank's files
    (DCP or ``torch.save``, fsynced), with the checksum of the staged host copy running
    alongside; ``checksum_seconds``: that pass alone (wall time, in its threads; none
    of it in ``stage_seconds``: the stage itself hashes nothing);
    ``commit_seconds``: checksums file, fsyncs, rename, ``latest`` and retention.
    ``bytes``: this rank's staged tensor bytes. ``budget``: with ``host_budget_bytes``,
    the save's ``dcp.BudgetStats`` (peak ring bytes, blocked seconds); there
    ``stage_seconds`` is the time until the last piece was copied (the fence), and
    ``write_seconds`` the whole pipeline, copies included.

    With ``node_budget_bytes``: ``admission`` says how the save met the node budget:
    ``"cached"`` (staged into a buffer set already mapped and counted), ``"staged"``
    (a staged copy, its new bytes granted by the node ledger), ``"streamed"`` (the
    staged copy did not fit: streamed through the budgeted pipeline within a share of
    the node budget, ``budget`` then holds its BudgetStats); None without a node
    budget. ``node_wait_seconds``: the seconds the save waited in the node's ticket
    order, for its staged copy's bytes and, streamed, for its ring's share.

    With ``incremental=True``: ``reused_bytes`` is the part of ``bytes`` this rank did
    not write because the step references it, unchanged, from the previous commit
    (0 for a save that wrote everything)."""

    step: int
    path: str
    bytes: int
    queued_seconds: float
    stage_seconds: float
    write_seconds: float
    checksum_seconds: float
    commit_seconds: float
    budget: BudgetStats | None = None
    admission: str | None = None
    node_wait_seconds: float = 0.0
    reused_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        """Plain data (str, int, float, None and dicts of them; ``budget`` as a dict or
        None), for a JSON reply or a log record."""
        return asdict(self)

    @property
    def streamed(self) -> bool:
        """The save went through the budgeted pipeline (``host_budget_bytes``, or the
        node budget could not hold its staged copy)."""
        return self.budget is not None

    @property
    def bytes_per_second(self) -> float:
        """Written bytes over write seconds (0.0 if unmeasurably fast)."""
        return self.bytes / self.write_seconds if self.write_seconds > 0 else 0.0


#: The URL schemes a Checkpointer's ``directory`` may have (besides a plain path).
SCHEMES = ("s3://bucket/prefix", "file:///path")


def resolve_directory(directory: str | os.PathLike[str]) -> tuple[Path, str | None]:
    """The local folder and the object store a Checkpointer's ``directory`` names.

    A path or a ``file://`` URL: that folder, no store. ``s3://bucket/prefix``: the
    store, with a local scratch folder for the saves' files (``scratch_folder``). Any
    other URL is refused (InvalidOptionError naming it and the supported ones): ``Path``
    would turn ``gs://bucket/run`` into a relative folder ``gs:/bucket/run``, and the
    checkpoints a user believes are in the bucket would die with the machine.
    """
    raw = os.fspath(directory)
    if isinstance(raw, bytes):
        raise InvalidOptionTypeError(f"directory must be a str or os.PathLike[str], got bytes {raw!r}")
    match = _URL.match(raw)
    if match is None:
        return Path(raw), None
    scheme = match.group(1).lower()
    parsed = urllib.parse.urlsplit(raw)
    if scheme == "file":
        if parsed.netloc not in ("", "localhost") or parsed.query or parsed.fragment:
            raise InvalidOptionError(
                f"directory {raw!r}: a file:// URL must name a local path "
                "(file:///abs/path or file://localhost/abs/path)"
            )
        return Path(urllib.parse.unquote(parsed.path)), None
    if scheme == "s3":
        if not parsed.netloc or parsed.query or parsed.fragment:
            raise InvalidOptionError(
                f"directory {raw!r}: an s3:// URL names a bucket and a prefix: s3://bucket/prefix"
            )
        url = f"s3://{parsed.netloc}/{parsed.path.strip('/')}".rstrip("/")
        return scratch_folder(url), url
    raise InvalidOptionError(
        f"directory {raw!r} is a {scheme}:// URL, which the Checkpointer does not support: it "
        f"writes to {', '.join(SCHEMES)} or a local path (GCS, Azure and other fsspec stores are "
        "not supported; see docs/object_storage.md). A folder named "
        f"{scheme + ':'!r} in the working directory would take the checkpoints instead"
    )


def local_directory(directory: str | os.PathLike[str]) -> Path:
    """The local folder a ``directory`` names; an object store's URL is refused here
    (for callers that need a folder: the memory tier's agent, tools)."""
    folder, url = resolve_directory(directory)
    if url is not None:
        raise InvalidOptionError(f"directory {url!r}: a local folder is needed here, not an object store")
    return folder


def scratch_folder(url: str) -> Path:
    """The local folder where saves to ``url`` write their files before they are
    uploaded (and restores download them): ``$ASYNC_STAGER_SCRATCH/<hash>``, else
    ``$XDG_CACHE_HOME/async_stager/scratch/<hash>`` (``~/.cache``), one per URL (the
    ranks of one node share it, as they share a folder)."""
    import hashlib

    base = os.environ.get("ASYNC_STAGER_SCRATCH")
    if not base:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(cache, "async_stager", "scratch")
    return Path(base) / hashlib.sha256(url.encode()).hexdigest()[:16]


def check_stager(options: CheckpointerOptions, stager: Stager | None) -> None:
    """A given ``stager`` is a Stager, and not given with a node budget (which is for
    the Checkpointer's own Stager). Checked before anything collective runs."""
    from async_stager._core.aio.stager import Stager

    if stager is not None and not isinstance(stager, Stager):
        raise InvalidOptionTypeError(
            f"stager must be an async_stager.Stager (or None), got {type(stager).__name__}"
        )
    if options.node_budget_bytes is not None and stager is not None:
        raise InvalidOptionError(
            "node_budget_bytes is for the Checkpointer's own Stager; with stager=..., give that "
            "Stager the node budget (Stager(node_budget_bytes=...)) or leave stager out"
        )


def buffer_sets_needed(
    options: CheckpointerOptions, several_ranks_format: bool, distributed: bool, stager: Stager | None
) -> int:
    """The buffer sets a Checkpointer's saves need: one per write in flight, one for the
    save staging next, and with ``"coalesce"`` one for the queued save it may replace.
    Refuses what several ranks cannot do and a given stager with fewer sets."""
    policy, max_in_flight = options.policy, options.max_in_flight
    if distributed and policy != "wait":
        raise InvalidOptionError(f"policy must be 'wait' on several ranks, got {policy!r}")
    if distributed and not several_ranks_format:
        raise InvalidOptionError(f"format {options.format!r} is for one process; use 'dcp' on several ranks")
    sets = max_in_flight + (2 if policy == "coalesce" else 1)
    if stager is not None and options.host_budget_bytes is None and stager.options.max_buffer_sets < sets:
        raise InvalidOptionError(
            f"the stager has max_buffer_sets={stager.options.max_buffer_sets}; a Checkpointer with "
            f"max_in_flight={max_in_flight} and policy {policy!r} needs {sets} "
            f"(Stager(max_buffer_sets={sets}))"
        )
    return sets


def check_step(step: Any) -> None:
    """``save(step=...)`` is an int >= 0 (InvalidOptionTypeError, InvalidOptionError)."""
    if isinstance(step, bool) or not isinstance(step, int):
        raise InvalidOptionTypeError(
            f"save(step=...) must be an int >= 0, got {step!r} ({type(step).__name__})"
        )
    if step < 0:
        raise InvalidOptionError(f"save(step=...) must be an int >= 0, got {step}")


def check_loop(opened_on: int, call: str) -> None:
    """``call`` runs in the thread of the event loop that opened the Checkpointer
    (``opened_on``, -1: not open yet): else a CheckpointError that says how to hand it
    to the loop."""
    import threading

    if opened_on != -1 and threading.get_ident() != opened_on:
        from async_stager.errors import CheckpointError

        raise CheckpointError(
            f"{call} must run on the event loop that opened the Checkpointer, not in thread "
            f"{threading.current_thread().name!r}: from another thread, hand it to the loop: "
            "token = anyio.lowlevel.current_token() (on the loop), then in the thread "
            "anyio.from_thread.run(functools.partial(ckpt.save, state, step=n), token=token) "
            "(no token= in a thread started by anyio.to_thread.run_sync)"
        )
