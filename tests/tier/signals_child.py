"""A process serving the memory tier's agent beside a ``Shutdown`` block (run as a
script): does a SIGTERM reach both? (issue 45's review of ``_tier/service.py``).

``signals_child.py BACKENDS ORDERS BASE``: for each backend (``asyncio``,
``asyncio+uvloop``, ``trio``) and order, one line ``RESULT backend order SHUTDOWN WHY``:
the signal the ``Shutdown`` caught (None: deaf) and why ``serve_until_stopped``
stopped. Orders: ``shutdown-first`` (a ``Shutdown`` open, then the agent served in a
sibling task; SIGTERM), ``service-first`` (the agent served, then a ``Shutdown``
opened; SIGTERM), ``service-leaves`` (the agent served inside a ``Shutdown`` and
stopped by its idle bound; then SIGTERM: a deaf ``Shutdown`` lets it kill the process,
and no line is printed).
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import anyio

from async_stager import Shutdown
from async_stager._tier.agent import Agent
from async_stager._tier.service import serve_until_stopped


async def _sigterm_seen(stop: Shutdown) -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    with anyio.move_on_after(10):  # a hang guard: the signal is there within ms
        await stop.wait()


async def scenario(order: str, base: str, out: dict[str, Any]) -> None:
    agent = Agent(f"sig-{order}", max_bytes=1 << 20, base=base)

    async def serve(**kw: Any) -> None:
        out["why"] = await serve_until_stopped(agent, **kw)

    if order == "shutdown-first":
        async with Shutdown() as stop, anyio.create_task_group() as tg:
            await tg.start(_started, serve)
            await _sigterm_seen(stop)
            out["shutdown"] = stop.signal
            with anyio.move_on_after(10):
                while "why" not in out:
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    elif order == "service-first":
        async with anyio.create_task_group() as tg:
            await tg.start(_started, serve)
            async with Shutdown() as stop:
                await _sigterm_seen(stop)
                out["shutdown"] = stop.signal
            with anyio.move_on_after(10):
                while "why" not in out:
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    elif order == "service-leaves":
        async with Shutdown() as stop:
            with anyio.move_on_after(10):
                await serve(idle_exit=0.2, poll=0.02)
            await _sigterm_seen(stop)
            out["shutdown"] = stop.signal


async def _started(
    serve: Any, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
) -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(serve)
        await anyio.sleep(0.2)  # its signal receiver is installed (before its socket listens)
        task_status.started()


def main(backends: str, orders: str, base: str) -> None:
    for backend in backends.split(","):
        for order in orders.split(","):
            out: dict[str, Any] = {}
            options = {"use_uvloop": True} if backend.endswith("+uvloop") else {}
            anyio.run(scenario, order, base, out, backend=backend.split("+")[0], backend_options=options)
            shutdown = out.get("shutdown")
            print(
                "RESULT",
                backend,
                order,
                int(shutdown) if shutdown is not None else None,
                out.get("why"),
                flush=True,
            )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
