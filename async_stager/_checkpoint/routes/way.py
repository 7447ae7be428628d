"""Where the saves of a step go (``Way``): a save queue, whose policy moves them, and
the route each save takes there. ``Checkpointer.save`` asks the schedule
(``routes.Schedule``) for the ways of a step and, for each, skips the save (the policy)
or submits its route; ``fence``, ``wait``, ``in_flight``, ``dropped`` and the close go
over every way alike.
"""

from __future__ import annotations

import abc
import weakref
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import anyio.lowlevel

if TYPE_CHECKING:
    from async_stager._checkpoint.item import Route, SaveItem
    from async_stager._checkpoint.saves import SaveQueue

__all__ = ["Way", "answer", "skipped"]


class Way(abc.ABC):
    """A destination of saves: its queue and how a save's route is made."""

    def __init__(self, queue: SaveQueue) -> None:
        self.queue = queue

    def skips(self) -> bool:
        """The policy skips a save called now (``"skip"`` with every write slot in
        use; a way may add what keeps it from taking a save)."""
        return self.queue.options.policy == "skip" and self.queue.full

    def skip(self, step: int, *, alone: bool) -> Coroutine[Any, Any, bool]:
        """A save of ``step`` skipped at its call: listed in ``dropped``; its caller's
        answer (False). ``alone``: no other way saves this step."""
        self.queue.dropped.append(step)
        return skipped()

    def check(self, sd: dict[str, Any]) -> int:
        """Refuse at the call what this way cannot save (raises); what ``route`` needs
        of the check."""
        return 0

    @abc.abstractmethod
    def route(self, sd: dict[str, Any], checked: int, *, alone: bool) -> Route:
        """The route of a save of ``sd``, its snapshot point taken now; ``checked``:
        what ``check`` returned."""

    def submit(
        self, sd: dict[str, Any], step: int, called: float, checked: int, *, alone: bool
    ) -> Coroutine[Any, Any, bool]:
        """Submit a save of ``sd`` as ``step`` along its route: the coroutine its
        caller awaits (``SaveQueue.await_save``)."""
        item = self.queue.submit(self.route(sd, checked, alone=alone), step, called)
        coro = self.queue.await_save(item)
        # A coroutine never awaited must not hold a buffer set or a place in the
        # commit order: it is abandoned when it dies, unless its write has started.
        weakref.finalize(coro, _forget, self.queue, weakref.ref(item))
        return coro

    def fence(self) -> Coroutine[Any, Any, None] | None:
        """Its stager's ordering points, read now (``Stager.fence``); None without one."""
        return None

    def closing(self) -> None:
        """The Checkpointer closes (before its queues drain): give up what would hold
        the close for ever."""

    async def settle(self) -> None:
        """After its queue drained: what else ``wait()`` waits for. Cancellation: only
        the wait."""


def _forget(queue: SaveQueue, ref: weakref.ref[SaveItem]) -> None:
    item = ref()
    if item is not None:
        queue.forget(item)


async def skipped() -> bool:
    """A skipped save's answer. It still yields once: a loop whose only await is
    ``save()`` must give the background work its turns."""
    await anyio.lowlevel.checkpoint()
    return False


async def answer(answers: list[Coroutine[Any, Any, bool]]) -> bool:
    """A step saved along several ways: each awaited in turn (the memory snapshot's
    stage first), the last one's answer returned (the folder's, when it saves the
    step); False with none. Cancellation: as for each; a failure abandons the rest."""
    result = False
    if not answers:
        await anyio.lowlevel.checkpoint()  # one turn for the background work, as a save
    for i, coro in enumerate(answers):
        try:
            result = await coro
        except BaseException:
            for rest in answers[i + 1 :]:
                rest.close()
            raise
    return result
