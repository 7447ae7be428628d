"""A SIGTERM reaches both a trainer's ``Shutdown`` and the memory tier's agent served
in the same process, whichever started first, and still reaches the ``Shutdown`` once
the agent stopped (issue 45's review of ``_tier/service.py``: the service opened a
signal receiver of its own, which took the signal from a ``Shutdown`` opened before it,
and on asyncio left SIG_DFL behind when it stopped: a SIGTERM then killed the process
instead of reaching the ``Shutdown``).

One child process runs every case on asyncio, uvloop and trio (a deaf case must never
kill the test process).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.tier.helpers_tier import child_env, short_base

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "signals_child.py")
BACKENDS = "asyncio,asyncio+uvloop,trio"
ORDERS = ("shutdown-first", "service-first", "service-leaves")


@pytest.mark.timeout(120)
def test_shutdown_and_agent_service_both_hear_sigterm() -> None:
    with short_base() as base:
        p = subprocess.run(
            [sys.executable, CHILD, BACKENDS, ",".join(ORDERS), base],
            capture_output=True,
            text=True,
            timeout=100,
            env=child_env(),
        )
    lines = [line.split() for line in p.stdout.splitlines() if line.startswith("RESULT")]
    got = {(b, o): (s, " ".join(why)) for _, b, o, s, *why in lines}
    want = {}
    for backend in BACKENDS.split(","):
        want[(backend, "shutdown-first")] = ("15", "signal 15")
        want[(backend, "service-first")] = ("15", "signal 15")
        want[(backend, "service-leaves")] = ("15", "idle 0.2 s with no trainer connected")
    assert got == want, (p.returncode, p.stdout, p.stderr[-3000:])
    assert p.returncode == 0
