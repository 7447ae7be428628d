"""Checksums computed while staging: ``stager.lease(sd, checksums=True)`` hashes every
destination the copy threads fill (XXH3-64 per 8 MiB piece, ``_digest``), and the
Checkpointer stores those digests, verifying them on restore (old CRC-32 manifests
still verify)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from async_stager import Checkpointer, IntegrityError, Stager, UnsupportedError
from async_stager._checkpoint.integrity import checksum_state, tensor_crcs
from async_stager._core.checksum import digest as _digest
from async_stager._core.checksum.digest import PIECE_BYTES, tensor_digest

pytestmark = pytest.mark.anyio


def state() -> dict[str, Any]:
    """Every copy route: a tensor cut into pieces (20 MiB: 8 + 8 + 4), a mid-size one
    (hashed part by part, not cut), small ones batched, bf16, an empty one, a scalar,
    a non-contiguous view (not hashed while staging), and two views of one storage."""
    g = torch.Generator().manual_seed(0)
    shared = torch.randn(1000, generator=g)
    return {
        "big": torch.randn(5 * 2**20, generator=g),
        "mid": torch.randn(3 * 2**20 // 4 * 4, generator=g),
        "small": [torch.randn(17, generator=g) for _ in range(40)],
        "bf16": torch.randn(1 << 20, generator=g).bfloat16(),
        "empty": torch.empty(0),
        "step": torch.tensor(7.0),
        "strided": torch.randn(64, 64, generator=g)[:, 3],
        "halves": [shared[:500], shared[500:]],
    }


def leaves(sd: Any, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    out = [] if out is None else out
    if isinstance(sd, dict):
        for v in sd.values():
            leaves(v, out)
    elif isinstance(sd, list):
        for v in sd:
            leaves(v, out)
    else:
        out.append(sd)
    return out


@pytest.mark.parametrize("copy_threads", [1, 2])
async def test_digests_match_the_staged_bytes(copy_threads: int) -> None:
    sd = state()
    async with Stager(copy_threads=copy_threads) as stager:
        for round_ in range(3):  # the slow path, then the plan's fast path
            lease = await stager.lease(sd, checksums=True)
            sums = lease.checksums
            assert sums is not None and sums.algorithm == "xxh3_64" and sums.piece_bytes == PIECE_BYTES
            hashed = 0
            for src, staged in zip(leaves(sd), leaves(lease.state_dict)):
                digest = sums.get(staged)
                if digest is None:
                    # Only what is not one whole destination in row-major order.
                    assert not staged.is_contiguous() or staged.untyped_storage().nbytes() != staged.nbytes
                    continue
                assert digest == tensor_digest(staged) == tensor_digest(src), round_
                hashed += 1
            assert hashed >= 45
            assert len(sums.get(lease.state_dict["big"]) or []) == 3  # 8 + 8 + 4 MiB
            lease.release()
            for t in leaves(sd):
                t.add_(1)  # new values each round: the digests follow them


async def test_fresh_tensors_each_checkpoint_are_hashed_too() -> None:
    async with Stager(copy_threads=2) as stager:
        for i in range(3):
            sd = {"w": torch.full((3 << 20,), float(i)), "b": torch.arange(10.0) + i}
            lease = await stager.lease(sd, checksums=True)
            assert lease.checksums is not None
            for k in sd:
                assert lease.checksums.get(lease.state_dict[k]) == tensor_digest(sd[k])
            lease.release()
            del sd, lease


async def test_digests_are_of_the_snapshot_not_of_later_changes() -> None:
    sd = {"w": torch.randn(4 << 20)}
    before = tensor_digest(sd["w"])
    async with Stager() as stager:
        lease = await stager.lease(sd, checksums=True)
        sd["w"].mul_(2)  # training goes on once the stage returned
        assert lease.checksums is not None
        assert lease.checksums.get(lease.state_dict["w"]) == before
        assert tensor_digest(lease.state_dict["w"]) == before
        lease.release()


async def test_without_checksums_the_lease_has_none() -> None:
    async with Stager() as stager:
        lease = await stager.lease({"w": torch.ones(4)})
        assert lease.checksums is None
        lease.release()


async def test_checkpointer_hashes_nothing_after_staging_for_a_cpu_state(tmp_path: Path) -> None:
    sd = state()
    async with Stager(copy_threads=2) as stager:
        lease = await stager.lease(sd, checksums=True)
        plain = {k: v for k, v in lease.state_dict.items() if k != "strided"}
        table, hashed_now = checksum_state(plain, known=lease.checksums)
        # Only the views of part of a storage are left to the write path.
        assert hashed_now == 2 * 500 * 4
        assert all(e["digest"] for e in table.values())
        lease.release()
    async with Checkpointer(tmp_path, stager=Stager()) as ckpt:
        await ckpt.save({"model": {"w": torch.randn(3 << 20), "b": torch.randn(5)}}, step=1)
        await ckpt.wait()
    manifest = json.loads((tmp_path / "step-00000001" / "checksums.json").read_text())
    assert manifest["format"] == "async_stager-checksums/4" and manifest["hash"] == "xxh3_64"
    assert manifest["piece_bytes"] == PIECE_BYTES
    assert len(manifest["tensors"]["model.w@0"]["digest"]) == 2


def test_digest_detects_any_single_byte_change() -> None:
    t = torch.randn(1000)
    base = tensor_digest(t)
    for i in range(0, 4000, 97):
        u = t.clone()
        u.view(torch.uint8)[i] ^= 0x01
        assert tensor_digest(u) != base
    assert tensor_digest(t[::2]) == tensor_digest(t[::2].contiguous())
    # Swapped words too (a sum would miss this).
    u = t.clone()
    u[0], u[1] = t[1].item(), t[0].item()
    assert tensor_digest(u) != base


async def test_a_first_format_crc_manifest_still_verifies(tmp_path: Path) -> None:
    w = torch.randn(1000)
    async with Checkpointer(tmp_path, stager=Stager()) as ckpt:
        await ckpt.save({"w": w}, step=1)
        await ckpt.wait()
    path = tmp_path / "step-00000001" / "checksums.json"
    doc = json.loads(path.read_text())
    entry = doc["tensors"]["w@0"]
    entry["crc32"] = tensor_crcs(w)
    del entry["digest"]
    doc.update(format="async_stager-checksums/1", hash="crc32", piece_bytes=16 * 2**20)
    path.write_text(json.dumps(doc))
    # As the version that wrote the first format would have: a COMMIT record without
    # the manifest's digest (the current one would refuse the rewritten manifest).
    (path.parent / "COMMIT").write_text(json.dumps({"format": "async_stager-commit/1", "seq": 0, "step": 1}))
    async with Checkpointer(tmp_path, stager=Stager()) as ckpt:
        out = {"w": torch.zeros(1000)}
        assert await ckpt.restore(out) == 1 and torch.equal(out["w"], w)
    entry["crc32"][0] ^= 1
    path.write_text(json.dumps(doc))
    async with Checkpointer(tmp_path, stager=Stager()) as ckpt:
        with pytest.raises(IntegrityError, match="crc32 mismatch") as info:
            await ckpt.restore({"w": torch.zeros(1000)}, fallback=False)
        assert info.value.step == 1 and info.value.tensor == "w"


async def test_missing_xxhash_is_a_clear_error_at_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_digest, "_module", None)
    monkeypatch.setitem(sys.modules, "xxhash", None)  # import xxhash raises ImportError
    async with Stager() as stager:
        with pytest.raises(UnsupportedError, match="pip install xxhash"):
            await stager.lease({"w": torch.ones(4)}, checksums=True)
        lease = await stager.lease({"w": torch.ones(4)})  # still usable
        lease.release()
