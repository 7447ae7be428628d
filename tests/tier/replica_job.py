"""Running ``replica_child.py`` jobs whose "nodes" each have their own agent (its own
runtime folder): the ranks, what they print, SIGKILLs of a node whole."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.tier.helpers_tier import child_env

CHILD = Path(__file__).resolve().parent / "replica_child.py"
#: A hang guard for a rank to print what is waited for (torch's import, gloo's
#: rendezvous and a restore on a loaded machine).
WAIT = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Proc:
    """A child process and the lines it printed (read by a thread)."""

    proc: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None

    def read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.strip())

    def start_reading(self) -> Proc:
        self.reader = threading.Thread(target=self.read, daemon=True)
        self.reader.start()
        return self

    def first(self, word: str) -> list[str] | None:
        for line in list(self.lines):
            if line.split()[:1] == [word]:
                return line.split()[1:]
        return None

    def last(self, word: str) -> list[str] | None:
        for line in reversed(list(self.lines)):
            if line.split()[:1] == [word]:
                return line.split()[1:]
        return None

    def restored(self) -> tuple[int | None, str]:
        got = self.first("RESTORED")
        assert got is not None, self.lines
        return (None if got[0] == "None" else int(got[0])), got[1]

    def replicated(self) -> int | None:
        got = self.last("REPLICATED")
        return int(got[0]) if got else None

    def wait_for(self, word: str, *others: Proc, timeout: float = WAIT) -> list[str]:
        end = time.monotonic() + timeout
        while True:
            got = self.first(word)
            if got is not None:
                return got
            for p in (self, *others):
                assert p.proc.poll() is None, (
                    f"a process exited before {word}: {p.lines} (exit {p.proc.returncode})"
                )
            assert time.monotonic() < end, f"no {word} in {timeout} s: {self.lines}"
            time.sleep(0.01)

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(30)
        if self.reader is not None:
            self.reader.join(30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def rank(
    directory: Path, job: str, base: str, steps: int, mode: str, r: int, world: int, port: int, **env: str
) -> Proc:
    """Rank ``r`` of a job of ``world`` ranks (plain gloo rendezvous on ``port``); its
    stderr goes to ``rank<r>.err`` beside ``directory`` (appended)."""
    cmd = [sys.executable, str(CHILD), str(directory), job, base, str(steps), mode]
    cmd += [str(r), str(world), str(port)]
    with open(directory.parent / f"rank{r}.err", "a") as err:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=dict(child_env(), OMP_NUM_THREADS="1", **env),
            start_new_session=True,
        )
    return Proc(proc).start_reading()


def agent(job: str, base: str, *extra: str) -> Proc:
    """A node's agent, ready (its line printed)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "async_stager", "agent", "--job", job, "--dir", base, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=child_env(),
        start_new_session=True,
    )
    p = Proc(proc)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert "listening" in line, f"the agent did not start: {line!r}"
    return p.start_reading()


class InProcessAgent:
    """A node's agent served by a thread of this process (no process to start: the lean
    test's). ``kill`` stops it: every snapshot it held is freed, as at its SIGKILL."""

    def __init__(self, job: str, base: str) -> None:
        from async_stager._tier.agent import Agent

        self.agent = Agent(job, max_bytes=1 << 30, base=base)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"agent-{base}", daemon=True)
        self.thread.start()
        assert self._ready.wait(WAIT), "the in-process agent did not start"

    def _run(self) -> None:
        import anyio

        async def main() -> None:
            async with anyio.create_task_group() as tg:
                await tg.start(self.agent.serve)
                self._ready.set()
                while not self._stop.is_set():
                    await anyio.sleep(0.02)
                await self.agent.stop()

        anyio.run(main)

    def kill(self) -> None:
        self._stop.set()
        self.thread.join(WAIT)
        assert not self.thread.is_alive()
