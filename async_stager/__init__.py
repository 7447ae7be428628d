"""async_stager: stage PyTorch state dicts into reusable host memory, awaitably.

``await Stager().stage(sd)`` copies every tensor of a nested state dict (GPU or CPU)
into reusable pinned and/or shared host memory without blocking an asyncio or trio
event loop. ``DefaultStager`` keeps PyTorch DCP's staging API on the same engine.
"""

from ._checkpoint_stager import CheckpointStager, CheckpointStagerConfig
from ._checkpointer import Checkpointer, CheckpointerOptions, SaveStats
from ._default_stager import DefaultStager
from ._digest import Checksums
from ._errors import (
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
from ._lease import Lease
from ._options import StagerOptions
from ._share import AttachedStateDict, SharedArenaRef, SharedHandle, attach_shared, export_shared
from ._shutdown import Shutdown
from ._stager import Stager
from ._stats import StageStats
from ._waiting import Backoff

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
