"""DefaultStager's drop-in API surface (issue 13, part 1): keys passed through, the
latest staged dict, pinned bytes, a shared staging executor, thread name, contextvars
and logging, through the public API."""

from __future__ import annotations

import concurrent.futures
import contextvars
import copyreg
import logging
import sys
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ClassVar
from unittest import mock

import pytest
import torch
from helpers import assert_same

from async_stager import (
    AcceleratorRequiredError,
    BuffersHeldError,
    CheckpointStager,
    CheckpointStagerConfig,
    ClosedError,
    DefaultStager,
    Stager,
    StagingError,
    UnsupportedError,
)
from async_stager._dcp.default_stager import DEFAULT_MAX_BUFFER_SETS
from async_stager.testing import FakeBackend, FakePinner

pytestmark = pytest.mark.timeout(60)

SYNC = CheckpointStagerConfig(use_async_staging=False, use_shared_memory=False)
ASYNC = CheckpointStagerConfig(use_shared_memory=False)
REQUEST = contextvars.ContextVar[str]("request", default="unset")


def sample() -> dict[str, Any]:
    return {"model": {"w": torch.randn(8, 8)}, "ids": torch.arange(4), "step": 3}


def staged_of(x: Any) -> dict[str, Any]:
    if isinstance(x, Future):
        x = x.result(timeout=30)
    assert isinstance(x, dict)
    return x


# -- keys_not_requiring_copy ----------------------------------------------------------


@pytest.mark.parametrize("config", [SYNC, ASYNC], ids=["sync", "async"])
def test_keys_not_requiring_copy_pass_through(config: CheckpointStagerConfig) -> None:
    sd = sample()
    with DefaultStager(config) as stager:
        staged = staged_of(stager.stage(sd, keys_not_requiring_copy={"ids", "absent"}))
        assert list(staged) == list(sd)  # order kept
        assert staged["ids"] is sd["ids"]
        assert staged["model"]["w"] is not sd["model"]["w"]
        assert_same(staged, sd)
        again = staged_of(stager.stage(sd, ["model"]))  # positional too
        assert again["model"] is sd["model"]
        assert again["ids"] is not sd["ids"]
        assert torch.equal(again["ids"], sd["ids"])
        assert "ids" in sd and sd["ids"] is not None  # the source is left alone


def test_unknown_keyword_and_bad_keys_raise_type_error() -> None:
    with DefaultStager(SYNC) as stager:
        with pytest.raises(TypeError):
            stager.stage(sample(), non_blocking=True)  # type: ignore[call-arg]
        with pytest.raises(TypeError, match="not a str"):
            stager.stage(sample(), keys_not_requiring_copy="ids")
        with pytest.raises(TypeError):
            stager.stage([torch.ones(1)], keys_not_requiring_copy=[0])  # type: ignore[arg-type]
        sd = sample()
        assert_same(staged_of(stager.stage(sd, ())), sd)  # still usable


# -- torch_checkpointing's defaults and held results (issue 26) -----------------------


@pytest.mark.parametrize("can_pin", [False, True])
def test_config_defaults_follow_the_accelerator(can_pin: bool) -> None:
    # As torch_checkpointing's: read at construction, from torch.cuda.
    with (
        mock.patch("torch.cuda.is_available", return_value=can_pin),
        mock.patch("torch.cuda.cudart", return_value=object() if can_pin else None),
    ):
        config = CheckpointStagerConfig()
    assert config.use_pinned_memory is can_pin
    assert config.use_non_blocking_copy is can_pin
    assert config.use_shared_memory and config.use_async_staging
    assert (config.thread_name, config.metric_prefix) == ("ckpt-staging", "train.checkpoint_write")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_cuda_only_flags_without_cuda_as_torch_checkpointing() -> None:
    """torch_checkpointing asserts for non-blocking copies without CUDA (ours is typed and
    also an AssertionError), and ignores use_pinned_memory=True with a warning, staging
    unpinned (torchtitan asks for it on CPU-only runs): ours does the same."""
    off: dict[str, Any] = {"use_pinned_memory": False, "use_non_blocking_copy": False}
    for flags in (
        {"use_non_blocking_copy": True},
        {"use_pinned_memory": True, "use_non_blocking_copy": True},
    ):
        config = CheckpointStagerConfig(**{**off, **flags})
        with pytest.raises(AssertionError) as info, warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the pinned flag's, when given
            DefaultStager(config)
        assert isinstance(info.value, AcceleratorRequiredError)
        assert isinstance(info.value, UnsupportedError)
        assert "needs CUDA" in str(info.value)
    for config in (
        CheckpointStagerConfig(**{**off, "use_pinned_memory": True}),
        CheckpointStagerConfig(use_pinned_memory=True),  # torchtitan's: the rest defaulted
    ):
        with pytest.warns(UserWarning, match="pinning host memory needs CUDA") as seen:
            stager = DefaultStager(config)
        assert seen[0].filename == __file__  # points at the caller's line
        with stager:
            sd = sample()
            staged = stager.stage(sd)
            assert_same(staged.result(timeout=30) if isinstance(staged, Future) else staged, sd)
            assert stager.pinned_num_bytes() == 0


def test_held_results_grow_buffer_sets_up_to_the_bound(caplog: pytest.LogCaptureFixture) -> None:
    # torch_checkpointing's test_multiple_staging_operations keeps every result: no
    # wait, a warning naming the memory for each set beyond two.
    caplog.set_level(logging.WARNING, logger="async_stager.stage")
    sd = sample()
    with DefaultStager(SYNC) as stager:
        held = [stager.stage(sd) for _ in range(DEFAULT_MAX_BUFFER_SETS)]
        assert stager._engine.buffer_sets == DEFAULT_MAX_BUFFER_SETS
        for staged in held:
            assert_same(staged, sd)
    grown = [r.getMessage() for r in caplog.records if "buffer sets" in r.getMessage()]
    assert len(grown) == DEFAULT_MAX_BUFFER_SETS - 2
    assert "host bytes" in grown[0] and "max_buffer_sets=4" in grown[0]


def test_held_results_past_the_bound_raise() -> None:
    sd = sample()
    with DefaultStager(SYNC, max_buffer_sets=2, buffer_wait_timeout=0.2) as stager:
        held = [stager.stage(sd) for _ in range(2)]
        with pytest.raises(BuffersHeldError, match="max_buffer_sets=2"):
            stager.stage(sd)
        del held
        assert_same(stager.stage(sd), sd)  # dropped: a set is free again


def test_get_staged_state_dict_is_abstract() -> None:
    class NoLatest(CheckpointStager):
        def stage(self, state_dict: Any, keys_not_requiring_copy: Any = ()) -> Any:
            return state_dict

        def close(self) -> None:
            pass

    with pytest.raises(TypeError):
        NoLatest()  # type: ignore[abstract]


# -- get_staged_state_dict -------------------------------------------------------------


@pytest.mark.parametrize("config", [SYNC, ASYNC], ids=["sync", "async"])
def test_get_staged_state_dict_none_after_a_failed_stage(config: CheckpointStagerConfig) -> None:
    # torch_checkpointing's test_get_staged_state_dict_none_after_failure, through the
    # public API (a stage that fails on its own) instead of a patched private stager.
    with DefaultStager(config) as stager:
        staged_of(stager.stage(sample()))
        assert stager.get_staged_state_dict() is not None
        with pytest.raises(StagingError, match="bad"):
            staged_of(stager.stage({"bad": torch.empty(1, device="meta")}))
        assert stager.get_staged_state_dict() is None


def test_get_staged_state_dict() -> None:
    sd = sample()
    with DefaultStager(ASYNC) as stager:
        assert stager.get_staged_state_dict() is None
        staged = staged_of(stager.stage(sd))
        assert stager.get_staged_state_dict() is staged
        fut = stager.stage({"bad": torch.empty(1, device="meta")})
        assert isinstance(fut, Future)
        with pytest.raises(StagingError):
            fut.result(timeout=30)
        assert stager.get_staged_state_dict() is None
        staged = staged_of(stager.stage(sd))
        assert stager.get_staged_state_dict() is staged
    assert stager.get_staged_state_dict() is None


def test_latest_is_let_go_at_the_next_stage() -> None:
    # Held by nobody but the stager, the latest result does not cost a second set.
    sd = sample()
    with DefaultStager(SYNC) as stager:
        for _ in range(3):
            stager.stage(sd)
            assert stager.get_staged_state_dict() is not None
        assert stager._engine.buffer_sets == 1
        held = stager.get_staged_state_dict()
        assert held is not None
        stager.stage(sd)  # the caller holds the previous one: a second set
        assert stager._engine.buffer_sets == 2
        assert torch.equal(held["model"]["w"], sd["model"]["w"])


# -- pinned_num_bytes ------------------------------------------------------------------


def test_pinned_num_bytes() -> None:
    class Minimal(CheckpointStager):
        def stage(self, state_dict: Any, keys_not_requiring_copy: Any = ()) -> Any:
            return state_dict

        def get_staged_state_dict(self) -> Any:
            return None

        def close(self) -> None:
            pass

    assert Minimal().pinned_num_bytes() == 0
    with DefaultStager(SYNC) as plain:
        plain.stage(sample())
        assert plain.host_bytes > 0
        assert plain.pinned_num_bytes() == 0
    config = CheckpointStagerConfig(use_async_staging=False, use_pinned_memory=True, use_shared_memory=False)
    with DefaultStager(config, backend=FakeBackend(), pinner=FakePinner()) as pinned:
        assert pinned.pinned_num_bytes() == 0
        pinned.stage(sample())
        assert pinned.pinned_num_bytes() == pinned.host_bytes > 0
    assert pinned.pinned_num_bytes() == 0


# -- staging_executor ------------------------------------------------------------------


def test_shared_executor() -> None:
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="mine") as pool:
        stagers = [DefaultStager(ASYNC, staging_executor=pool) for _ in range(3)]
        sds = [sample() for _ in stagers]
        # Two in flight each: a third would wait for one of the two results (held by
        # their Futures here) to be dropped (max_buffer_sets=2).
        futs = [[s.stage(sd) for _ in range(2)] for s, sd in zip(stagers, sds)]
        for row, sd in zip(futs, sds):
            for f in row:
                assert_same(staged_of(f), sd)
        del futs, row, f  # their results: the buffer sets are free again
        where: list[str] = []

        class Spy:
            def __reduce_ex__(self, protocol: Any) -> Any:
                where.append(threading.current_thread().name)
                return (Spy, ())

        staged_of(stagers[0].stage({"spy": Spy()}))
        assert where and where[0].startswith("mine")
        for s in stagers:
            s.close()
        # Left running for its owner.
        assert pool.submit(lambda: 7).result(timeout=10) == 7
        with pytest.raises(ClosedError):
            stagers[0].stage(sample())


def test_executor_stages_of_one_stager_run_in_order_one_at_a_time() -> None:
    active = 0
    most = 0
    order: list[int] = []
    lock = threading.Lock()

    class Slow:
        def __init__(self, n: int) -> None:
            self.n = n

        def __reduce_ex__(self, protocol: Any) -> Any:
            nonlocal active, most
            with lock:
                active += 1
                most = max(most, active)
                order.append(self.n)
            time.sleep(0.01)
            with lock:
                active -= 1
            return (Slow, (self.n,))

    with ThreadPoolExecutor(max_workers=4) as pool, DefaultStager(ASYNC, staging_executor=pool) as stager:
        # Results without a tensor hold no buffer set: any number may be in flight.
        futs = [stager.stage({"x": Slow(i)}) for i in range(6)]
        cancelled = futs[5]
        assert isinstance(cancelled, Future)
        cancelled.cancel()  # may or may not have started: either way no deadlock
        stager.synchronize_staging()
        for f in futs[:5]:
            staged_of(f)
    assert most == 1
    assert order == sorted(order)


def test_executor_needs_async_staging() -> None:
    with ThreadPoolExecutor(max_workers=1) as pool:
        with pytest.raises(ValueError, match="use_async_staging"):
            DefaultStager(SYNC, staging_executor=pool)
        with pytest.raises(TypeError):
            DefaultStager(ASYNC, staging_executor=object())  # type: ignore[arg-type]
    with pytest.raises(ClosedError), DefaultStager(ASYNC, staging_executor=pool) as stager:
        stager.stage(sample())  # the executor was shut down


# -- thread name -----------------------------------------------------------------------


def test_thread_name_also_at_os_level() -> None:
    seen: dict[str, Any] = {}

    class Probe:
        def __reduce_ex__(self, protocol: Any) -> Any:
            seen["name"] = threading.current_thread().name
            seen["tid"] = threading.get_native_id()
            return (Probe, ())

    config = CheckpointStagerConfig(use_shared_memory=False, thread_name="ckpt-stager-rank-0-long")
    with DefaultStager(config) as stager:
        staged_of(stager.stage({"p": Probe()}))
        assert seen["name"] == "ckpt-stager-rank-0-long"
        if sys.platform.startswith("linux"):
            with open(f"/proc/self/task/{seen['tid']}/comm") as f:
                assert f.read().strip() == "ckpt-stager-ran"  # 15 bytes
    with pytest.raises(TypeError):
        DefaultStager(CheckpointStagerConfig(thread_name=3))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        DefaultStager(CheckpointStagerConfig(metric_prefix=""))


# -- contextvars -----------------------------------------------------------------------


class Reads:
    """Records the caller's context variable when the walk reduces it."""

    seen: ClassVar[list[str]] = []

    def __reduce_ex__(self, protocol: Any) -> Any:
        Reads.seen.append(REQUEST.get())
        return copyreg.__newobj__, (Reads,)  # type: ignore[attr-defined]


@pytest.mark.parametrize("config", [SYNC, ASYNC], ids=["sync", "async"])
def test_default_stager_runs_in_the_callers_context(config: CheckpointStagerConfig) -> None:
    Reads.seen = []
    with DefaultStager(config) as stager:
        token = REQUEST.set("step-1")
        try:
            fut = stager.stage({"r": Reads()})
        finally:
            REQUEST.reset(token)
        REQUEST.set("later")  # after the call: not seen by that stage
        staged_of(fut)
        with ThreadPoolExecutor(max_workers=1) as pool, DefaultStager(ASYNC, staging_executor=pool) as other:
            REQUEST.set("step-2")
            staged_of(other.stage({"r": Reads()}))
    # (the walk may reduce an object more than once)
    assert list(dict.fromkeys(Reads.seen)) == ["step-1", "step-2"]


@pytest.mark.anyio
async def test_stager_runs_in_the_callers_context() -> None:
    Reads.seen = []
    async with Stager(share_memory=False, copy_threads=2) as stager:
        REQUEST.set("async-1")
        await stager.stage({"r": Reads()})
    assert set(Reads.seen) == {"async-1"}


# -- logging ---------------------------------------------------------------------------


def test_default_stager_logs_start_and_end(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    seen_in_filter: list[str] = []

    def context_filter(record: logging.LogRecord) -> bool:
        seen_in_filter.append(REQUEST.get())
        return True

    logger = logging.getLogger("async_stager.stage")
    logger.addFilter(context_filter)
    try:
        caplog.set_level(logging.DEBUG, logger="async_stager")
        config = CheckpointStagerConfig(use_shared_memory=False, metric_prefix="train.ckpt")
        with DefaultStager(config) as stager:
            REQUEST.set("logged")
            sd = sample()
            staged_of(stager.stage(sd))
            staged_of(stager.stage(sd))
    finally:
        logger.removeFilter(context_filter)
    records = [r for r in caplog.records if r.name.startswith("async_stager")]
    infos = [r for r in records if r.levelno == logging.INFO]
    assert len(infos) == 4
    assert "started" in infos[0].getMessage()
    end = infos[3]
    metrics = end.metrics  # type: ignore[attr-defined]
    assert set(metrics) == {"train.ckpt.stage_seconds", "train.ckpt.bytes", "train.ckpt.cache_hits"}
    assert metrics["train.ckpt.bytes"] == 8 * 8 * 4 + 4 * 8
    assert metrics["train.ckpt.cache_hits"] == 2  # the second stage reuses both buffers
    assert metrics["train.ckpt.stage_seconds"] > 0
    assert "train.ckpt.bytes=288" in end.getMessage()
    assert any(r.levelno == logging.DEBUG for r in records)
    assert set(seen_in_filter) == {"logged"}
    assert capsys.readouterr().out == ""


def test_default_stager_logs_failures(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="async_stager")
    with DefaultStager(SYNC) as stager, pytest.raises(StagingError):
        stager.stage({"bad": torch.empty(1, device="meta")})
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("async_stager")]
    assert any("failed" in m for m in messages)


@pytest.mark.anyio
async def test_stager_logs_start_and_end(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="async_stager")
    async with Stager(share_memory=False, copy_threads=2) as stager:
        await stager.stage(sample())
    infos = [r for r in caplog.records if r.name.startswith("async_stager") and r.levelno == logging.INFO]
    assert len(infos) == 2
    metrics = infos[1].metrics  # type: ignore[attr-defined]
    assert set(metrics) == {"async_stager.stage_seconds", "async_stager.bytes", "async_stager.cache_hits"}
    assert metrics["async_stager.bytes"] == 288


# -- context manager -------------------------------------------------------------------


def test_context_manager_closes() -> None:
    with DefaultStager(ASYNC) as stager:
        assert isinstance(stager, DefaultStager)
        staged_of(stager.stage(sample()))
    with pytest.raises(ClosedError):
        stager.stage(sample())
    assert stager.host_bytes == 0


def test_executor_close_waits_for_its_stages() -> None:
    with ThreadPoolExecutor(max_workers=1) as pool:
        stager = DefaultStager(ASYNC, staging_executor=pool)
        futs = [stager.stage(sample()) for _ in range(2)]
        stager.close()
        assert all(isinstance(f, Future) and f.done() for f in futs)
        concurrent.futures.wait([f for f in futs if isinstance(f, Future)])
