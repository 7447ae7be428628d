"""A stager's engine made from its options as given: each option checked and resolved
against the device seam (``options.resolve_options``), a node ledger opened or taken,
the real backend configured. Used by both stagers (``Stager``, ``DefaultStager``) and
the tests.
"""

from __future__ import annotations

from async_stager._core.copy.copiers import RealBackend
from async_stager._core.copy.device import Backend
from async_stager._core.memory.arena import Pinner
from async_stager._core.memory.ledger import NodeLedger
from async_stager._core.options import resolve_options
from async_stager._core.run.engine import Engine
from async_stager.errors import InvalidOptionError

__all__ = ["build_engine"]


def build_engine(
    *,
    backend: Backend | None = None,
    pinner: Pinner | None = None,
    ledger: NodeLedger | None = None,
    **given: object,
) -> Engine:
    """The engine of a stager, from its options as given (StagerOptions fields, ``None``
    for what the machine supports; see ``resolve_options``) and the device seam:
    ``backend`` (default: the real one, configured from the resolved options) and
    ``pinner`` (default: the backend's). Used by both stagers and the tests; checks
    every option before anything is made. ``ledger``: a node ledger the caller owns
    (shared with its other users); else one is opened from ``node_budget_bytes`` (and
    closed with the engine)."""
    options, pinner = resolve_options(backend if backend is not None else RealBackend(), pinner, **given)
    owns = False
    if ledger is not None and options.node_budget_bytes not in (None, ledger.budget):
        raise InvalidOptionError(
            f"node_budget_bytes={options.node_budget_bytes} differs from the budget of the node ledger "
            f"given ({ledger.budget}); pass one of them"
        )
    if ledger is None and options.node_budget_bytes is not None:
        ledger = NodeLedger.open(
            options.node_budget_bytes, path=options.node_budget_path, job=options.node_budget_job
        )
        owns = True
    if backend is None:
        backend = RealBackend(non_blocking=options.non_blocking, copy_threads=options.copy_threads)
    return Engine(options, backend=backend, pinner=pinner, ledger=ledger, owns_ledger=owns)
