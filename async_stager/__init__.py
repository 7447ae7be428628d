"""async_stager: stage PyTorch state dicts into reusable host memory, awaitably.

``await Stager().stage(sd)`` copies every tensor of a nested state dict (GPU or CPU)
into reusable pinned and/or shared host memory without blocking an asyncio or trio
event loop. ``DefaultStager`` keeps PyTorch DCP's staging API on the same engine.
"""

from async_stager._checkpoint.checkpointer import Checkpointer, CheckpointerOptions, SaveStats
from async_stager._checkpoint.shutdown import Shutdown
from async_stager._core.aio.lease import Lease
from async_stager._core.aio.stager import Stager
from async_stager._core.aio.waiting import Backoff
from async_stager._core.checksum.digest import Checksums
from async_stager._core.options import StagerOptions
from async_stager._core.stats import StageStats
from async_stager._dcp.default_stager import DefaultStager
from async_stager._dcp.interface import CheckpointStager, CheckpointStagerConfig
from async_stager._share.handoff import (
    AttachedStateDict,
    SharedArenaRef,
    SharedHandle,
    attach_shared,
    export_shared,
)
from async_stager.errors import (
    AcceleratorRequiredError,
    BudgetTooSmallError,
    BuffersHeldError,
    CheckpointError,
    ClosedError,
    CopyError,
    HostAllocationError,
    HostLimitError,
    IntegrityError,
    InvalidOptionError,
    InvalidOptionTypeError,
    NestingError,
    PinningError,
    StagingError,
    UncopyableObjectError,
    UnsupportedError,
    UnsupportedTensorError,
)

# The one source of the version: pyproject.toml reads it (dynamic, setuptools attr:).
__version__ = "0.1.0"

__all__ = [
    "AcceleratorRequiredError",
    "AttachedStateDict",
    "Backoff",
    "BudgetTooSmallError",
    "BuffersHeldError",
    "CheckpointError",
    "CheckpointStager",
    "CheckpointStagerConfig",
    "Checkpointer",
    "CheckpointerOptions",
    "Checksums",
    "ClosedError",
    "CopyError",
    "DefaultStager",
    "HostAllocationError",
    "HostLimitError",
    "IntegrityError",
    "InvalidOptionError",
    "InvalidOptionTypeError",
    "Lease",
    "NestingError",
    "PinningError",
    "SaveStats",
    "SharedArenaRef",
    "SharedHandle",
    "Shutdown",
    "StageStats",
    "Stager",
    "StagerOptions",
    "StagingError",
    "UncopyableObjectError",
    "UnsupportedError",
    "UnsupportedTensorError",
    "attach_shared",
    "export_shared",
    "__version__",
]
