"""The cached stage: a state dict staged again with the same layout (issue 24).

The walk takes flat dicts of plain tensors in bulk (``Walk._bulk_items``) and the
engine reuses the plan in one walk (``Engine._reuse``). These check that neither
weakens the guarantees: every field of the fingerprint still invalidates the plan, a
result the caller holds is never overwritten, data changed between stages is staged
exactly, and the bulk walk builds what the per-item walk builds. No timing here: the
bench measures (``python -m async_stager bench --workloads small20k``).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from helpers import assert_same, make_engine, stage_sync

from async_stager._core.run import engine as engine_mod
from async_stager._core.walk import tree
from async_stager._core.walk.tree import Walk
from async_stager.testing import FakeBackend

#: Enough items for the bulk path (``tree._BULK_MIN``), with a partial last chunk.
N = tree._BULK_MIN * 3 + 5


def _sd(n: int = N) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((4,), float(i)) for i in range(n)}


@pytest.fixture(params=["cpu", "fake-device"])
def engine(request: pytest.FixtureRequest) -> Iterator[Any]:
    e = make_engine(backend=FakeBackend()) if request.param == "fake-device" else make_engine()
    yield e
    e.close()


def _walk(
    sd: Any, hosts: list[torch.Tensor], *, bulk: bool, monkeypatch: pytest.MonkeyPatch
) -> tuple[Any, list[torch.Tensor]]:
    """(result, leaves) of a walk of ``sd`` onto ``hosts``, in bulk where it applies or not."""
    with monkeypatch.context() as m:
        if not bulk:
            m.setattr(tree, "_BULK_MIN", 10**9)
        w = Walk(hosts, validate=False, tick=lambda: None)
        return w.rebuild(sd), w.leaves


def _structures() -> list[Any]:
    base = _sd()
    t = torch.arange(4.0)
    p = torch.nn.Parameter(torch.ones(3))
    with_attr = torch.zeros(2)
    with_attr.note = "x"  # type: ignore[attr-defined]
    return [
        base,
        {**base, "p": p, "again": base["t0"]},  # a Parameter, the same tensor twice
        {**base, "n": 3, "s": "x"},  # atomic values: the per-item loop
        {**base, t: 1},  # a tensor as a key: the per-item loop
        {**base, "a": with_attr},  # a tensor with attributes: the per-item loop
        collections.OrderedDict(base),
        collections.defaultdict(list, base),
        {"model": base, "optim": {"state": {0: {"m": t}}, "lr": 0.1}, "tail": dict(base)},
    ]


@pytest.mark.parametrize("index", range(len(_structures())))
def test_bulk_walk_builds_what_the_item_walk_builds(index: int, monkeypatch: pytest.MonkeyPatch) -> None:
    sd = _structures()[index]
    count = len(_walk(sd, [], bulk=False, monkeypatch=monkeypatch)[1])
    hosts = [torch.empty(0) for _ in range(count)]
    a, fast = _walk(sd, hosts, bulk=True, monkeypatch=monkeypatch)
    b, slow = _walk(sd, hosts, bulk=False, monkeypatch=monkeypatch)
    assert [id(x) for x in fast] == [id(x) for x in slow]

    def same(x: Any, y: Any) -> None:
        assert type(x) is type(y)
        if isinstance(x, dict):
            assert list(x) == list(y)
            if isinstance(x, collections.defaultdict):
                assert x.default_factory is y.default_factory
            for k in x:
                same(x[k], y[k])
        elif isinstance(x, torch.Tensor):
            # The hosts themselves, or an alias of the same host (attributes).
            assert x.data_ptr() == y.data_ptr() and x.shape == y.shape
            assert (x is y) == (not x.__dict__)
        else:
            assert x == y

    same(a, b)
    # Without hosts (the slow path's collecting walk): the leaves stay the sources.
    _, bare = _walk(sd, [], bulk=True, monkeypatch=monkeypatch)
    assert [id(x) for x in bare] == [id(x) for x in slow]


def test_bulk_walk_ticks_between_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tree, "_BULK_CHUNK", 16)
    calls = 0

    class Stop(tree.Interrupt):
        pass

    def tick() -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise Stop()

    with pytest.raises(Stop):
        Walk([], validate=False, tick=tick).rebuild(_sd())
    assert calls == 3


def _mutations() -> list[tuple[str, Callable[[dict[str, Any]], None]]]:
    def shape(sd: dict[str, Any]) -> None:
        sd["t5"].data = sd["t5"].data.view(2, 2)

    def dtype(sd: dict[str, Any]) -> None:
        sd["t5"].data = sd["t5"].data.view(torch.int32)

    def stride(sd: dict[str, Any]) -> None:
        sd["sq"].t_()

    def offset(sd: dict[str, Any]) -> None:
        t = sd["t5"]
        base = torch.arange(8.0)
        t.set_(base.untyped_storage(), 4, (4,), (1,))

    def storage(sd: dict[str, Any]) -> None:
        sd["t5"].set_(torch.full((4,), -1.0))

    def conj(sd: dict[str, Any]) -> None:
        sd["c"] = sd["c"].conj()

    def neg(sd: dict[str, Any]) -> None:
        sd["t5"] = torch._neg_view(sd["t5"])

    def requires_grad(sd: dict[str, Any]) -> None:
        sd["t5"].requires_grad_(True)

    def parameter(sd: dict[str, Any]) -> None:
        sd["t5"] = torch.nn.Parameter(sd["t5"], requires_grad=False)

    def new_key(sd: dict[str, Any]) -> None:
        sd["t_new"] = torch.ones(4)

    def swap_keys(sd: dict[str, Any]) -> None:
        sd["t5"], sd["t6"] = sd["t6"], sd["t5"]

    def alias(sd: dict[str, Any]) -> None:
        sd["t6"] = sd["t5"]

    def values(sd: dict[str, Any]) -> None:
        for v in list(sd.values())[::7]:
            v.add_(1)

    return [
        (f.__name__, f)
        for f in (
            shape,
            dtype,
            stride,
            offset,
            storage,
            conj,
            neg,
            requires_grad,
            parameter,
            new_key,
            swap_keys,
            alias,
            values,
        )
    ]


@pytest.mark.parametrize(("name", "mutate"), _mutations(), ids=[n for n, _ in _mutations()])
def test_every_change_between_stages_is_staged_exactly(
    engine: Any, name: str, mutate: Callable[[dict[str, Any]], None]
) -> None:
    sd: dict[str, Any] = {
        **_sd(),
        "sq": torch.arange(16.0).view(4, 4),
        "c": torch.randn(4, dtype=torch.cfloat),
    }
    del stage_sync(engine, sd).result
    s = stage_sync(engine, sd)
    assert s.fast_path and s.misses == 0  # cached: the bulk walk and the reused plan
    assert_same(s.result, sd)
    del s
    mutate(sd)
    s = stage_sync(engine, sd)
    assert_same(s.result, sd)
    if name == "values":
        assert s.fast_path  # data changes only: the plan still holds
    del s
    s = stage_sync(engine, sd)  # and the stage after the change is cached again
    assert_same(s.result, sd)


def test_held_result_is_never_overwritten(engine: Any) -> None:
    sd = _sd()
    first = stage_sync(engine, sd).result
    expected = {k: v.clone() for k, v in sd.items()}
    for v in sd.values():
        v.mul_(-3)
    second = stage_sync(engine, sd).result  # the first result is held: another set
    assert_same(first, expected)
    assert_same(second, sd)
    assert not {t.data_ptr() for t in first.values()} & {t.data_ptr() for t in second.values()}
    del second
    for v in sd.values():
        v.add_(1)
    third = stage_sync(engine, sd).result  # reuses the second's set, never the first's
    assert_same(first, expected)
    assert_same(third, sd)


def test_cached_stage_walks_once(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    walks = 0

    class Counting(Walk):
        __slots__ = ()

        def rebuild(self, obj: Any) -> Any:
            nonlocal walks
            walks += 1
            return super().rebuild(obj)

    monkeypatch.setattr(engine_mod, "Walk", Counting)
    sd = _sd()
    del stage_sync(engine, sd).result
    assert walks == 2  # a new plan: collect, then build
    walks = 0
    s = stage_sync(engine, sd)
    assert s.fast_path and walks == 1
    del s
    walks = 0
    # New tensors of the same layout, their predecessors dead, take the memory over:
    # one walk too.
    sd = {k: v.clone() for k, v in sd.items()}
    s = stage_sync(engine, sd)
    assert s.fast_path and walks == 1
    assert_same(s.result, sd)
