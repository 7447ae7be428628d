"""async_stager: stage PyTorch state dicts into reusable host memory, awaitably.

``await Stager().stage(sd)`` copies every tensor of a nested state dict (GPU or CPU)
into reusable pinned and/or shared host memory without blocking an asyncio or trio
event loop. ``DefaultStager`` keeps PyTorch DCP's staging API on the same engine.
"""

from async_stager._checkpoint.checkpointer import (
    Checkpointer,
    CheckpointerOptions as CheckpointerOptions,
    SaveStats,
)
from async_stager._checkpoint.progress import SaveProgress, SaveRequest
from async_stager._checkpoint.shutdown import Shutdown
from async_stager._core.aio.stager import Stager
from async_stager._core.aio.waiting import Backoff as Backoff
from async_stager._core.checksum.digest import Checksums
from async_stager._core.compare import state_differences
from async_stager._core.memory.lease import Lease
from async_stager._core.options import StagerOptions as StagerOptions
from async_stager._core.stats import StageStats
from async_stager._dcp.default_stager import DefaultStager
from async_stager._dcp.interface import CheckpointStager, CheckpointStagerConfig
from async_stager._share.handoff import (
    AttachedStateDict as AttachedStateDict,
    SharedArenaRef as SharedArenaRef,
    SharedHandle as SharedHandle,
    attach_shared as attach_shared,
    export_shared as export_shared,
)
from async_stager._tier.client import AgentClient, AgentStatus as AgentStatus, SnapshotInfo as SnapshotInfo
from async_stager._tier.stats import MemoryStats
from async_stager.errors import (
    AcceleratorRequiredError as AcceleratorRequiredError,
    AgentError,
    BudgetTooSmallError as BudgetTooSmallError,
    BuffersHeldError,
    CheckpointError,
    ClosedError as ClosedError,
    CopyError as CopyError,
    DeviceTimeoutError as DeviceTimeoutError,
    HostAllocationError as HostAllocationError,
    HostLimitError,
    IntegrityError,
    InvalidOptionError as InvalidOptionError,
    InvalidOptionTypeError as InvalidOptionTypeError,
    NestingError as NestingError,
    PinningError as PinningError,
    StagingError,
    UncopyableObjectError as UncopyableObjectError,
    UnsupportedError as UnsupportedError,
    UnsupportedTensorError as UnsupportedTensorError,
)

# The one source of the version: pyproject.toml reads it (dynamic, setuptools attr:).
__version__ = "0.1.0"

__all__ = [
    # Staging: a state dict into reusable host memory, awaitably.
    "Stager",
    "Lease",
    "StageStats",
    "Checksums",
    # The checkpoint manager.
    "Checkpointer",
    "SaveStats",
    "SaveProgress",
    "SaveRequest",
    "Shutdown",
    # The memory tier: snapshots held in memory by a node agent (Checkpointer(agent=...)).
    "AgentClient",
    "MemoryStats",
    # Checking a restore: two states compared bit for bit.
    "state_differences",
    # The drop-in for DCP's and torch_checkpointing's staging (also in async_stager.dcp).
    "DefaultStager",
    "CheckpointStager",
    "CheckpointStagerConfig",
    # The errors a user catches (the whole hierarchy: async_stager.errors).
    "StagingError",
    "CheckpointError",
    "IntegrityError",
    "BuffersHeldError",
    "HostLimitError",
    "AgentError",
    "__version__",
]

#: Importable from here as before, not advertised: the rest of the error hierarchy
#: (``async_stager.errors``), the writer-process handoff (``async_stager.share``), the
#: options records and polling knob, and what ``AgentClient`` answers (for annotations).
_COMPAT = [
    "AcceleratorRequiredError",
    "AgentStatus",
    "AttachedStateDict",
    "Backoff",
    "BudgetTooSmallError",
    "CheckpointerOptions",
    "ClosedError",
    "CopyError",
    "DeviceTimeoutError",
    "HostAllocationError",
    "InvalidOptionError",
    "InvalidOptionTypeError",
    "NestingError",
    "PinningError",
    "SharedArenaRef",
    "SharedHandle",
    "SnapshotInfo",
    "StagerOptions",
    "UncopyableObjectError",
    "UnsupportedError",
    "UnsupportedTensorError",
    "attach_shared",
    "export_shared",
]


def _home() -> None:
    """Give each public object the module a user imports it from (reprs, pickles: a
    ``SharedHandle`` crosses processes), not the private one that defines it."""
    homes = {"errors": "async_stager.errors", "_share": "async_stager.share"}
    for name in [*__all__, *_COMPAT]:
        obj = globals()[name]
        module = getattr(obj, "__module__", None)
        if not isinstance(module, str) or not module.startswith("async_stager."):
            continue
        layer = module.split(".")[1]
        try:
            obj.__module__ = homes.get(layer, "async_stager")
        except (AttributeError, TypeError):
            pass


_home()
