"""Model-based test of the Checkpointer on S3 (issue 44): a hypothesis state machine
drives one open Checkpointer on ``s3://`` (the real server) through saves (new steps
and steps saved again), waits, a corrupted object of a committed step, restores of the
newest and of a named step, and a close and reopen (a second process would see the
same), and checks after every rule against a small model: ``steps()`` is the commit
order with ``keep`` retention (a step saved again moves to the end), each kept step
restores bit-exact with the values of its newest save (never a mix of two saves), a
corrupted one never restores, and ``restore()`` returns the newest that verifies."""

from __future__ import annotations

import functools
import os
import uuid
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import torch
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import HealthCheck, Phase, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from async_stager import Checkpointer
from async_stager.errors import IntegrityError
from tests.store.conftest import admin_client

pytestmark = [pytest.mark.timeout(600)]


def _state(step: int, version: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(version)
    return {"w": torch.randn(64, 32, generator=g), "meta": {"step": step, "version": version}}


class S3Machine(RuleBasedStateMachine):
    url: str
    bucket: str
    port: int
    fmt: str

    def __init__(self) -> None:
        super().__init__()
        self.portal_cm = start_blocking_portal("asyncio")
        self.portal: BlockingPortal = self.portal_cm.__enter__()
        self.prefix = f"run-{uuid.uuid4().hex[:8]}"
        self.ckpt: Checkpointer | None = None
        self.keep = 2
        self.version = 0
        self.order: list[int] = []  # commit order, a step once (its newest commit)
        self.versions: dict[int, int] = {}  # step -> the version of its newest save
        self.damaged: set[int] = set()
        self.flips = 0

    def call(self, make: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
        return self.portal.call(make)

    def _open(self) -> None:
        url = f"s3://{self.bucket}/{self.prefix}"
        self.ckpt = Checkpointer(url, keep=self.keep, format=self.fmt)  # type: ignore[arg-type]
        # Entered and left in one task of the portal's loop (its task group's owner).
        self.opened = self.portal.wrap_async_context_manager(self.ckpt)
        self.opened.__enter__()

    def _close(self) -> None:
        if self.ckpt is not None:
            self.ckpt = None
            self.opened.__exit__(None, None, None)

    @initialize(keep=st.integers(1, 3))
    def open(self, keep: int) -> None:
        self.keep = keep
        self._open()

    @rule(step=st.integers(0, 5))
    def save(self, step: int) -> None:
        assert self.ckpt is not None
        self.version += 1
        self.call(functools.partial(self.ckpt.save, _state(step, self.version), step=step))
        self.call(self.ckpt.wait)
        if step in self.order:
            self.order.remove(step)
        self.order.append(step)
        self.order = self.order[-self.keep :]
        self.versions[step] = self.version
        self.damaged.discard(step)

    @rule(data=st.data())
    def corrupt(self, data: st.DataObject) -> None:
        if not self.order:
            return
        step = data.draw(st.sampled_from(self.order))
        client = admin_client(self.port)
        keys = [
            o["Key"]
            for o in client.list_objects_v2(Bucket=self.bucket, Prefix=f"{self.prefix}/").get("Contents", [])
        ]
        # The newest committed save of the step (its record's prefix, by save number).
        saves = sorted(
            {k.split("/")[1] for k in keys if k.split("/")[1].startswith(f"step-{step:08d}.")},
            key=lambda p: int(p.rsplit(".", 1)[1]),
        )
        committed = [p for p in saves if f"{self.prefix}/{p}/COMMIT" in keys]
        target = next(
            k
            for k in keys
            if k.startswith(f"{self.prefix}/{committed[-1]}/") and k.endswith((".distcp", "state.pt"))
        )
        body = bytearray(client.get_object(Bucket=self.bucket, Key=target)["Body"].read())
        # A byte no earlier corruption changed (twice the same flip would undo it).
        self.flips += 1
        body[(len(body) // 2 + self.flips) % len(body)] ^= 0x5A
        client.put_object(Bucket=self.bucket, Key=target, Body=bytes(body))
        self.damaged.add(step)

    @rule()
    def reopen(self) -> None:
        self._close()
        self._open()

    @rule(data=st.data())
    def restore_step(self, data: st.DataObject) -> None:
        assert self.ckpt is not None
        if not self.order:
            return
        step = data.draw(st.sampled_from(self.order))
        got = _state(0, 0)
        if step in self.damaged:
            with pytest.raises(IntegrityError):
                self.call(functools.partial(self.ckpt.restore, got, step=step, fallback=False))
            return
        assert self.call(functools.partial(self.ckpt.restore, got, step=step, fallback=False)) == step
        want = _state(step, self.versions[step])
        assert torch.equal(got["w"], want["w"]) and got["meta"] == want["meta"]

    @invariant()
    def steps_and_newest(self) -> None:
        if self.ckpt is None:
            return
        assert self.ckpt.steps() == self.order
        good = [s for s in self.order if s not in self.damaged]
        got = _state(0, 0)
        if not good:
            if self.order:
                with pytest.raises(IntegrityError):
                    self.call(functools.partial(self.ckpt.restore, got))
            else:
                assert self.call(functools.partial(self.ckpt.restore, got)) is None
            return
        assert self.call(functools.partial(self.ckpt.restore, got)) == good[-1]
        want = _state(good[-1], self.versions[good[-1]])
        assert torch.equal(got["w"], want["w"]) and got["meta"] == want["meta"]

    def teardown(self) -> None:
        try:
            self._close()
        finally:
            self.portal_cm.__exit__(None, None, None)


def _run(bucket: str, port: int, fmt: str, cfg: settings) -> None:
    machine = type("Machine", (S3Machine,), {"bucket": bucket, "port": port, "fmt": fmt})
    run_state_machine_as_test(machine, settings=cfg)


_HEALTH = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]


@pytest.fixture(autouse=True)
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ASYNC_STAGER_SCRATCH", str(tmp_path / "scratch"))
    return tmp_path / "scratch"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("fmt", ["dcp", "torch"])
def test_model_on_s3(bucket: str, moto_port: int, fmt: str) -> None:
    """The default run: a few fixed examples (derandomized, no shrinking)."""
    cfg = settings(
        max_examples=3,
        stateful_step_count=10,
        deadline=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.reuse, Phase.generate],
        suppress_health_check=_HEALTH,
    )
    _run(bucket, moto_port, fmt, cfg)


@pytest.mark.stress
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("fmt", ["dcp", "torch"])
def test_model_on_s3_stress(bucket: str, moto_port: int, fmt: str) -> None:
    cfg = settings(
        max_examples=int(os.environ.get("ASYNC_STAGER_S3_EXAMPLES", "60")),
        stateful_step_count=30,
        deadline=None,
        suppress_health_check=_HEALTH,
    )
    _run(bucket, moto_port, fmt, cfg)
