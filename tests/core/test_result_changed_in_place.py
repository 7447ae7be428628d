"""A staged result changed in place by its caller never shows in a later result.

A later stage reuses the buffers of a dropped result, and the host tensor objects its
plan made: a caller that changed one of those tensors in place (its shape, strides,
offset, memory, requires_grad, class, or attached a gradient or a hook) must not find
the change in what a later ``stage()``, ``lease()`` or ``snapshot()`` returns. Failed
before: ``unsqueeze_``, ``requires_grad_``, ``.grad =`` and ``register_hook`` on a
result came back in every later result of the same buffer set.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import assert_same

from async_stager import Stager

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


class _Mine(torch.Tensor):
    pass


def _sd() -> dict[str, Any]:
    base = torch.arange(24.0)
    return {
        "a": torch.arange(6.0).reshape(2, 3),
        "b": torch.ones(4),
        "t": torch.arange(6.0).reshape(3, 2).t(),  # a transposed view
        "v": base[4:16].view(3, 4),  # a view at an offset, sharing ``base``
        "base": base,
        "p": torch.nn.Parameter(torch.full((2, 2), 3.0)),
        "n": 7,
    }


#: In-place changes a caller may make to a staged tensor (each on one leaf).
CHANGES: dict[str, Callable[[dict[str, Any]], None]] = {
    "unsqueeze_": lambda r: r["a"].unsqueeze_(0),
    "t_": lambda r: r["a"].t_(),
    "squeeze_unsqueeze": lambda r: r["b"].unsqueeze_(1),
    "as_strided_": lambda r: r["v"].as_strided_((3,), (1,), 1),
    "resize_smaller": lambda r: r["b"].resize_(2),
    "transpose_view": lambda r: r["t"].transpose_(0, 1),
    "set_": lambda r: r["a"].set_(torch.zeros(6)),
    "data": lambda r: setattr(r["a"], "data", torch.zeros(1, dtype=torch.float64)),
    "requires_grad_": lambda r: r["b"].requires_grad_(),
    "parameter_no_grad": lambda r: r["p"].requires_grad_(False),
    "grad": lambda r: setattr(r["a"], "grad", torch.ones(2, 3)),
    "hook": lambda r: r["p"].register_hook(lambda g: g),
    "post_accumulate_hook": lambda r: r["p"].register_post_accumulate_grad_hook(lambda p: None),
    "class": lambda r: setattr(r["b"], "__class__", _Mine),
}


def _check(result: dict[str, Any], sd: dict[str, Any]) -> None:
    """Every staged tensor as its source: values, layout, class, requires_grad, nothing
    attached."""
    assert_same(result, sd)
    for k, src in sd.items():
        if not isinstance(src, torch.Tensor):
            continue
        got = result[k]
        assert type(got) is type(src), k
        assert (got.shape, got.stride(), got.storage_offset()) == (
            src.shape,
            src.stride(),
            src.storage_offset(),
        ), k
        assert got.dtype == src.dtype and got.requires_grad == src.requires_grad, k
        assert got.grad is None and not got._backward_hooks and not got._post_accumulate_grad_hooks, k
    assert result["v"].untyped_storage().data_ptr() == result["base"].untyped_storage().data_ptr()


async def test_a_result_changed_in_place_never_shows_in_a_later_stage(anyio_backend: Any) -> None:
    """Each change in turn, on one buffer set: the stage after it, and the fast path
    after that, return tensors as their sources, over the same memory."""
    sd = _sd()
    async with Stager(max_buffer_sets=1) as stager:
        first = await stager.stage(sd)
        host = stager.host_bytes
        for change in sorted(CHANGES):
            _check(first, sd)
            CHANGES[change](first)
            del first
            later = await stager.stage(sd)  # after the change: the plan made again
            _check(later, sd)
            del later
            first = await stager.stage(sd)  # the fast path again, for the next change
            stats = stager.stats
            assert stats is not None and stats.fast_path and stats.cache_misses == 0, change
            assert stager.host_bytes == host, change  # the same memory (cache hits)
        del first


async def test_a_leased_copy_changed_in_place_never_shows_in_a_later_snapshot(anyio_backend: Any) -> None:
    """The same through a lease: a snapshot's tensor changed inside its block (the
    release gives the set back at once) is not in the next snapshot, nor lease."""
    sd = _sd()
    async with Stager(max_buffer_sets=1) as stager:
        for change in ["unsqueeze_", "requires_grad_", "grad", "hook"]:
            async with stager.snapshot(sd) as staged:
                CHANGES[change](staged)
            async with stager.snapshot(sd) as staged:
                _check(staged, sd)
            lease = await stager.lease(sd)
            _check(lease.state_dict, sd)
            lease.release()
