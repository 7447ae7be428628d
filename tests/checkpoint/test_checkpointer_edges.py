"""The manager's edges (issue 41, section 2), through the public API: nested
``Shutdown`` blocks, a failure after the commit point, a folder that can only be read
(read-only, or a disk without a free inode), damaged hold files, and the small
messages (a save from another thread, a NaN deadline, a reader a commit waits for)."""

from __future__ import annotations

import os
import signal
from typing import Any

import anyio
import pytest

from async_stager import Shutdown

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


# -- Shutdown blocks inside each other ------------------------------------------------------


def _own_handler() -> tuple[list[int], Any]:
    seen: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
    return seen, previous


async def test_an_outer_shutdown_still_catches_sigterm_after_an_inner_one_left(anyio_backend: Any) -> None:
    seen, previous = _own_handler()
    try:
        handler = signal.getsignal(signal.SIGTERM)
        async with Shutdown() as outer:
            async with Shutdown() as inner:
                pass
            assert not inner.requested
            os.kill(os.getpid(), signal.SIGTERM)
            with anyio.fail_after(10):
                await outer.wait()
            assert outer.signal == signal.SIGTERM
            assert not inner.requested  # it had left
        assert signal.getsignal(signal.SIGTERM) == handler  # the one from before both
        assert seen == []
        os.kill(os.getpid(), signal.SIGTERM)  # reaches it again
        for _ in range(100):
            if seen:
                break
            await anyio.sleep(0.01)
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


async def test_a_signal_an_inner_shutdown_catches_reaches_the_outer_one_too(anyio_backend: Any) -> None:
    seen, previous = _own_handler()
    try:
        async with Shutdown() as outer:
            for _ in range(3):  # an inner block entered again and again (one per epoch)
                async with Shutdown():
                    pass
            async with Shutdown() as inner:
                os.kill(os.getpid(), signal.SIGTERM)
                with anyio.fail_after(10):
                    await inner.wait()
                    await outer.wait()
            assert outer.signal == inner.signal == signal.SIGTERM
        assert seen == []
    finally:
        signal.signal(signal.SIGTERM, previous)


async def test_shutdowns_that_leave_out_of_order_keep_catching(anyio_backend: Any) -> None:
    """Two blocks in sibling tasks: the first opened leaves first; the second still
    catches SIGTERM, and the handler from before both is back after the second."""
    seen, previous = _own_handler()
    try:
        handler = signal.getsignal(signal.SIGTERM)
        first_in, first_out = anyio.Event(), anyio.Event()
        second: list[Shutdown] = []

        async def first() -> None:
            async with Shutdown():
                first_in.set()
                await first_out.wait()

        async def later() -> None:
            await first_in.wait()
            async with Shutdown() as stop:
                second.append(stop)
                first_out.set()
                await anyio.sleep(0.05)  # the first leaves meanwhile
                os.kill(os.getpid(), signal.SIGTERM)
                with anyio.fail_after(10):
                    await stop.wait()

        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
            tg.start_soon(later)
        assert second[0].signal == signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) == handler
        assert seen == []
    finally:
        signal.signal(signal.SIGTERM, previous)
