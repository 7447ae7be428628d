"""Reliability: bad input. Every kind of input gets a clear outcome: staged correctly, or
a typed StagingError naming its path, and the stager stays usable afterwards.

The catalog below runs through the synchronous engine (fast, one case per test) and,
whole, through the async Stager on asyncio, uvloop and trio.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import os
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
from helpers import assert_same, make_engine, stage_sync

from async_stager import Stager, StagingError, UncopyableObjectError, UnsupportedTensorError
from async_stager.errors import InvalidStateDictError, NestingError

STRESS = bool(os.environ.get("ASYNC_STAGER_STRESS"))
stress = pytest.mark.skipif(not STRESS, reason="stress run: set ASYNC_STAGER_STRESS=1")


# -- the catalog ---------------------------------------------------------------------


class Color(enum.Enum):
    RED = 1
    BLUE = 2


class Point(NamedTuple):
    x: torch.Tensor
    y: int


@dataclasses.dataclass
class Holder:
    w: torch.Tensor
    note: str = "n"


class RaisingReduce:
    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError("refuses to be copied")


class RaisingSetstate:
    def __init__(self) -> None:
        self.t = torch.ones(2)

    def __setstate__(self, state: Any) -> None:
        raise ValueError("bad state")


class ReduceReturnsInt:
    def __reduce_ex__(self, protocol: Any) -> Any:
        return 42


class BadListIter:
    def __reduce_ex__(self, protocol: Any) -> Any:
        def items() -> Any:
            yield torch.ones(1)
            raise ValueError("listiter fails half way")

        return (list, (), None, items())


class WithSlots:
    __slots__ = ("a", "b")

    def __init__(self) -> None:
        self.a = torch.arange(3.0)
        self.b = "slot"


class PassThrough(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return super().__torch_function__(func, types, args, kwargs or {})


class Hostile(torch.Tensor):
    """A subclass whose __torch_function__ raises for every operation."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise RuntimeError("hostile __torch_function__")


def quiet(fn: Callable[[], Any]) -> Any:
    """Build with torch's beta/deprecation warnings silenced (warnings are errors here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn()


def nested_lists(depth: int) -> Any:
    x: Any = torch.ones(2)
    for _ in range(depth):
        x = [x]
    return x


def nested_dicts(depth: int) -> Any:
    x: Any = torch.ones(2)
    for _ in range(depth):
        x = {"x": x}
    return x


def freed() -> torch.Tensor:
    t = torch.ones(10)
    t.untyped_storage().resize_(0)
    return t


def shrunk() -> torch.Tensor:
    t = torch.ones(10)
    v = t[5:]
    t.untyped_storage().resize_(8)
    return v


def optim(leaf: Any) -> dict[str, Any]:
    """The path every error test uses: sd['optim']['state'][3]['exp_avg']."""
    return {
        "model": {"w": torch.ones(4)},
        "optim": {"state": {3: {"step": torch.tensor(1.0), "exp_avg": leaf}}, "param_groups": [{"lr": 0.1}]},
    }


P = "sd['optim']['state'][3]['exp_avg']"

# Cases that must raise: (id, builder, error class, path the message starts with).
ERRORS: list[tuple[str, Callable[[], Any], type[StagingError], str | None]] = [
    ("lock", lambda: optim(threading.Lock()), UncopyableObjectError, P),
    ("reduce-raises", lambda: optim(RaisingReduce()), UncopyableObjectError, P),
    ("setstate-raises", lambda: optim(RaisingSetstate()), UncopyableObjectError, P),
    ("reduce-returns-int", lambda: optim(ReduceReturnsInt()), UncopyableObjectError, P),
    ("listiter-raises", lambda: optim(BadListIter()), UncopyableObjectError, P),
    ("generator-object", lambda: optim(x for x in range(3)), UncopyableObjectError, P),
    ("open-file", lambda: optim(sys.__stderr__), UncopyableObjectError, P),
    ("memoryview", lambda: optim(memoryview(b"abc")), UncopyableObjectError, P),
    ("meta", lambda: optim(torch.empty(3, device="meta")), UnsupportedTensorError, P),
    (
        "meta-after-cpu-tensors",
        lambda: {"a": torch.ones(2), **optim(torch.empty(3, device="meta")), "z": torch.ones(1)},
        UnsupportedTensorError,
        P,
    ),
    ("sparse-coo", lambda: optim(torch.eye(3).to_sparse()), UnsupportedTensorError, P),
    ("sparse-csr", lambda: optim(quiet(lambda: torch.eye(3).to_sparse_csr())), UnsupportedTensorError, P),
    (
        "quantized",
        lambda: optim(quiet(lambda: torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8))),
        UnsupportedTensorError,
        P,
    ),
    (
        "nested-tensor",
        lambda: optim(quiet(lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]))),
        UnsupportedTensorError,
        P,
    ),
    ("storage-freed", lambda: optim(freed()), UnsupportedTensorError, P),
    ("storage-shrunk-under-view", lambda: optim(shrunk()), UnsupportedTensorError, P),
    (
        "meta-in-list-in-object",
        lambda: optim([Holder(torch.empty(1, device="meta"))]),
        UnsupportedTensorError,
        P + "[0].w",
    ),
    # A module or optimizer is not state: its state_dict() is (issue 41, section 4).
    ("nn-module-object", lambda: optim(torch.nn.Linear(2, 3)), InvalidStateDictError, P),
    ("5000-deep-lists", lambda: {"deep": nested_lists(5000)}, NestingError, None),
    ("5000-deep-dicts", lambda: {"deep": nested_dicts(5000)}, NestingError, None),
]


def check_cycle_list(sd: Any, out: Any) -> None:
    assert out["l"][0] is out["l"] and out["l"] is not sd["l"]
    assert torch.equal(out["l"][1], sd["l"][1])


def check_cycle_dict(sd: Any, out: Any) -> None:
    assert out["self"] is out and torch.equal(out["t"], sd["t"])


def check_cycle_object(sd: Any, out: Any) -> None:
    h = out["h"]
    assert h.note is h and torch.equal(h.w, sd["h"].w)
    assert h.w.data_ptr() != sd["h"].w.data_ptr()


def check_subclass(sd: Any, out: Any) -> None:
    for k in sd:
        assert type(out[k]) is type(sd[k])
        with torch._C.DisableTorchFunctionSubclass():
            assert torch.equal(out[k], sd[k])
            assert out[k].data_ptr() != sd[k].data_ptr()


def check_values(sd: Any, out: Any) -> None:
    """For views with lazy conj/neg bits: same values, same shapes (bit-level compare
    of such views would need resolving)."""
    for k in sd:
        assert torch.equal(out[k], sd[k]), k
        assert out[k].shape == sd[k].shape


def check_generator(sd: Any, out: Any) -> None:
    g, h = sd["rng"], out["rng"]
    assert h is not g and torch.equal(h.get_state(), g.get_state())
    assert torch.equal(torch.rand(4, generator=h), torch.rand(4, generator=g))


def check_grad(sd: Any, out: Any) -> None:
    assert out["y"].requires_grad and out["y"].grad_fn is None
    assert torch.equal(out["y"].detach(), sd["y"].detach())


def cycle_list() -> Any:
    lst: list[Any] = []
    lst.append(lst)
    lst.append(torch.arange(4.0))
    return {"l": lst}


def cycle_dict() -> Any:
    d: dict[str, Any] = {"t": torch.arange(3.0)}
    d["self"] = d
    return d


def cycle_object() -> Any:
    h = Holder(torch.arange(5.0))
    h.note = h  # type: ignore[assignment]
    return {"h": h}


def conj_alias() -> Any:
    x = torch.randn(6, dtype=torch.complex64)
    return {
        "x": x,
        "xc": x.conj(),
        "tail_c": x[2:].conj(),
        "neg": x.conj().imag,
        "c_only": torch.randn(3, dtype=torch.complex64).conj(),
    }


def rng() -> Any:
    g = torch.Generator()
    g.manual_seed(1234)
    torch.rand(7, generator=g)
    return {"rng": g, "w": torch.ones(2)}


def non_leaf() -> Any:
    x = torch.ones(3, requires_grad=True)
    return {"y": x * 2}


# Cases that must stage: (id, builder, checker; None means assert_same).
OKS: list[tuple[str, Callable[[], Any], Callable[[Any, Any], None] | None]] = [
    ("int-keys", lambda: {1: torch.ones(2), 2: {3: torch.zeros(1)}}, None),
    ("tuple-keys", lambda: {(1, "a"): torch.ones(2), (): torch.zeros(1)}, None),
    ("enum-keys", lambda: {Color.RED: torch.ones(2), Color.BLUE: 1}, None),
    (
        "mixed-keys",
        lambda: {None: torch.ones(1), 2.5: torch.ones(1), b"k": torch.ones(1), frozenset({1}): 3},
        None,
    ),
    ("cycle-list", cycle_list, check_cycle_list),
    ("cycle-dict", cycle_dict, check_cycle_dict),
    ("cycle-object", cycle_object, check_cycle_object),
    ("200-deep-lists", lambda: {"deep": nested_lists(200)}, None),
    ("subclass-torch-function", lambda: {"s": torch.arange(3.0).as_subclass(PassThrough)}, check_subclass),
    (
        "subclass-hostile-torch-function",
        lambda: {"s": torch.arange(3.0).as_subclass(Hostile)},
        check_subclass,
    ),
    ("conj-neg-views-and-aliases", conj_alias, check_values),
    (
        "zero-dim-empty-expanded",
        lambda: {"z": torch.tensor(3.0), "e": torch.empty(0, 5), "x": torch.ones(1).expand(9)},
        None,
    ),
    (
        "strided-layouts",
        lambda: {
            "t": torch.arange(12.0).view(3, 4).t(),
            "cl": torch.ones(2, 3, 4, 5).to(memory_format=torch.channels_last),
        },
        None,
    ),
    ("torch-generator", rng, check_generator),
    ("non-leaf-requires-grad", non_leaf, check_grad),
    (
        "namedtuple-dataclass-slots",
        lambda: {"p": Point(torch.ones(2), 1), "h": Holder(torch.zeros(2)), "s": WithSlots()},
        lambda sd, out: None,
    ),
    (
        "odd-containers",
        lambda: {
            "od": collections.OrderedDict(a=torch.ones(1)),
            "dq": collections.deque([torch.ones(2)]),
            "set": {1, 2},
            "ba": bytearray(b"x"),
        },
        lambda sd, out: None,
    ),
    (
        "classes-as-values",
        lambda: {"cls": Color, "abc": collections.abc.Mapping, "t": torch.ones(1)},
        lambda sd, out: None,
    ),
    ("root-not-a-dict", lambda: [torch.ones(2), (torch.zeros(1), 3)], None),
    ("tensor-as-key", lambda: {torch.ones(1): torch.ones(2)}, lambda sd, out: None),
]


def _check_error(exc: StagingError, cls: type[StagingError], path: str | None) -> None:
    assert isinstance(exc, cls), repr(exc)
    if path is not None:
        assert str(exc).startswith(path + ":"), str(exc)


def _still_usable(engine: Any) -> None:
    sd = {"after": torch.arange(10.0)}
    assert_same(stage_sync(engine, sd).result, sd)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("build", "cls", "path"), [pytest.param(b, c, p, id=i) for i, b, c, p in ERRORS])
def test_bad_input_is_a_typed_error_naming_the_path(build: Callable[[], Any], cls: Any, path: Any) -> None:
    engine = make_engine()
    try:
        sd = build()
        with pytest.raises(StagingError) as ei:
            stage_sync(engine, sd)
        _check_error(ei.value, cls, path)
        _still_usable(engine)
        # Again, with a plan cached from the good stage in between.
        with pytest.raises(cls):
            stage_sync(engine, sd)
        _still_usable(engine)
    finally:
        engine.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("build", "check"), [pytest.param(b, c, id=i) for i, b, c in OKS])
def test_odd_input_stages_correctly(build: Callable[[], Any], check: Any) -> None:
    engine = make_engine()
    try:
        sd = build()
        for _ in range(2):  # slow path, then fast path
            out = stage_sync(engine, sd).result
            if check is None:
                assert_same(out, sd)
            else:
                check(sd, out)
        _still_usable(engine)
    finally:
        engine.close()


@pytest.mark.anyio
@pytest.mark.timeout(90)
async def test_whole_catalog_through_the_async_stager(anyio_backend: Any, no_thread_leak: None) -> None:
    """Every case, one after another, on one Stager: errors are typed, good input is
    right, and the stager is never left unusable."""
    async with Stager() as stager:
        for _, build, cls, path in ERRORS:
            with pytest.raises(StagingError) as ei:
                await stager.stage(build())
            _check_error(ei.value, cls, path)
        for _, build, check in OKS:
            sd = build()
            out = await stager.stage(sd)
            if check is None:
                assert_same(out, sd)
            else:
                check(sd, out)
        sd = {"w": torch.arange(100.0)}
        assert_same(await stager.stage(sd), sd)


@pytest.mark.cuda
@pytest.mark.timeout(60)
def test_two_cuda_devices_in_one_state_dict_are_refused() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    engine = make_engine()
    try:
        sd = optim(torch.ones(3, device="cuda:1"))
        sd["model"]["w"] = torch.ones(3, device="cuda:0")
        with pytest.raises(UnsupportedTensorError) as ei:
            stage_sync(engine, sd)
        assert str(ei.value).startswith(P), str(ei.value)
        _still_usable(engine)
    finally:
        engine.close()


# -- a state dict mutated while it is being staged -----------------------------------
#
# The rule (docs/reliability.md): a stage reflects one structure, the one its last walk
# saw, with every tensor's values as read by the copies. A structural change that the
# stage notices (a container changing size under its walk, leaves that no longer fit
# the plan made from an earlier walk) is a StagingError; never a torn or mis-shaped copy.


class AddsKey:
    """Adds a key to the dict holding it the moment the walk copies it."""

    def __init__(self, target: dict[str, Any]) -> None:
        self.target = target

    def __reduce_ex__(self, protocol: Any) -> Any:
        self.target[f"k{len(self.target)}"] = torch.ones(1)
        return (AddsKey.__new__, (AddsKey,), None)


class Swaps:
    """Puts a different tensor under sd['w'] each time a walk copies it (the engine's
    slow path walks twice: collect, then build)."""

    def __init__(self, sd: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        self.sd = sd
        self.tensors = tensors
        self.calls = 0

    def __reduce_ex__(self, protocol: Any) -> Any:
        self.sd["w"] = self.tensors[self.calls % len(self.tensors)]
        self.calls += 1
        return (object, ())


@pytest.mark.timeout(60)
def test_container_growing_during_the_walk_is_refused() -> None:
    engine = make_engine()
    try:
        inner: dict[str, Any] = {"a": torch.ones(2)}
        inner["hook"] = AddsKey(inner)
        inner["z"] = torch.ones(3)
        with pytest.raises(StagingError) as ei:
            stage_sync(engine, {"model": inner})
        assert str(ei.value).startswith("sd['model']:"), str(ei.value)
        assert "changed" in str(ei.value)
        _still_usable(engine)
    finally:
        engine.close()


@pytest.mark.timeout(60)
def test_tensor_swapped_between_walks_never_stages_torn() -> None:
    engine = make_engine()
    try:
        # A (4,) tensor at plan time, a (1,) one when copying: without the check the
        # copy would broadcast 7.0 into all four host elements, silently.
        sd: dict[str, Any] = {}
        sd["hook"] = Swaps(sd, [torch.full((4,), 2.0), torch.full((1,), 7.0)])
        sd["w"] = torch.zeros(4)
        with pytest.raises(StagingError, match="changed while it was being staged"):
            stage_sync(engine, sd)
        _still_usable(engine)
        # Same layout, other storage (what a __getstate__ that builds a fresh tensor on
        # every call does): staged, with the values of the walk that built the result,
        # never torn; once the swapping stops, it stages as usual.
        sd2: dict[str, Any] = {}
        a, b = torch.full((4,), 2.0), torch.full((4,), 5.0)
        sd2["hook"] = Swaps(sd2, [a, b])
        sd2["w"] = torch.zeros(4)
        out = stage_sync(engine, sd2).result
        assert torch.equal(out["w"], b)
        del out
        sd2["hook"] = 0
        out = stage_sync(engine, sd2).result
        assert torch.equal(out["w"], sd2["w"])
    finally:
        engine.close()


@pytest.mark.anyio
@pytest.mark.timeout(300)  # a hang guard, not a speed check (see CONTRIBUTING.md, "Tests")
async def test_concurrent_mutation_is_consistent_or_refused(anyio_backend: Any) -> None:
    """Another thread adds and removes entries while stages run. Every tensor is
    immutable and filled with its own key number, so a torn stage would show up as a
    value under the wrong key; each stage is either correct for the keys it has or a
    StagingError."""
    sd: dict[str, Any] = {f"k{i}": torch.full((8,), float(i)) for i in range(3000)}
    stop = threading.Event()

    def mutate() -> None:
        i = 3000
        while not stop.is_set():
            sd[f"k{i}"] = torch.full((8,), float(i))
            sd.pop(f"k{i - 2500}", None)
            i += 1

    results = {"ok": 0, "refused": 0}
    async with Stager() as stager:
        t = threading.Thread(target=mutate)
        t.start()
        try:
            for _ in range(30):
                try:
                    out = await stager.stage(sd)
                except StagingError as e:
                    assert "changed" in str(e)
                    results["refused"] += 1
                    continue
                for k, v in out.items():
                    assert torch.equal(v, torch.full((8,), float(k[1:]))), k
                results["ok"] += 1
        finally:
            stop.set()
            t.join()
        out = await stager.stage(sd)
        assert_same(out, sd)
    assert results["ok"] + results["refused"] == 30


# -- very many tensors ---------------------------------------------------------------


def _many(n: int) -> dict[str, Any]:
    return {"layers": [{"w": torch.full((4,), float(i)), "b": torch.tensor(float(i))} for i in range(n // 2)]}


@pytest.mark.timeout(90)
def test_20k_tensors() -> None:
    engine = make_engine()
    try:
        sd = _many(20_000)
        assert_same(stage_sync(engine, sd).result, sd)
        st = stage_sync(engine, sd)
        assert st.fast_path and st.tensors == 20_000
        assert_same(st.result, sd)
    finally:
        engine.close()


@stress
@pytest.mark.stress
@pytest.mark.timeout(600)
def test_100k_tensors_stress() -> None:
    engine = make_engine(share_memory=True)
    try:
        sd = _many(100_000)
        for _ in range(3):
            st = stage_sync(engine, sd)
            assert st.tensors == 100_000
            assert_same(st.result, sd)
    finally:
        engine.close()
