"""The engine on the CPU: structures, dtypes, views, errors, cache truth, memory."""

from __future__ import annotations

import collections
import dataclasses
import gc
import pickle
import warnings
from typing import Any, NamedTuple

import pytest
import torch
from helpers import assert_no_alias, assert_same, make_engine, stage_sync

from async_stager import StagingError, UncopyableObjectError, UnsupportedTensorError
from async_stager.testing import FakeBackend

pytestmark = pytest.mark.timeout(60)


class Point(NamedTuple):
    x: torch.Tensor
    label: str


@dataclasses.dataclass
class Holder:
    w: torch.Tensor
    meta: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class FrozenHolder:
    w: torch.Tensor
    n: int


@dataclasses.dataclass(frozen=True, slots=True)
class SlotsHolder:
    w: torch.Tensor


class Plain:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        self.note = "x"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Plain) and torch.equal(self.t, other.t) and self.note == other.note


class Unpicklable:
    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError("nope")


def _engines() -> list[Any]:
    return [
        pytest.param(lambda: make_engine(), id="cpu"),
        pytest.param(lambda: make_engine(share_memory=True), id="shared"),
        pytest.param(lambda: make_engine(backend=FakeBackend()), id="fake-device"),
    ]


@pytest.fixture(params=_engines())
def engine(request: pytest.FixtureRequest) -> Any:
    e = request.param()
    yield e
    e.close()


def test_nested_structures(engine: Any) -> None:
    dd: collections.defaultdict[str, list[int]] = collections.defaultdict(list)
    dd["a"].append(1)
    sd: dict[str, Any] = {
        "model": collections.OrderedDict(w=torch.randn(3, 4), b=torch.randn(4)),
        "optim": {"state": {0: {"exp_avg": torch.randn(3, 4), "step": torch.tensor(5.0)}}, "lr": 0.1},
        "list": [torch.arange(6), 3, "s", None, b"b", 2.5, True, 1 + 2j],
        "tuple": (torch.ones(2), (torch.zeros(1),)),
        "nt": Point(torch.randn(2), "p"),
        "dc": Holder(torch.randn(2), {"k": torch.randn(1)}),
        "frozen": FrozenHolder(torch.randn(2), 3),
        "slots": SlotsHolder(torch.randn(3)),
        "dd": dd,
        "set": {1, 2},
        "dtype": torch.float16,
        "device": torch.device("cpu"),
        "size": torch.Size([2, 3]),
    }
    staged = stage_sync(engine, sd).result
    assert_same(staged["model"], sd["model"])
    assert isinstance(staged["model"], collections.OrderedDict)
    assert_same(staged["optim"], sd["optim"])
    assert_same(staged["list"], sd["list"])
    assert_same(staged["tuple"], sd["tuple"])
    assert type(staged["nt"]) is Point and staged["nt"].label == "p"
    assert torch.equal(staged["nt"].x, sd["nt"].x)
    assert isinstance(staged["dc"], Holder) and torch.equal(staged["dc"].meta["k"], sd["dc"].meta["k"])
    assert isinstance(staged["frozen"], FrozenHolder) and staged["frozen"].n == 3
    assert torch.equal(staged["frozen"].w, sd["frozen"].w)
    assert torch.equal(staged["slots"].w, sd["slots"].w)
    assert isinstance(staged["dd"], collections.defaultdict) and staged["dd"].default_factory is list
    assert staged["dd"] == {"a": [1]} and staged["dd"] is not sd["dd"]
    assert staged["set"] == {1, 2}
    assert staged["dtype"] is torch.float16 and staged["size"] == torch.Size([2, 3])
    assert_no_alias(staged, sd)
    # Containers are copies, not the caller's objects.
    assert staged["optim"] is not sd["optim"] and staged["list"] is not sd["list"]


def test_objects_through_copy_protocol(engine: Any) -> None:
    sd = {"obj": Plain(torch.randn(3))}
    staged = stage_sync(engine, sd).result
    assert staged["obj"] is not sd["obj"] and staged["obj"] == sd["obj"]
    assert staged["obj"].t.data_ptr() != sd["obj"].t.data_ptr()


def test_shared_and_self_references(engine: Any) -> None:
    shared = {"t": torch.randn(4)}
    lst: list[Any] = [torch.randn(2)]
    lst.append(lst)
    sd = {"a": shared, "b": shared, "cycle": lst}
    staged = stage_sync(engine, sd).result
    assert staged["a"] is staged["b"]
    assert staged["cycle"][1] is staged["cycle"]
    assert torch.equal(staged["cycle"][0], lst[0])


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.complex64,
        torch.complex128,
        torch.bool,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
        torch.int64,
    ],
)
def test_every_dtype_bit_exact(dtype: torch.dtype) -> None:
    raw = torch.randint(0, 256, (64,), dtype=torch.uint8)
    if dtype == torch.bool:
        t = raw % 2 == 1
    else:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        t = raw[: 64 // itemsize * itemsize].view(dtype)
    e = make_engine(backend=FakeBackend())
    try:
        staged = stage_sync(e, {"t": t, "scalar": t[0].clone()}).result
        assert_same(staged["t"], t)
        assert_same(staged["scalar"], t[0].clone())
    finally:
        e.close()


def test_layouts_views_and_aliases(engine: Any) -> None:
    base = torch.arange(24, dtype=torch.float32)
    mat = base.view(4, 6)
    sd = {
        "zero_dim": torch.tensor(3.5),
        "empty": torch.empty(0, 3),
        "transposed": torch.randn(3, 5).t(),
        "expanded": torch.randn(1, 4).expand(3, 4),
        "base": base,
        "view": mat,
        "slice": mat[1:3, 2:5],
        "offset": base[5:9],
        "same_again": base,
    }
    staged = stage_sync(engine, sd).result
    for k in sd:
        assert_same(staged[k], sd[k], k)
    # Views and aliases of one storage share one host storage, with the same offsets.
    st = staged["base"].untyped_storage().data_ptr()
    for k in ("view", "slice", "offset"):
        assert staged[k].untyped_storage().data_ptr() == st
    assert staged["same_again"] is staged["base"]
    assert staged["base"].untyped_storage().nbytes() == base.untyped_storage().nbytes()


def test_empty_view_at_an_offset_of_an_empty_storage(engine: Any) -> None:
    # Found by the property test: an empty view may sit past the end of an empty
    # storage (offset 1 of 0 bytes); its offset is kept.
    base = torch.empty(2, 0, dtype=torch.bool)
    sd = {"v": base[1:], "base": base}
    for _ in range(2):
        staged = stage_sync(engine, sd).result
        assert_same(staged["v"], base[1:])
        assert_same(staged["base"], base)


def test_parameter_requires_grad_and_attributes(engine: Any) -> None:
    p = torch.nn.Parameter(torch.randn(3, 3))
    frozen = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    t = torch.randn(4)
    t.my_attr = {"scale": 2.0, "buddy": torch.ones(1)}  # type: ignore[attr-defined]
    g = torch.randn(2, requires_grad=True)
    sd = {"p": p, "frozen": frozen, "t": t, "g": g}
    staged = stage_sync(engine, sd).result
    assert type(staged["p"]) is torch.nn.Parameter and staged["p"].requires_grad
    assert type(staged["frozen"]) is torch.nn.Parameter and not staged["frozen"].requires_grad
    assert torch.equal(staged["p"].detach(), p.detach())
    assert staged["t"].my_attr["scale"] == 2.0
    assert torch.equal(staged["t"].my_attr["buddy"], torch.ones(1))
    assert staged["g"].requires_grad and staged["g"].is_leaf


def test_tensor_subclass_kept() -> None:
    class Tagged(torch.Tensor):
        pass

    t = torch.randn(4).as_subclass(Tagged)
    e = make_engine()
    try:
        staged = stage_sync(e, {"t": t}).result
        assert type(staged["t"]) is Tagged
        assert torch.equal(staged["t"].as_subclass(torch.Tensor), t.as_subclass(torch.Tensor))
    finally:
        e.close()


def test_cpu_sources_are_copied_not_aliased(engine: Any) -> None:
    w = torch.randn(8)
    before = w.clone()
    staged = stage_sync(engine, {"w": w}).result
    w.add_(1.0)  # training continues
    assert torch.equal(staged["w"], before)


def test_non_tensor_leaves_are_snapshotted(engine: Any) -> None:
    sd: dict[str, Any] = {"hist": [1, 2], "cfg": {"lr": 0.1}}
    staged = stage_sync(engine, sd).result
    sd["hist"].append(3)
    sd["cfg"]["lr"] = 0.2
    assert staged["hist"] == [1, 2] and staged["cfg"]["lr"] == 0.1


def test_unsupported_tensors_name_their_path(engine: Any) -> None:
    cases = {
        "meta": torch.empty(3, device="meta"),
        "sparse": torch.eye(3).to_sparse(),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated in torch
        cases["quantized"] = torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.qint8)
    for name, bad in cases.items():
        sd = {"optim": {"state": {3: {"exp_avg": bad}}}}
        with pytest.raises(UnsupportedTensorError) as ei:
            stage_sync(engine, sd)
        assert str(ei.value).startswith("sd['optim']['state'][3]['exp_avg']: "), name
        assert ei.value.path == ("optim", "state", 3, "exp_avg")
        # The engine stays usable.
        ok = stage_sync(engine, {"w": torch.ones(2)}).result
        assert torch.equal(ok["w"], torch.ones(2))


def test_freed_storage_is_an_error(engine: Any) -> None:
    t = torch.randn(16)
    t.untyped_storage().resize_(0)
    with pytest.raises(UnsupportedTensorError, match="freed"):
        stage_sync(engine, {"layer": [t]})


def test_uncopyable_object_keeps_cause(engine: Any) -> None:
    with pytest.raises(UncopyableObjectError) as ei:
        stage_sync(engine, {"a": [1, {"b": Unpicklable()}]})
    assert ei.value.path == ("a", 1, "b")
    assert isinstance(ei.value.__cause__, TypeError)
    assert "sd['a'][1]['b']" in str(ei.value)
    assert isinstance(ei.value, StagingError)


def test_cache_hits_and_fast_path(engine: Any) -> None:
    sd = {f"w{i}": torch.randn(4) for i in range(10)}
    s1 = stage_sync(engine, sd)
    assert (s1.hits, s1.misses, s1.fast_path) == (0, 10, False)
    del s1  # a reachable result is never overwritten: drop it to reuse its buffers
    for v in sd.values():
        v.mul_(2)
    s2 = stage_sync(engine, sd)
    assert s2.fast_path and s2.hits == 10 and s2.misses == 0
    assert_same(s2.result, sd)
    del s2
    # A fresh dict of the same tensors (like module.state_dict()) still hits.
    s3 = stage_sync(engine, {k: v.detach() for k, v in sd.items()})
    assert s3.fast_path
    assert_same(s3.result, sd)


def test_cache_never_stale_after_data_swap(engine: Any) -> None:
    # NeMo-RL #3312: parameters moved off and back kept their identity.
    p = torch.nn.Parameter(torch.randn(64))
    sd = {"p": p}
    stage_sync(engine, sd)
    with torch.no_grad():
        p.data = torch.full((64,), 7.0)
    staged = stage_sync(engine, sd).result
    assert torch.equal(staged["p"].detach(), torch.full((64,), 7.0))
    # Same pointer, other shape: still right.
    with torch.no_grad():
        p.data = p.data.view(8, 8)
    staged = stage_sync(engine, sd).result
    assert staged["p"].shape == (8, 8)
    assert torch.equal(staged["p"].detach(), torch.full((8, 8), 7.0))
    # Other dtype over the same bytes.
    with torch.no_grad():
        p.data = p.data.view(torch.bfloat16)
    staged = stage_sync(engine, sd).result
    assert staged["p"].dtype == torch.bfloat16
    assert torch.equal(staged["p"].detach(), p.detach())


def test_square_transpose_in_place_is_right(engine: Any) -> None:
    w = torch.arange(16.0).view(4, 4)
    sd = {"w": w, "v": w[1]}
    stage_sync(engine, sd)
    w.t_()
    sd = {"w": w, "v": w[1]}
    staged = stage_sync(engine, sd).result
    assert_same(staged["w"], w)
    assert_same(staged["v"], w[1])


def test_dead_sources_release_host_memory() -> None:
    e = make_engine()
    try:
        for _ in range(30):
            sd = {f"w{i}": torch.randn(1024) for i in range(64)}  # fresh tensors each time
            stage_sync(e, sd)
            del sd
        # Host memory stays about one state dict, not 30 (pytorch #170163).
        assert e.host_bytes <= 2 * 64 * 4096 + (1 << 20)
        cache = e.sets.all()[0].cache
        assert len(cache) <= 64
    finally:
        e.close()


def test_shared_memory_30k_tensors_few_fds() -> None:
    from conftest import open_fds

    before = open_fds()
    e = make_engine(share_memory=True)
    try:
        sd = {f"t{i}": torch.full((4,), float(i)) for i in range(30_000)}
        staged = stage_sync(e, sd).result
        # One memfd per arena (and the duplicate Python's mmap keeps of it).
        assert open_fds() - before <= 4
        assert torch.equal(staged["t29999"], torch.full((4,), 29999.0))
        assert e.sets.all()[0].pool.arenas[0].fd >= 0
    finally:
        e.close()
    del staged  # the last view of the arena: it is unmapped, its descriptors closed
    gc.collect()
    assert open_fds() <= before


def test_staged_storages_are_exact_size() -> None:
    # DCP's FileSystemWriter clones tensors whose storage is larger than the tensor.
    e = make_engine(share_memory=True)
    try:
        sd = {"a": torch.randn(3), "b": torch.randn(5, 7)}
        staged = stage_sync(e, sd).result
        for k, v in staged.items():
            assert v.untyped_storage().nbytes() == v.numel() * v.element_size(), k
    finally:
        e.close()


def test_staged_result_pickles_and_saves(tmp_path: Any) -> None:
    e = make_engine(share_memory=True)
    try:
        sd = {"w": torch.randn(4, 4), "n": 3}
        staged = stage_sync(e, sd).result
        torch.save(staged, tmp_path / "x.pt")
        back = torch.load(tmp_path / "x.pt")
        assert_same(back, sd)
        assert_same(pickle.loads(pickle.dumps(staged)), sd)
    finally:
        e.close()


def test_views_of_a_tensor_not_in_the_dict() -> None:
    big = torch.arange(100.0)
    sd = {"part": big[10:20]}
    e = make_engine()
    try:
        s = stage_sync(e, sd)
        assert_same(s.result["part"], big[10:20])
        # The whole source storage is staged (like DCP), exactly once.
        assert s.nbytes == big.untyped_storage().nbytes()
    finally:
        e.close()


def test_engine_unusable_after_close() -> None:
    from async_stager import ClosedError

    e = make_engine()
    e.close()
    e.close()  # idempotent
    with pytest.raises(ClosedError):
        e.capture()


def test_structure_change_takes_slow_path(engine: Any) -> None:
    sd: dict[str, Any] = {"a": torch.randn(3), "b": torch.randn(3)}
    stage_sync(engine, sd)
    sd["a"] = torch.randn(5)
    s = stage_sync(engine, sd)
    assert not s.fast_path
    assert_same(s.result, sd)
    gc.collect()


def _odd_bits() -> dict[str, torch.Tensor]:
    """Small bf16/fp16/fp8 tensors whose bits a value copy changes: NaN payloads,
    negative NaNs, negative zero."""
    sd: dict[str, torch.Tensor] = {}
    for dtype, patterns in (
        (torch.bfloat16, [0x7FC1, 0xFFA5, 0x8000, 0x7F81, 0x3F80]),
        (torch.float16, [0x7E01, 0xFC01, 0x8000, 0x7C01, 0x3C00]),
    ):
        bits = torch.tensor(patterns * 4, dtype=torch.int32).to(torch.int16)  # wraps to the bit pattern
        sd[str(dtype)] = bits.view(dtype)
    sd["fp8"] = torch.tensor([0x7F, 0xFF, 0x80, 0x01] * 4, dtype=torch.uint8).view(torch.float8_e4m3fn)
    return sd


def test_fake_copier_models_the_float_round_trip() -> None:
    # The hazard the fake device reproduces: a value copy canonicalizes NaN payloads.
    from async_stager._core.copy.fakes import _foreach_copy_through_float

    src = _odd_bits()["torch.bfloat16"]
    dst = torch.empty_like(src)
    _foreach_copy_through_float([dst], [src])
    assert not torch.equal(dst.view(torch.int16), src.view(torch.int16))


@pytest.mark.parametrize("backend", [None, "fake"], ids=["cpu", "fake-device"])
def test_small_reduced_float_gathers_are_bit_copies(backend: str | None) -> None:
    # Small tensors go through the gather into scratch: bytes, not values.
    e = make_engine(backend=FakeBackend()) if backend else make_engine()
    try:
        sd = {f"{k}.{i}": v.clone() for i in range(40) for k, v in _odd_bits().items()}
        staged = stage_sync(e, sd)
        for k, v in sd.items():
            got = staged.result[k]
            assert got.dtype == v.dtype
            assert torch.equal(got.view(torch.uint8), v.view(torch.uint8)), k
    finally:
        e.close()
