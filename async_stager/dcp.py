"""PyTorch Distributed Checkpoint (DCP) with async_stager: stage-then-save
(``save``, ``save_staged``, the budgeted pipeline's ``BudgetStats``) and the seed's
staging interface (``DefaultStager``, ``CheckpointStager``, ``CheckpointStagerConfig``), and
DCP's storage on an object store (``StoreWriter``, ``StoreReader``: ``s3://bucket/prefix``).

The code lives in ``async_stager._dcp``; this module is its public face (names only).
"""

from __future__ import annotations

from async_stager._dcp.budget import BudgetStats as BudgetStats
from async_stager._dcp.default_stager import DefaultStager as DefaultStager
from async_stager._dcp.interface import (
    CheckpointStager as CheckpointStager,
    CheckpointStagerConfig as CheckpointStagerConfig,
)
from async_stager._dcp.save import save as save, save_staged as save_staged
from async_stager._dcp.store_io import StoreReader as StoreReader, StoreWriter as StoreWriter

__all__ = [
    "BudgetStats",
    "CheckpointStager",
    "CheckpointStagerConfig",
    "DefaultStager",
    "StoreReader",
    "StoreWriter",
    "save",
    "save_staged",
]
