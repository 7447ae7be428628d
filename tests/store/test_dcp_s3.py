"""DCP to an object store (issue 44): ``async_stager.dcp.save(..., checkpoint_id="s3://...")``,
DCP's ``async_save`` with our ``DefaultStager`` and ``StoreWriter``, and the load back
through ``StoreReader``, against the real S3-protocol server."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import async_stager.dcp as adcp
from async_stager import Stager
from async_stager.dcp import CheckpointStagerConfig, DefaultStager, StoreReader, StoreWriter
from async_stager.errors import UnsupportedError
from tests.store.conftest import admin_client

pytestmark = [pytest.mark.timeout(120)]


def _sd(v: float) -> dict[str, Any]:
    return {"w": torch.full((256, 256), v), "b": torch.arange(7, dtype=torch.bfloat16) + v, "meta": {"v": v}}


def _load(url: str, v: float = 0.0) -> dict[str, Any]:
    sd = _sd(v)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(sd, storage_reader=StoreReader(url), no_dist=True)
    return sd


@pytest.mark.anyio
async def test_async_stager_dcp_save_to_s3_and_load_back(bucket: str, moto_port: int) -> None:
    url = f"s3://{bucket}/ckpt/1"
    async with Stager() as stager:
        await adcp.save(_sd(3.0), stager=stager, checkpoint_id=url, no_dist=True)
        with pytest.raises(UnsupportedError, match="budgeted save"):
            await adcp.save(
                _sd(3.0), stager=stager, checkpoint_id=url, no_dist=True, host_budget_bytes=1 << 20
            )
    got = _load(url)
    assert torch.equal(got["w"], torch.full((256, 256), 3.0)) and got["meta"] == {"v": 3.0}
    keys = sorted(o["Key"] for o in admin_client(moto_port).list_objects_v2(Bucket=bucket)["Contents"])
    assert "ckpt/1/.metadata" in keys and not any(k.endswith(".tmp") for k in keys)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_dcp_async_save_with_our_default_stager_to_s3(bucket: str) -> None:
    with DefaultStager(CheckpointStagerConfig()) as stager:
        for i in range(2):
            url = f"s3://{bucket}/async/{i}"
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
                response = dcp.async_save(
                    _sd(float(i)), storage_writer=StoreWriter(url), async_stager=stager, no_dist=True
                )
            upload: Any = getattr(response, "upload_completion", response)
            upload.result(timeout=60)
            got = _load(url)
            assert torch.equal(got["w"], torch.full((256, 256), float(i)))
