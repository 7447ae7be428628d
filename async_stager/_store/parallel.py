"""Parts in parallel as tasks on the I/O loop (no thread per part)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

__all__ = ["run_workers"]


async def run_workers(count: int, worker: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run ``count`` copies of ``worker`` (they share their queue of parts) until all
    end. The first failure cancels the others and is raised once they have ended, as
    itself (not in a group). Cancellation: every worker is cancelled and awaited."""
    tasks = [asyncio.ensure_future(worker()) for _ in range(count)]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
