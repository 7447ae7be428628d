"""The budgeted pipeline: a DCP save within a host-memory budget (``dcp.save(...,
host_budget_bytes=N)``, the Checkpointer's budgeted and node-budget saves).

One entry: ``budgeted_save(state_dict, stager, BudgetSettings(...))`` returns a
``BudgetedJob`` (``run()`` blocking in any thread, or ``coroutine()`` to await), whose
figures are a ``BudgetStats``. The modules, in import order: ``survey`` (what the call
checks), ``share`` (the figures, a node budget's share), ``records`` (what the pipeline
and its DCP glue share), ``copies`` (tensor copies through the device seam),
``pickling`` (non-tensor values into the ring), ``pipeline`` (the ring and its copier
thread), ``streaming`` (DCP's planner, writer and file system), ``entry`` (the call).
"""

from async_stager._dcp.budget.entry import BudgetedJob, BudgetSettings, budgeted_save
from async_stager._dcp.budget.share import BudgetStats, node_ranks
from async_stager._dcp.budget.survey import largest_tensor

__all__ = ["BudgetSettings", "BudgetStats", "BudgetedJob", "budgeted_save", "largest_tensor", "node_ranks"]
