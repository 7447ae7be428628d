"""Writer-process handoff keeps what a staged tensor is, and a kept tensor stays valid.

- A staged view keeps its source's lazy conjugate/negative bits (the bytes are the
  base's): the attached tensor must carry them too, or the writer reads z for z.conj().
- Python attributes on tensors, and the class of a Parameter subclass, survive attach.
- A tensor kept from an AttachedStateDict stays valid after close() (its mapping is
  unmapped when it dies, never under it); a closed AttachedStateDict says so.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import open_fds
from helpers import bits

from async_stager import AttachedStateDict, ClosedError, Stager, attach_shared, export_shared

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]


class TaggedParameter(torch.nn.Parameter):
    """A Parameter subclass that inherits Parameter's pickling (which rebuilds a plain
    Parameter)."""

    shard: int  # set by a test, as a model's bookkeeping may


def resolved(t: torch.Tensor) -> torch.Tensor:
    """The values a tensor reads as, with its lazy bits applied."""
    return t.detach().resolve_conj().resolve_neg()


def raw(t: torch.Tensor) -> torch.Tensor:
    """What a view's bytes read as without its lazy bits."""
    return torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


def describe(t: torch.Tensor) -> tuple[Any, ...]:
    """Everything a tensor is, as plain data: class, dtype, geometry, lazy bits,
    requires_grad, and the exact bytes of the values it reads as. (Plain data on
    purpose: pytest shows a failing helper's arguments after the ``with`` block closed
    the attachment; before the fix that read unmapped memory.)"""
    return (
        type(t).__name__,
        t.dtype,
        tuple(t.shape),
        t.stride(),
        t.storage_offset(),
        t.is_conj(),
        t.is_neg(),
        t.requires_grad,
        bytes(bits(resolved(t)).tolist()),
    )


def math_bit_views() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    z = torch.randn(3, 4, dtype=torch.complex64, generator=g)
    x = torch.randn(6, generator=g)
    w = torch.randn(5, dtype=torch.complex128, generator=g)
    return {
        "conj": z.conj(),
        "neg": torch._neg_view(x),
        "conj_imag": z.conj().imag,  # a neg view of the imaginary parts
        "conj_real": z.conj().real,  # no bit: the real parts are unchanged
        "t_conj": z.t().conj(),
        "conj_t": z.conj().t(),
        "conj_neg": torch._neg_view(w.conj()),
        "conj_slice": z.conj()[1:, ::2],
        "conj_grad": torch.randn(4, dtype=torch.complex64, generator=g).conj().requires_grad_(),
        "param_conj": torch.nn.Parameter(torch.randn(3, dtype=torch.complex64, generator=g).conj()),
        "neg_param": torch.nn.Parameter(torch._neg_view(torch.randn(3, generator=g)), requires_grad=False),
        "plain": torch.randn(4, generator=g),
    }


@pytest.mark.anyio
async def test_lazy_conj_and_neg_bits_survive_attach(anyio_backend: Any) -> None:
    sd = math_bit_views()
    # The bits are the point: without them these read other values than their bytes.
    for key in (
        "conj",
        "neg",
        "conj_imag",
        "t_conj",
        "conj_t",
        "conj_neg",
        "conj_grad",
        "param_conj",
        "neg_param",
    ):
        v = sd[key]
        assert v.is_conj() or v.is_neg(), key
        assert not torch.equal(bits(resolved(v)), bits(raw(v))), key
    async with Stager(share_memory=True) as stager, stager.snapshot(sd) as staged:
        handle = pickle.loads(pickle.dumps(export_shared(staged, stager)))
        with attach_shared(handle) as att:
            out = att.state_dict
            assert list(out) == list(sd)
            for key, src in sd.items():
                assert describe(staged[key]) == describe(src), key  # the stager keeps them...
                assert describe(out[key]) == describe(src), key  # ...and so does the handoff


@pytest.mark.anyio
async def test_conj_view_and_its_base_stay_aliases(anyio_backend: Any) -> None:
    z = torch.randn(8, dtype=torch.complex64)
    sd = {"z": z, "zc": z.conj(), "zn": torch._neg_view(z.real)}
    async with Stager(share_memory=True) as stager, stager.snapshot(sd) as staged:
        with attach_shared(export_shared(staged, stager)) as att:
            out = att.state_dict
            for key, src in sd.items():
                assert describe(out[key]) == describe(src), key
            ptr = out["z"].untyped_storage().data_ptr()
            assert out["zc"].untyped_storage().data_ptr() == ptr
            assert out["zn"].untyped_storage().data_ptr() == ptr


@pytest.mark.anyio
async def test_python_attributes_and_parameter_subclasses_survive_attach(anyio_backend: Any) -> None:
    other = torch.randn(3)
    # Tensors with Python attributes, as models' bookkeeping sets them: typed Any.
    t: Any = torch.randn(4)
    t.tag = "weights"
    t.scale = 0.5
    t.other = other
    p: Any = torch.nn.Parameter(torch.randn(2, 2))
    p.tensor_model_parallel = True
    p.partition_dim = 1
    q = TaggedParameter(torch.randn(3))
    q.shard = 2
    frozen = TaggedParameter(torch.randn(2), requires_grad=False)
    zc: Any = torch.randn(3, dtype=torch.complex64).conj()
    zc.note = "conj with attributes"
    sd: dict[str, Any] = {"t": t, "other": other, "p": p, "q": q, "frozen": frozen, "zc": zc}
    async with Stager(share_memory=True) as stager, stager.snapshot(sd) as staged:
        handle = export_shared(staged, stager)
        assert handle.tensors == 6
        with attach_shared(pickle.loads(pickle.dumps(handle))) as att:
            out = att.state_dict
            for key, src in sd.items():
                assert describe(out[key]) == describe(src), key
            assert out["t"].tag == "weights" and out["t"].scale == 0.5
            assert out["t"].other is out["other"]  # an attribute tensor is the same object
            assert out["p"].tensor_model_parallel is True and out["p"].partition_dim == 1
            assert type(out["q"]) is TaggedParameter and out["q"].shard == 2
            assert type(out["frozen"]) is TaggedParameter and not out["frozen"].requires_grad
            assert out["zc"].note == "conj with attributes"
            out["q"].data[0] = 123.0  # private mapping: the writer's write stays here
            assert float(staged["q"].detach()[0]) == float(q.detach()[0]) != 123.0


@pytest.mark.anyio
async def test_an_attribute_that_refers_back_to_its_tensor(anyio_backend: Any) -> None:
    t = torch.randn(3)
    sd: dict[str, Any] = {"t": t}
    async with Stager(share_memory=True) as stager, stager.snapshot(sd) as staged:
        staged["t"].me = staged["t"]  # a cycle, as a model's bookkeeping may make
        with attach_shared(export_shared(staged, stager)) as att:
            out = att.state_dict["t"]
            assert out.me is out
            assert describe(out) == describe(t)


_KEPT_AFTER_CLOSE = """
import asyncio, gc, sys
import torch
from async_stager import Stager, attach_shared, export_shared

async def main():
    big = torch.arange(1 << 22, dtype=torch.float32)
    z = torch.randn(1 << 16, dtype=torch.complex64)
    sd = {"big": big, "zc": z.conj(), "small": torch.ones(8)}
    async with Stager(share_memory=True) as stager, stager.snapshot(sd) as staged:
        att = attach_shared(export_shared(staged, stager))
        kept = att.state_dict["big"]
        kept_conj = att.state_dict["zc"]
        att.close()
        del att
        gc.collect()
        # Other mappings come and go meanwhile: a freed range would be reused.
        junk = [torch.empty(1 << 20) for _ in range(8)]
        del junk
        assert torch.equal(kept, big), "kept tensor changed"
        assert kept_conj.is_conj() and torch.equal(kept_conj.resolve_conj(), z.conj().resolve_conj())
        kept[0] = -1.0  # private mapping: writable, and the trainer's buffer is untouched
        assert float(staged["big"][0]) == 0.0
    print("kept-ok", flush=True)

asyncio.run(main())
"""


def test_a_tensor_kept_after_close_stays_valid() -> None:
    # In a child process: before the fix, close() unmapped the arena under the kept
    # tensor and the read crashed the interpreter (SIGSEGV).
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    )
    r = subprocess.run(
        [sys.executable, "-W", "error", "-c", textwrap.dedent(_KEPT_AFTER_CLOSE)],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=ROOT,
        env=env,
        check=False,
    )
    assert r.returncode == 0, (
        f"child exited with {r.returncode}\nstdout: {r.stdout}\nstderr: {r.stderr[-4000:]}"
    )
    assert "kept-ok" in r.stdout


def _mappings_of(ino: int) -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "memfd:async_stager" in line and int(line.split()[4]) == ino)


@pytest.mark.anyio
async def test_close_releases_the_mapping_and_descriptor_when_the_last_tensor_dies(
    anyio_backend: Any,
) -> None:
    sd = {"w": torch.randn(1 << 16), "v": torch.randn(100)}
    async with Stager(share_memory=True) as stager, stager.snapshot(sd) as staged:
        handle = export_shared(staged, stager)
        ino = handle.arenas[0].ino
        fds0, maps0 = open_fds(), _mappings_of(ino)  # the stager's own mapping

        # Nothing kept: close releases everything at once.
        att = attach_shared(handle)
        assert _mappings_of(ino) == maps0 + 1
        assert open_fds() - fds0 <= len(handle.arenas)
        att.close()
        assert _mappings_of(ino) == maps0
        assert open_fds() == fds0

        # A kept tensor keeps its mapping, until it dies. (Not read here: before the
        # fix that crashed; test_a_tensor_kept_after_close_stays_valid reads it.)
        att = attach_shared(handle)
        kept = att.state_dict["w"]
        att.close()
        assert _mappings_of(ino) == maps0 + 1
        del kept
        assert _mappings_of(ino) == maps0
        assert open_fds() == fds0


@pytest.mark.anyio
async def test_a_closed_attached_state_dict_says_so(anyio_backend: Any) -> None:
    async with Stager(share_memory=True) as stager, stager.snapshot({"w": torch.ones(4)}) as staged:
        handle = export_shared(staged, stager)
        with attach_shared(handle) as att:
            assert isinstance(att, AttachedStateDict) and not att.closed
            assert torch.equal(att.state_dict["w"], torch.ones(4))
        assert att.closed
        with pytest.raises(ClosedError, match="closed"):
            att.state_dict  # noqa: B018 - the access is the test
        with pytest.raises(ClosedError, match="closed"), att:
            pass
        att.close()  # idempotent
        assert att.closed
        assert att.handle is handle
        # The handle can be attached again while the lease is held.
        with attach_shared(handle) as again:
            assert torch.equal(again.state_dict["w"], torch.ones(4))
