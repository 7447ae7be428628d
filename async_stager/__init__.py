"""async_stager: stage PyTorch state dicts into reusable host memory, awaitably.

``await Stager().stage(sd)`` copies every tensor of a nested state dict (GPU or CPU)
into reusable pinned and/or shared host memory without blocking an asyncio or trio
event loop. ``DefaultStager`` keeps PyTorch DCP's staging API on the same engine.
"""

from ._errors import (
    BudgetTooSmallError,
    BuffersHeldError,
    ClosedError,
    CopyError,
    HostAllocationError,
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
from ._seed import CheckpointStager, CheckpointStagerConfig, DefaultStager
from ._share import AttachedStateDict, SharedArena, SharedHandle, attach_shared, export_shared
from ._stager import Stager
from ._stats import StageStats
from ._waiting import Backoff

# The one source of the version: pyproject.toml reads it (dynamic, setuptools attr:).
__version__ = "0.1.0"

__all__ = [
    "AttachedStateDict",
    "Backoff",
    "BudgetTooSmallError",
    "BuffersHeldError",
    "CheckpointStager",
    "CheckpointStagerConfig",
    "ClosedError",
    "CopyError",
    "DefaultStager",
    "HostAllocationError",
    "InvalidOptionError",
    "InvalidOptionTypeError",
    "Lease",
    "NestingError",
    "PinningError",
    "SharedArena",
    "SharedHandle",
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
