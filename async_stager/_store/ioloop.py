"""The store's I/O loop: one asyncio event loop in a thread of its own, per store.

Every store operation runs there, whatever the caller runs on: asyncio, uvloop, trio,
or a plain thread (the Checkpointer's write thread). Why one loop of our own:

- the S3 client (aiobotocore on aiohttp) is asyncio-only and binds its connection pool
  to one loop; trio callers and threads reach it here unchanged;
- the client's Python work (signing, checksums, XML) never runs on the caller's loop:
  a training loop's timers see only the GIL it takes, not a 16 MiB payload's hash;
- one thread for the whole store, whatever the number of parts in flight (no thread per
  part: parts are tasks on this loop).

Cancellation: cancelling the caller's wait cancels the operation's task on this loop
and waits (shielded) for it to end, so its cleanup (aborting a multipart upload) has
run before the caller sees the cancellation; an object is then whole or absent.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

from async_stager._core.aio.waiting import wait_future, wait_future_uninterrupted
from async_stager.errors import StoreError

__all__ = ["IOLoop"]

T = TypeVar("T")


class IOLoop:
    """An asyncio loop in a daemon thread (named ``async-stager-store``), started at the
    first operation and stopped by ``close``. A daemon: a process that exits without
    closing its store does not hang on it; an upload cut short that way leaves no
    object (an incomplete multipart upload is not one; see ``Store.list_uploads``)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped: Future[None] | None = None
        self._closed = False
        self._pid = os.getpid()

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def _start(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._closed:
                raise StoreError(f"{self._name}: the store is closed", key=self._name, reason="closed")
            if self._pid != os.getpid():
                # Hazard: a forked child has a copy of the loop but not its thread; a
                # request sent there would wait for ever.
                raise StoreError(
                    f"{self._name}: a store opened before a fork cannot be used in the child: "
                    "open one in the child",
                    key=self._name,
                    reason="closed",
                )
            if self._loop is not None:
                return self._loop
            loop = asyncio.new_event_loop()
            stopped: Future[None] = Future()

            def main() -> None:
                asyncio.set_event_loop(loop)
                try:
                    loop.run_forever()
                    # Whatever is still running (a caller that never awaited) ends here.
                    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
                    for task in pending:
                        task.cancel()
                    if pending:
                        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                    loop.run_until_complete(loop.shutdown_asyncgens())
                finally:
                    loop.close()
                    stopped.set_result(None)

            thread = threading.Thread(target=main, name="async-stager-store", daemon=True)
            thread.start()
            self._loop, self._thread, self._stopped = loop, thread, stopped
            return loop

    def submit(self, make: Callable[[], Coroutine[Any, Any, T]]) -> tuple[Future[T], Callable[[], None]]:
        """Start ``make()`` as a task on the loop: its Future, and a function any thread
        may call to cancel the task (the Future then ends with its error or with
        ``asyncio.CancelledError``; it is never cancelled itself, so its waiter can
        always wait for the task's cleanup)."""
        loop = self._start()
        done: Future[T] = Future()
        state: dict[str, Any] = {"task": None, "cancel": False}

        def finish(task: asyncio.Task[T]) -> None:
            if task.cancelled():
                done.set_exception(asyncio.CancelledError())
            elif (exc := task.exception()) is not None:
                done.set_exception(exc)
            else:
                done.set_result(task.result())

        def start() -> None:
            done.set_running_or_notify_cancel()
            task = loop.create_task(make())
            state["task"] = task
            task.add_done_callback(finish)
            if state["cancel"]:
                task.cancel()

        def cancel() -> None:
            def now() -> None:
                state["cancel"] = True
                if state["task"] is not None:
                    state["task"].cancel()

            try:
                loop.call_soon_threadsafe(now)
            except RuntimeError:
                pass  # the loop is closed: the task has ended already

        loop.call_soon_threadsafe(start)
        return done, cancel

    async def run(self, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """``await make()`` on the I/O loop, from any event loop (asyncio, uvloop,
        trio). Cancellation: the task is cancelled and its cleanup awaited, shielded;
        then the caller's cancellation is raised."""
        fut, cancel = self.submit(make)
        try:
            return await wait_future(fut)
        except BaseException:
            if not fut.done():
                cancel()
                try:
                    await wait_future_uninterrupted(fut)
                except BaseException:  # noqa: BLE001 - the task's own end; ours is raised
                    pass
            raise

    def run_blocking(self, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """``make()`` on the I/O loop, waited for by this thread (a thread with no event
        loop: the Checkpointer's writer). Not from the I/O loop's own thread."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("a store's blocking call from its own I/O loop would wait for itself")
        fut, cancel = self.submit(make)
        try:
            return fut.result()
        except BaseException:
            if not fut.done():  # KeyboardInterrupt in this thread: clean up, then raise
                cancel()
                try:
                    fut.exception()
                except BaseException:  # noqa: BLE001 - the task's own end
                    pass
            raise

    def close_future(self, final: Callable[[], Coroutine[Any, Any, None]] | None) -> Future[None] | None:
        """Run ``final()`` on the loop (the client's close), then stop it. Returns a
        Future done once the thread has ended (None if the loop never started)."""
        with self._lock:
            if self._closed:
                return self._stopped
            self._closed = True
            loop, stopped = self._loop, self._stopped
        if loop is None:
            return None

        async def last() -> None:
            try:
                if final is not None:
                    await final()
            finally:
                loop.stop()

        loop.call_soon_threadsafe(lambda: loop.create_task(last()))
        return stopped

    async def aclose(self, final: Callable[[], Coroutine[Any, Any, None]] | None = None) -> None:
        """Close from an event loop: ``final()`` on the I/O loop, then the thread ends.
        Cancellation: deferred until the thread has ended."""
        stopped = self.close_future(final)
        if stopped is not None:
            await wait_future_uninterrupted(stopped)
            assert self._thread is not None
            self._thread.join()

    def close_blocking(self, final: Callable[[], Coroutine[Any, Any, None]] | None = None) -> None:
        stopped = self.close_future(final)
        if stopped is not None:
            stopped.result()
            assert self._thread is not None
            self._thread.join()
