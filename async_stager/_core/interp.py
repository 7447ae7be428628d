"""Process-wide interpreter state that stagers share: the GIL switch interval, the cyclic
GC pause, and what the staging threads do when the interpreter exits.

Everything here is per process and shared by every stager in it, so each piece counts
its users instead of saving and restoring blindly (two stagers overlap freely).

Interpreter exit: the staging threads are daemon threads (a stager never closed must not
keep the process alive), but a daemon thread that is inside torch when the interpreter
finalizes is killed with ``pthread_exit`` as it takes the GIL back; the forced unwind
through torch's C++ frames hits a ``noexcept`` frame and the process aborts
("terminate called without an active exception", exit 134). So the modules that start
such threads register a hook with :func:`at_exit`; the hooks run from one ``atexit``
handler, after every non-daemon thread has finished and before finalization starts,
lowest ``order`` first, and stop and join the threads with their copies finished.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator

__all__ = [
    "EXIT_JOIN_SECONDS",
    "THREAD_PREFIX",
    "adopt_thread",
    "at_exit",
    "gc_paused",
    "gil_interval",
    "library_thread",
]

#: At interpreter exit, how long a hook waits for one staging thread. A job cancelled
#: there stops at its next check (every 256 leaves, every copy piece); one that cannot be
#: cancelled runs to its end. After this the thread is left to the interpreter (a thread
#: blocked in a Python-level wait is safe then; one inside torch is not).
EXIT_JOIN_SECONDS = 30.0

# -- the library's threads ------------------------------------------------------------------

#: The name of every thread the library starts begins with this (the exit hooks and the
#: tests' leak checks find them by it), but a thread its caller names (``DefaultStager``'s
#: ``config.thread_name``, as torch's), which is adopted instead (``adopt_thread``).
THREAD_PREFIX = "async-stager-"
_adopted: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def adopt_thread(thread: threading.Thread) -> None:
    """Count ``thread`` as the library's although its name was its caller's choice."""
    _adopted.add(thread)


def library_thread(thread: threading.Thread) -> bool:
    """Whether the library started ``thread`` (by its name, or adopted)."""
    return thread.name.startswith(THREAD_PREFIX) or thread in _adopted


# -- the GIL switch interval ---------------------------------------------------------------

_switch_lock = threading.Lock()
#: yield_interval of every job inside ``gil_interval`` now (one entry per job).
_switch_users: list[float] = []
#: The interval to put back when the last job ends ("the user's value").
_switch_saved = 0.0
#: What this module last set (read back: the interpreter rounds to microseconds).
_switch_applied: float | None = None


def _switch_apply() -> None:
    """Set the interval due now (lock held): the minimum of the saved value and every
    active job's interval while any is active, else the saved value."""
    global _switch_applied, _switch_saved
    current = sys.getswitchinterval()
    if _switch_applied is not None and current != _switch_applied:
        # Someone else set it while jobs were running: theirs is the value to restore.
        _switch_saved = current
    if _switch_users:
        target = min(_switch_saved, *_switch_users)
        if target != current:
            sys.setswitchinterval(target)
        _switch_applied = sys.getswitchinterval()
    else:
        if _switch_saved != current:
            sys.setswitchinterval(_switch_saved)
        _switch_applied = None


@contextlib.contextmanager
def gil_interval(seconds: float) -> Iterator[None]:
    """Lower the interpreter's GIL switch interval while a job runs.

    Hazard: the walk holds the GIL in pure Python. A thread that wants the GIL (the
    event loop's) waits one switch interval (5 ms by default), then asks, and the
    holder hands over at its next bytecode. Lowering the interval while staging bounds
    the loop's wait to about ``seconds``; it costs nothing when nobody waits (no
    switch is requested). Voluntary sleeps were measured instead: the same lag, at about
    twice the time of a cached stage of many small tensors (see docs/design.md).

    The setting is process-wide, and jobs of several stagers may overlap. The rule:

    - the value found when the first job starts is the user's value;
    - while jobs run, the interval is the smallest of the user's value and every running
      job's ``seconds`` (a job that ends takes its value with it);
    - whenever a job starts or ends and the interval is not what this function last
      set, someone else changed it meanwhile: their value becomes the user's value (it
      is what comes back at the end; running jobs still lower it below that);
    - when the last job ends, the user's value is put back.
    """
    global _switch_saved, _switch_applied
    with _switch_lock:
        if not _switch_users:
            _switch_saved = sys.getswitchinterval()
            _switch_applied = None
        _switch_users.append(seconds)
        _switch_apply()
    try:
        yield
    finally:
        with _switch_lock:
            _switch_users.remove(seconds)
            _switch_apply()


# -- the cyclic GC -------------------------------------------------------------------------

_gc_lock = threading.Lock()
_gc_users = 0
_gc_was_enabled = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic GC while a plan is made: it allocates a few objects per tensor,
    and with tens of thousands of tensors the collections it triggers, each scanning
    the caller's whole heap, were half the cold-path time (measured 0.47 s -> 0.23 s at
    20k tensors). Hazard: this is process-wide for those milliseconds. Counted across
    overlapping jobs: the first disables, the last re-enables, and only if the GC was on
    when the first started, so a caller that disabled GC keeps it off."""
    global _gc_users, _gc_was_enabled
    with _gc_lock:
        if _gc_users == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_users += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_users -= 1
            if _gc_users == 0 and _gc_was_enabled:
                gc.enable()


# -- interpreter exit ----------------------------------------------------------------------

_exit_lock = threading.Lock()
_exit_hooks: list[tuple[int, Callable[[], None]]] = []
_exit_registered = False


def at_exit(hook: Callable[[], None], order: int) -> None:
    """Run ``hook`` at interpreter exit, after every non-daemon thread has finished and
    before the interpreter finalizes (lowest ``order`` first; each hook once, even if
    registered again). The ``atexit`` handler is registered at the first call, so it
    runs before the handlers of modules imported before (``atexit`` is last in, first
    out). A hook must not hold what it cleans up strongly (stagers must stay
    collectable): keep a registry of the threads, not of their owners."""
    global _exit_registered
    with _exit_lock:
        if any(h is hook for _, h in _exit_hooks):
            return
        _exit_hooks.append((order, hook))
        _exit_hooks.sort(key=lambda item: item[0])
        if not _exit_registered:
            _exit_registered = True
            atexit.register(_run_exit_hooks)


def _run_exit_hooks() -> None:
    with _exit_lock:
        hooks = [h for _, h in _exit_hooks]
    for hook in hooks:
        try:
            hook()
        except Exception:  # noqa: BLE001 - the other hooks must still run
            pass


# -- fork ----------------------------------------------------------------------------------


def _after_fork_in_child() -> None:
    """The threads of the parent do not exist in a forked child: none of their locks
    can be released there, and their jobs never end there."""
    global _switch_lock, _gc_lock, _exit_lock, _gc_users, _switch_applied
    _switch_lock = threading.Lock()
    _gc_lock = threading.Lock()
    _exit_lock = threading.Lock()
    if _switch_users:
        # A job of the parent was running: the child starts with the user's value.
        del _switch_users[:]
        if _switch_applied is not None and sys.getswitchinterval() == _switch_applied:
            sys.setswitchinterval(_switch_saved)
        _switch_applied = None
    if _gc_users:
        _gc_users = 0
        if _gc_was_enabled:
            gc.enable()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
