"""The staged copy follows the source as it is at each call, also when a plan is reused.

Regression tests for plans and the fast path carrying state from an earlier stage:
zero-size tensors, metadata the fingerprint did not see (requires_grad, class, strides,
offset, conj/neg bits, attributes), memory of an earlier result staged again, tensors
as keys, objects that make new tensors on every reduce, and error paths that name
how to reach the object.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import gc
from typing import Any

import pytest
import torch
from helpers import bits

from async_stager import Stager, StagingError, UncopyableObjectError, UnsupportedTensorError
from async_stager.errors import format_path
from async_stager.testing import FakeBackend

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

BACKENDS = ["cpu", "fake-device"]


def make_stager(kind: str, **kw: Any) -> Stager:
    if kind == "fake-device":
        return Stager(backend=FakeBackend(), copy_threads=1, **kw)
    return Stager(copy_threads=1, **kw)


def assert_follows(out: torch.Tensor, src: torch.Tensor) -> None:
    """``out`` is a faithful staged copy of ``src`` as it is now."""
    assert type(out) is type(src)
    assert out.dtype == src.dtype
    assert out.shape == src.shape
    assert out.stride() == src.stride()
    assert out.storage_offset() == src.storage_offset()
    assert out.requires_grad == src.requires_grad
    assert out.is_conj() == src.is_conj() and out.is_neg() == src.is_neg()
    assert out.__dict__.keys() == src.__dict__.keys()
    assert torch.equal(bits(out.resolve_conj().resolve_neg()), bits(src.resolve_conj().resolve_neg()))
    if src.numel():
        assert out.data_ptr() != src.data_ptr()


class Bad:
    """An object that cannot be copied (its reduce raises)."""

    def __call__(self) -> None:
        pass

    def __hash__(self) -> int:
        return 7

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise ValueError("cannot reduce")


# -- the fingerprint sees everything the result carries ----------------------------------


@pytest.mark.parametrize("kind", BACKENDS)
async def test_zero_size_tensors_follow_their_shape(anyio_backend: Any, kind: str) -> None:
    keep = torch.ones(2)
    async with make_stager(kind) as stager:
        for shape in [(0, 5), (0, 7), (3, 0), (0, 5)]:
            src = torch.empty(shape)
            out = await stager.stage({"a": src, "keep": keep})
            assert_follows(out["a"], src)
            del out


class Sub(torch.Tensor):
    pass


def _changes() -> dict[str, Any]:
    """Per case: a function that returns the source of the first stage and a function
    that returns the source of the second. Each second source has the first one's
    data pointer, dtype, dim, numel and device: only what the result carries differs."""

    def requires_grad() -> Any:
        p = torch.nn.Parameter(torch.arange(4.0))
        return lambda: p, lambda: p.requires_grad_(False)

    def detached() -> Any:
        p = torch.nn.Parameter(torch.arange(4.0))
        return lambda: p, lambda: p.detach()

    def subclass() -> Any:
        t = torch.arange(4.0)
        return lambda: t, lambda: t.as_subclass(Sub)

    def transposed() -> Any:
        w = torch.arange(9.0).reshape(3, 3)
        return lambda: w, lambda: w.t()

    def conj() -> Any:
        z = torch.randn(3, dtype=torch.complex64)
        return lambda: z, lambda: z.conj()

    def neg() -> Any:
        z = torch.randn(3, dtype=torch.complex64)
        return lambda: z.imag, lambda: z.conj().imag

    def offset() -> Any:
        big = torch.arange(10.0)
        return lambda: torch.from_dlpack(big[2:6]), lambda: big[2:6]

    def attribute_removed() -> Any:
        t = torch.ones(2)
        t.note = "first"  # type: ignore[attr-defined]

        def second() -> torch.Tensor:
            del t.note  # type: ignore[attr-defined]
            return t

        return lambda: t, second

    return {
        f.__name__: f
        for f in (requires_grad, detached, subclass, transposed, conj, neg, offset, attribute_removed)
    }


CHANGES = _changes()


@pytest.mark.parametrize("change", sorted(CHANGES))
@pytest.mark.parametrize("kind", BACKENDS)
async def test_metadata_changes_reach_the_result(anyio_backend: Any, kind: str, change: str) -> None:
    first, second = CHANGES[change]()
    keep = torch.ones(2)
    async with make_stager(kind) as stager:
        src = first()
        out = await stager.stage({"x": src, "keep": keep})
        assert_follows(out["x"], src)
        del out, src
        src = second()
        out = await stager.stage({"x": src, "keep": keep})
        assert_follows(out["x"], src)
        del out
        # Unchanged since: the fast path, still faithful.
        out = await stager.stage({"x": src, "keep": keep})
        assert stager.stats is not None and stager.stats.fast_path
        assert_follows(out["x"], src)


@pytest.mark.parametrize("kind", BACKENDS)
async def test_repeated_tensors_are_repeated_exactly_where_the_source_repeats_them(
    anyio_backend: Any, kind: str
) -> None:
    t = torch.arange(4.0)
    e = torch.empty(0)
    async with make_stager(kind) as stager:
        for a, b, c in [(t, t, e), (t, t.detach(), e), (t, t, e), (t, t, e.detach())]:
            out = await stager.stage({"a": a, "b": b, "c": c, "d": e})
            assert (out["a"] is out["b"]) == (a is b)
            assert (out["c"] is out["d"]) == (c is e)
            assert out["a"].untyped_storage().data_ptr() == out["b"].untyped_storage().data_ptr()
            del out


@pytest.mark.parametrize("kind", BACKENDS)
async def test_attributes_set_on_a_dropped_result_do_not_come_back(anyio_backend: Any, kind: str) -> None:
    async with make_stager(kind) as stager:
        sd: dict[str, Any] = {"w": torch.ones(3), "v": [torch.zeros(2)]}
        out = await stager.stage(sd)
        out["w"].mark = 1
        out["v"][0].mark = 2
        del out
        out = await stager.stage(sd)
        assert stager.stats is not None and stager.stats.fast_path
        assert not out["w"].__dict__ and not out["v"][0].__dict__


@pytest.mark.parametrize("kind", BACKENDS)
async def test_attributes_referencing_staged_tensors_are_dropped_with_the_result(
    anyio_backend: Any, kind: str
) -> None:
    # The staged attribute references another staged tensor: once the result is
    # dropped, nothing of it may stay reachable through the stager's own objects, or
    # its buffer set would count as held for ever (one set: the next stage would wait).
    a, b = torch.ones(2), torch.zeros(3)
    a.buddy = b  # type: ignore[attr-defined]
    a.me = a  # type: ignore[attr-defined]
    sd: dict[str, Any] = {"a": a, "b": b, "again": a}
    async with make_stager(kind, max_buffer_sets=1, buffer_wait_timeout=10) as stager:
        for _ in range(3):
            out = await stager.stage(sd)
            assert out["a"].buddy is out["b"] and out["a"].me is out["a"] and out["again"] is out["a"]
            assert_follows(out["a"], a)
            del out
        del a.buddy, a.me  # type: ignore[attr-defined]
        out = await stager.stage(sd)
        assert not out["a"].__dict__ and out["again"] is out["a"]


# -- memory of an earlier result, staged again --------------------------------------------


def raw_view(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory that shares nothing with it the stager can see (as
    a C extension or another library viewing the same pointer would)."""
    buf = (ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())
    return torch.frombuffer(buf, dtype=t.dtype)


@pytest.mark.parametrize("kind", BACKENDS)
async def test_restaged_memory_is_never_a_destination(anyio_backend: Any, kind: str) -> None:
    async with make_stager(kind, max_buffer_sets=1) as stager:
        n = 1 << 15  # 128 KiB: copied directly, in order (not gathered first)
        keep = torch.full((n,), 9.0)
        # The sources of a and b die after the stage: their blocks are swept at the
        # next slow path, while a view of a's block is one of that stage's sources.
        out = await stager.stage({"a": torch.full((n,), 1.0), "b": torch.full((n,), 2.0), "k": keep})
        view = raw_view(out["a"])
        del out
        gc.collect()
        out = await stager.stage({"y": torch.full((n,), 3.0), "x": view, "k": keep})
        assert torch.equal(out["x"], torch.full((n,), 1.0))
        assert torch.equal(out["y"], torch.full((n,), 3.0))
        del out
        # A live source's cached block, also read through a view of an earlier result:
        # the live source must get another block.
        s = torch.full((n,), 5.0)
        out = await stager.stage({"s": s, "k": keep})
        view = raw_view(out["s"])
        del out
        s.fill_(6.0)
        out = await stager.stage({"s": s, "x": view, "k": keep})
        assert torch.equal(out["x"], torch.full((n,), 5.0))
        assert torch.equal(out["s"], torch.full((n,), 6.0))


# -- keys ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", BACKENDS)
async def test_tensor_keys_are_staged(anyio_backend: Any, kind: str) -> None:
    k1, k2, k3, k4 = torch.ones(2), torch.full((3,), 2.0), torch.full((1,), 3.0), torch.full((2,), 4.0)
    member = torch.full((2,), 5.0)
    factory_t = torch.full((2,), 6.0)
    dd: collections.defaultdict[Any, Any] = collections.defaultdict(functools.partial(torch.clone, factory_t))
    dd[k4] = torch.zeros(1)
    sd: dict[str, Any] = {
        "plain": {k1: torch.zeros(1)},  # a tensor value
        "atomic": {k2: 7},  # an atomic value
        "ordered": collections.OrderedDict([((k3, "x"), "v")]),  # a tuple key holding a tensor
        "default": dd,
        "set": {member},
    }
    async with make_stager(kind) as stager:
        for _ in range(2):  # the slow path, then the fast one
            out = await stager.stage(sd)
            (o1,) = out["plain"]
            (o2,) = out["atomic"]
            ((o3, _),) = out["ordered"]
            (o4,) = out["default"]
            (om,) = out["set"]
            for o, src in [(o1, k1), (o2, k2), (o3, k3), (o4, k4), (om, member)]:
                assert o is not src
                assert_follows(o, src)
            assert out["atomic"][o2] == 7
            factory = out["default"].default_factory
            assert isinstance(factory, functools.partial) and factory.args[0] is not factory_t
            assert_follows(factory.args[0], factory_t)
            del out, o1, o2, o3, o4, om, factory


# -- objects that make new tensors on every reduce -----------------------------------------


class FreshState:
    """Like a module that computes its state on demand: a new tensor every call."""

    def __init__(self, shapes: list[tuple[int, ...]] | None = None) -> None:
        self.calls = 0
        self.shapes = shapes

    def __getstate__(self) -> dict[str, Any]:
        self.calls += 1
        shape = (3,) if self.shapes is None else self.shapes[(self.calls - 1) % len(self.shapes)]
        base = torch.full((6,), float(self.calls))
        return {"t": torch.full(shape, 2.0), "a": base[:3], "b": base[3:]}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


@pytest.mark.parametrize("kind", BACKENDS)
async def test_fresh_tensors_from_getstate_are_staged(anyio_backend: Any, kind: str) -> None:
    async with make_stager(kind) as stager:
        obj = FreshState()
        for _ in range(3):
            out: Any = await stager.stage({"o": obj, "w": torch.ones(2)})
            n = float(obj.calls)  # the values of the last walk are the ones copied
            assert torch.equal(out["o"].t, torch.full((3,), 2.0))
            assert torch.equal(out["o"].a, torch.full((3,), n)) and torch.equal(
                out["o"].b, torch.full((3,), n)
            )
            # a and b still share one staged storage, as their sources did.
            assert out["o"].a.untyped_storage().data_ptr() == out["o"].b.untyped_storage().data_ptr()
            del out
        # A first walk that fits the plan is staged as walked (new tensors of the
        # plan's layout take its memory over: one walk, nothing to disagree with).
        out = await stager.stage({"o": FreshState([(3,), (1,)]), "w": torch.ones(2)})
        assert torch.equal(out["o"].t, torch.full((3,), 2.0)) and torch.equal(
            out["o"].a, torch.full((3,), 1.0)
        )
        del out
        # A layout that changes between the two walks of the slow path is refused
        # (the first walk does not fit the plan; the second and third disagree).
        with pytest.raises(StagingError, match="changed while it was being staged"):
            await stager.stage({"o": FreshState([(1,), (3,)]), "w": torch.ones(2)})
        with pytest.raises(StagingError, match="changed while it was being staged"):
            await stager.stage({"o": FreshState([(1, 3), (3,)]), "w": torch.ones(2)})
        out = await stager.stage({"w": torch.ones(2)})
        assert torch.equal(out["w"], torch.ones(2))


class SharesOnce:
    """Tensors sharing a storage at the first call, separate ones at the second."""

    def __init__(self) -> None:
        self.calls = 0

    def __getstate__(self) -> dict[str, Any]:
        self.calls += 1
        if self.calls % 2:
            base = torch.ones(6)
            return {"a": base[:3], "b": base[3:]}
        return {"a": torch.ones(6)[:3], "b": torch.ones(6)[3:]}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


async def test_aliasing_that_changes_between_walks_is_refused(anyio_backend: Any) -> None:
    async with Stager(copy_threads=1) as stager:
        with pytest.raises(StagingError, match="changed while it was being staged"):
            await stager.stage({"o": SharesOnce()})


# -- error paths ---------------------------------------------------------------------------


class ReducesTo:
    def __init__(self, *args: Any) -> None:
        self.args = args

    def __reduce__(self) -> Any:
        return (ReducesTo, self.args)


class Slotted:
    __slots__ = ("x",)

    def __init__(self, x: Any) -> None:
        self.x = x


class CustomState:
    def __init__(self, bad: Any) -> None:
        self.bad = bad

    def __getstate__(self) -> dict[str, Any]:
        return {"renamed": self.bad}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.bad = state["renamed"]


def _error_cases() -> list[tuple[str, Any, Any, str]]:
    """(name, state dict, offending object, expected rendered path)."""
    bad = Bad()
    meta = torch.empty(2, device="meta")
    dd: collections.defaultdict[Any, Any] = collections.defaultdict(functools.partial(print, bad))
    return [
        ("partial-args", {"p": functools.partial(print, 1, bad)}, bad, "sd['p'].args[1]"),
        ("partial-keywords", {"p": functools.partial(print, k=bad)}, bad, "sd['p'].keywords['k']"),
        ("partial-func", {"p": functools.partial(bad)}, bad, "sd['p'].func"),
        ("partial-tensor", {"p": functools.partial(print, x=meta)}, meta, "sd['p'].keywords['x']"),
        ("reduce-args", {"o": ReducesTo(1, bad)}, bad, "sd['o'].__reduce_ex__(4)[1][1]"),
        ("slots", {"o": Slotted(bad)}, bad, "sd['o'].x"),
        ("custom-state", {"o": CustomState(bad)}, bad, "sd['o'].__reduce_ex__(4)[2]['renamed']"),
        ("default-factory", {"d": dd}, bad, "sd['d'].default_factory.args[0]"),
    ]


@pytest.mark.parametrize("case", _error_cases(), ids=lambda c: c[0])
async def test_error_paths_reach_the_object(anyio_backend: Any, case: Any) -> None:
    _name, sd, offending, expected = case
    async with Stager(copy_threads=1) as stager:
        with pytest.raises((UncopyableObjectError, UnsupportedTensorError)) as ei:
            await stager.stage(sd)
    assert ei.value.path is not None
    rendered = format_path(ei.value.path)
    assert rendered == expected
    assert str(ei.value).startswith(expected + ": ")
    # The path is Python that evaluates to the object the error is about.
    assert eval(rendered, {"sd": sd}) is offending


@pytest.mark.parametrize(
    "container",
    [lambda x: {"s": {x}}, lambda x: {"s": frozenset([x])}, lambda x: {"s": {x: 1}}],
    ids=["set", "frozenset", "dict-key"],
)
async def test_error_paths_name_unreachable_members_explicitly(anyio_backend: Any, container: Any) -> None:
    sd = container(Bad())
    async with Stager(copy_threads=1) as stager:
        with pytest.raises(UncopyableObjectError) as ei:
            await stager.stage(sd)
        out = await stager.stage({"ok": torch.ones(1)})
        assert torch.equal(out["ok"], torch.ones(1))
    assert ei.value.path is not None and ei.value.path[0] == "s"
    step = ei.value.path[1]
    # Not an index or key: a set has none, and the key's value is not what failed.
    assert not isinstance(step, (int, str)) and step != 0
    rendered = format_path(ei.value.path)
    assert rendered == "list(sd['s'])[0]", rendered
