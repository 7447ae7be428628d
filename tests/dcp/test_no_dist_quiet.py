"""DCP's ``no_dist`` warning is silenced per save, safely across threads.

Found by the full suite after writes moved into threads of their own (issue 24):
``warnings.catch_warnings`` in two threads at once restored each other's filter lists,
so with overlapping writes (``max_in_flight=3``) the warning escaped in one of them,
an error under ``-W error``. ``no_dist_quiet`` inserts one filter entry for as long as
any thread needs it and touches nothing else."""

from __future__ import annotations

import threading
import warnings
from pathlib import Path

import torch

from async_stager._dcp.blocking import no_dist_quiet, save_blocking


def test_overlapping_no_dist_saves_never_warn(tmp_path: Path) -> None:
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def saver(i: int) -> None:
        start.wait()
        try:
            for k in range(8):
                save_blocking(
                    {"t": torch.full((256,), float(i))}, no_dist=True, checkpoint_id=tmp_path / f"{i}-{k}"
                )
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        threads = [threading.Thread(target=saver, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []


def test_the_filter_goes_when_the_last_user_leaves_and_others_stay() -> None:
    with warnings.catch_warnings():
        before = list(warnings.filters)
        with no_dist_quiet():
            with no_dist_quiet():
                warnings.filterwarnings("ignore", message="a filter of the caller's own")
            assert any(f[1] is not None and "torch" in f[1].pattern for f in warnings.filters)
        after = list(warnings.filters)
        own = after[0][1]
        assert after[1:] == before and own is not None and "caller's own" in own.pattern  # only ours went
