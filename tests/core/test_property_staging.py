"""Property test: state dicts that change between stages are staged as they are at each call.

A random "world" of base tensors and a state dict built from it goes through a random
sequence of steps: stages (dropped, kept, or re-staging tensors of a kept result), value
changes, layout changes (views: slices with offsets, transposes, conj/neg bits, zero-size,
expanded, fresh memory), aliasing (leaves on one base, the same tensor twice), metadata
(requires_grad, Parameter or Tensor, attributes), keys (str, int, tuple, tensor keys) and
objects whose ``__getstate__`` makes new tensors at every call.
Every result is compared with what its sources were at its call: bit-exact values, dtype,
shape, stride, offset, conj/neg bits, requires_grad, class, attributes, which leaves
share a storage or are one tensor; a result that is kept must stay as it was.

Results are dropped before the next stage unless kept; at most one is kept (a held
result holds its buffer set, and the default is two sets).
"""

from __future__ import annotations

import functools
import gc
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import torch
from helpers import bits, make_engine, stage_sync
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

from async_stager.testing import FakeBackend

pytestmark = pytest.mark.timeout(120)

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.bool, torch.complex64]
#: "fresh" (new memory at every build) and Fresh entries force the slow path: rarer.
VIEWS = [
    "same",
    "same",
    "same",
    "slice",
    "t",
    "conj",
    "neg",
    "empty",
    "empty-offset",
    "expand",
    "flat",
    "fresh",
]
GRAD_DTYPES = {torch.float32, torch.float16, torch.bfloat16, torch.complex64}


def make_base(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100, 100, shape, generator=g).to(dtype)


def make_view(base: torch.Tensor, kind: str) -> torch.Tensor:
    """A view of ``base`` (falls back to ``base`` where the kind does not apply)."""
    flat = base.reshape(-1) if base.is_contiguous() else None
    if kind == "slice" and flat is not None and flat.numel() > 1:
        return flat[1:]
    if kind == "t" and base.dim() == 2:
        return base.t()
    if kind == "conj" and base.is_complex():
        return base.conj()
    if kind == "neg" and base.is_complex():
        return base.conj().imag  # a real view with the neg bit
    if kind == "empty" and flat is not None:
        return flat[:0]
    if kind == "empty-offset" and flat is not None and flat.numel() > 1:
        return flat[1:1]
    if kind == "expand" and flat is not None and flat.numel():
        return flat[:1].expand(3)
    if kind == "flat" and flat is not None:
        return flat
    if kind == "fresh":
        return base.clone()  # new memory at every build
    return base


@dataclass
class Leaf:
    base: int
    view: str
    param: bool = False
    grad: bool = False
    attrs: dict[str, int] = field(default_factory=dict)


class Fresh:
    """Makes a new tensor at every reduce, as a module computing its state on demand."""

    def __init__(self, make: Callable[[], torch.Tensor]) -> None:
        self.make = make

    def __getstate__(self) -> dict[str, Any]:
        return {"t": self.make()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


@dataclass
class World:
    bases: list[torch.Tensor]
    #: (key, value): a key is a str, int, tuple or a tensor; a value is a Leaf,
    #: ("dup", i) (the same tensor object as entry i's value) or ("fresh", Leaf) (an
    #: object whose reduce makes a new copy of that leaf each time).
    entries: list[tuple[Any, Any]]
    nested: list[Any]
    step: int = 0

    def build(self) -> dict[str, Any]:
        """The state dict as a module would return it now: new tensor objects, on the
        bases' memory (or fresh memory for "fresh" views)."""
        built: list[Any] = []
        flat: dict[Any, Any] = {}
        for key, value in self.entries:
            k = key
            if isinstance(value, Leaf):
                v: Any = self.tensor(value)
            elif value[0] == "fresh":
                v = Fresh(functools.partial(self.fresh, value[1]))
            else:
                v = built[value[1]]
            built.append(v)
            flat[k] = v
        nested = [self.tensor(x) if isinstance(x, Leaf) else built[x] for x in self.nested]
        return {"flat": flat, "nested": {"state": {0: nested}}, "step": self.step}

    def fresh(self, leaf: Leaf) -> torch.Tensor:
        return self.tensor(replace(leaf, attrs={})).clone()

    def tensor(self, leaf: Leaf) -> torch.Tensor:
        base = self.bases[leaf.base]
        t = make_view(base, leaf.view).detach()
        grad = leaf.grad and t.dtype in GRAD_DTYPES
        if leaf.param:
            t = torch.nn.Parameter(t, requires_grad=grad)
        elif grad:
            t.requires_grad_(True)
        for name, value in leaf.attrs.items():
            setattr(t, name, value)
        return t


# -- capture and comparison -------------------------------------------------------------


@dataclass
class Rec:
    """What a tensor was at a stage's call."""

    cls: type
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    conj: bool
    neg: bool
    grad: bool
    attrs: dict[str, Any]
    bits: torch.Tensor
    storage: tuple[int, int]
    ident: int


def record(t: torch.Tensor) -> Rec:
    st_ = t.untyped_storage()
    return Rec(
        type(t),
        t.dtype,
        tuple(t.shape),
        t.stride(),
        int(t.storage_offset()),
        t.is_conj(),
        t.is_neg(),
        t.requires_grad,
        dict(t.__dict__),
        bits(t.detach().resolve_conj().resolve_neg()).clone(),
        (st_.data_ptr(), st_.nbytes()),
        id(t),
    )


def capture(obj: Any, recs: list[Rec], keep: list[Any]) -> Any:
    """A mirror of ``obj`` with every tensor (value or key) recorded, in walk order;
    tensors made for it (a Fresh's state) are kept alive in ``keep`` meanwhile, so no
    other tensor gets their memory or id. A Fresh seen before is reduced once, as in
    the walk (and in copy.deepcopy): the mirror refers to its first capture."""
    if isinstance(obj, torch.Tensor):
        r = record(obj)
        recs.append(r)
        return r
    if isinstance(obj, dict):
        items = []
        for k, v in obj.items():
            ck = capture(k, recs, keep) if isinstance(k, torch.Tensor) else k
            items.append((ck, capture(v, recs, keep)))
        return (type(obj), items)
    if isinstance(obj, list):
        return [capture(v, recs, keep) for v in obj]
    if isinstance(obj, Fresh):
        for seen, first in keep:
            if seen is obj:
                return first
        state = obj.__getstate__()
        mirror = (Fresh, capture(state, recs, keep))
        keep.append((obj, mirror))
        keep.append((None, state))
        return mirror
    return obj


def check(
    out: Any, snap: Any, tensors: list[torch.Tensor], path: str = "sd", seen: dict[int, Any] | None = None
) -> None:
    """``out`` matches the capture ``snap``; collects ``out``'s tensors in walk order."""
    seen = {} if seen is None else seen
    if isinstance(snap, Rec):
        assert isinstance(out, torch.Tensor), path
        tensors.append(out)
        assert type(out) is snap.cls, path
        assert out.dtype == snap.dtype, path
        assert tuple(out.shape) == snap.shape, path
        assert out.stride() == snap.stride, path
        assert out.storage_offset() == snap.offset, path
        assert (out.is_conj(), out.is_neg()) == (snap.conj, snap.neg), path
        assert out.requires_grad == snap.grad, path
        assert out.__dict__ == snap.attrs, path
        assert torch.equal(bits(out.detach().resolve_conj().resolve_neg()), snap.bits), f"{path}: values"
        return
    if isinstance(snap, tuple) and snap[0] is Fresh:
        assert type(out) is Fresh, path
        if id(snap) in seen:
            assert out is seen[id(snap)], f"{path}: one object, staged once"
            return
        seen[id(snap)] = out
        check(out.__dict__, snap[1], tensors, f"{path}.__getstate__()", seen)
        return
    if isinstance(snap, tuple):
        cls, items = snap
        assert type(out) is cls and len(out) == len(items), path
        for (k, v), (ck, cv) in zip(out.items(), items):
            if isinstance(ck, Rec):
                check(k, ck, tensors, f"{path}[<key>]", seen)
            else:
                assert k == ck, path
            sub = f"{path}[{k!r}]" if not isinstance(k, torch.Tensor) else f"{path}[<tensor>]"
            check(v, cv, tensors, sub, seen)
        return
    if isinstance(snap, list):
        assert isinstance(out, list) and len(out) == len(snap), path
        for i, (a, b) in enumerate(zip(out, snap)):
            check(a, b, tensors, f"{path}[{i}]", seen)
        return
    assert out == snap, path


def staged_tensors(obj: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out += staged_tensors(k) + staged_tensors(v)
    elif isinstance(obj, list):
        for v in obj:
            out += staged_tensors(v)
    return out


def mark(out: Any, value: int) -> None:
    """An attribute on every tensor of ``out`` (in a function: no tensor stays bound
    to a local of the caller, which would keep the result's buffer set held)."""
    for t in staged_tensors(out):
        t.mark = value  # type: ignore[attr-defined]


def check_result(out: Any, snap: Any, recs: list[Rec], sources: list[tuple[int, int]]) -> None:
    tensors: list[torch.Tensor] = []
    check(out, snap, tensors)
    assert len(tensors) == len(recs)
    storages = [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors]
    for i in range(len(recs)):
        for j in range(i + 1, len(recs)):
            assert (recs[i].ident == recs[j].ident) == (tensors[i] is tensors[j]), (i, j)
            if recs[i].storage[1] == 0 or recs[j].storage[1] == 0:
                continue
            assert (recs[i].storage == recs[j].storage) == (storages[i] == storages[j]), (i, j)
    # Never a source's memory.
    for ptr, n in storages:
        if n:
            assert not any(p < ptr + n and ptr < p + m for p, m in sources if m), "aliases a source"


# -- the program --------------------------------------------------------------------------

#: One change to the world per step, then a stage. "none" stages it unchanged (the fast
#: path); a value-only change too; the others may or may not keep the fingerprint.
CHANGES = [
    "none",
    "values",
    "view",
    "rebase",
    "new-base",
    "grad",
    "param",
    "attrs",
    "add-key",
    "drop-key",
    "dup",
    "dup",
    "fresh",
]
#: How each step's result is used: dropped at once, kept (the one result held across
#: stages), marked by the caller (attributes set on its tensors) then dropped, or
#: re-staging tensors of the kept result next to the current state dict.
STAGES = ["drop", "drop", "keep", "mark", "restage"]


@st.composite
def leaves(draw: st.DrawFn, nbases: int) -> Leaf:
    return Leaf(
        base=draw(st.integers(0, nbases - 1)),
        view=draw(st.sampled_from(VIEWS)),
        param=draw(st.booleans()),
        grad=draw(st.booleans()),
        attrs=draw(st.sampled_from([{}, {}, {"a": 1}, {"b": 2, "a": 3}])),
    )


def base_specs() -> st.SearchStrategy[tuple[torch.dtype, tuple[int, ...], int]]:
    return st.tuples(
        st.sampled_from(DTYPES),
        st.lists(st.integers(0, 4), min_size=1, max_size=2).map(tuple),
        st.integers(0, 2**16),
    )


def draw_key(data: st.DataObject, world: World, n: int) -> Any:
    kind = data.draw(st.sampled_from(["str", "str", "int", "tuple", "tensor"]))
    if kind == "str":
        return f"k{n}"
    if kind == "int":
        return n
    if kind == "tuple":
        return ("t", n)
    # One tensor object for as long as the entry lives, as a key should be.
    return world.tensor(data.draw(leaves(len(world.bases))))


@pytest.mark.parametrize("kind", ["cpu", "fake-device"])
@settings(
    # The default run: 30 programs a kind; the stress run (ASYNC_STAGER_STRESS=1) 300.
    max_examples=300 if os.environ.get("ASYNC_STAGER_STRESS", "") not in ("", "0") else 15,
    deadline=None,
    derandomize=True,
    # No shrinking: a stage costs milliseconds, and shrinking a failure took minutes;
    # the failing example's draws are printed as they are.
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_staged_copies_follow_their_sources(kind: str, data: st.DataObject) -> None:
    engine = make_engine(copy_threads=1, backend=FakeBackend()) if kind == "fake-device" else make_engine()
    try:
        run_program(engine, data)
    finally:
        gc.collect()
        engine.close()


def run_program(engine: Any, data: st.DataObject) -> None:
    specs = data.draw(st.lists(base_specs(), min_size=1, max_size=4), label="bases")
    world = World([make_base(*s) for s in specs], [], [])
    n = data.draw(st.integers(1, 5), label="entries")
    for i in range(n):
        value: Any = data.draw(leaves(len(world.bases)))
        if i and isinstance(world.entries[-1][1], Leaf) and data.draw(st.booleans()):
            # A twin of the entry before: the same memory and layout, another object
            # (what a "dup" step turns into the same object, and back).
            value = world.entries[-1][1]
        world.entries.append((draw_key(data, world, i), value))
    world.nested = [data.draw(leaves(len(world.bases))), 0]
    kept: tuple[Any, Any, list[Rec]] | None = None
    steps = data.draw(
        st.lists(st.tuples(st.sampled_from(CHANGES), st.sampled_from(STAGES)), min_size=1, max_size=10),
        label="steps",
    )
    for change, use in [("none", "drop"), *steps]:
        world.step += 1
        apply_change(world, change, data)
        sd = world.build()
        if use == "restage" and kept is not None:
            # Tensors of the kept result, staged again next to the current ones.
            prev: list[torch.Tensor] = []
            check(kept[0], kept[1], prev)
            picks = data.draw(st.lists(st.integers(0, max(0, len(prev) - 1)), max_size=3))
            sd["prev"] = [prev[i] for i in picks if prev]
            del prev
        recs: list[Rec] = []
        keep: list[Any] = []
        snap = capture(sd, recs, keep)
        sources = sorted({r.storage for r in recs})
        staged = stage_sync(engine, sd)
        out = staged.result
        del staged
        check_result(out, snap, recs, sources)
        if use == "keep":
            kept = None  # the earlier kept result goes first: at most one is held
            kept = (out, snap, recs)
        elif use == "mark":
            # The caller marks what it got, then drops it: no later result shows it.
            mark(out, world.step)
        del out, sd, keep
        if kept is not None:
            # A held result is never overwritten.
            check_result(kept[0], kept[1], kept[2], [])


def apply_change(world: World, change: str, data: st.DataObject) -> None:
    if change == "values":
        i = data.draw(st.integers(0, len(world.bases) - 1))
        with torch.no_grad():
            b = world.bases[i]
            if b.dtype == torch.bool:
                b.logical_not_()
            elif b.numel():
                b.add_(1)
        return
    if change == "new-base":
        i = data.draw(st.integers(0, len(world.bases) - 1))
        world.bases[i] = make_base(*data.draw(base_specs()))
        return
    if change == "add-key":
        world.entries.append((draw_key(data, world, world.step + 100), data.draw(leaves(len(world.bases)))))
        return
    if change == "drop-key":
        # Later "dup" entries refer to earlier ones by index: only the last goes.
        if len(world.entries) > 1:
            world.entries.pop()
        return
    if change == "dup":
        # Toggles an entry between the same tensor as the entry before and a twin of
        # it (another tensor object on the same memory, with the same layout).
        eligible = [i for i in range(1, len(world.entries)) if isinstance(world.entries[i - 1][1], Leaf)]
        if eligible:
            j = data.draw(st.sampled_from(eligible))
            key, value = world.entries[j]
            before = world.entries[j - 1][1]
            world.entries[j] = (key, before if value == ("dup", j - 1) else ("dup", j - 1))
        return
    if change == "none":
        return
    j = data.draw(st.integers(0, len(world.entries) - 1))
    key, value = world.entries[j]
    if not isinstance(value, Leaf):
        return
    if change == "fresh":
        world.entries[j] = (key, ("fresh", value))
        return
    if change == "view":
        value = replace(value, view=data.draw(st.sampled_from(VIEWS)))
    elif change == "rebase":
        value = replace(value, base=data.draw(st.integers(0, len(world.bases) - 1)))
    elif change == "grad":
        value = replace(value, grad=not value.grad)
    elif change == "param":
        value = replace(value, param=not value.param)
    elif change == "attrs":
        value = replace(value, attrs=data.draw(st.sampled_from([{}, {"a": 5}, {"c": 6}])))
    world.entries[j] = (key, value)
