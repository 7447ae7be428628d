"""Checksums taken on the device that holds the data: WSUM64 (``_wordhash``), a hash
made of torch operations, computed before the device-to-host copy and recomputed
identically on the CPU on restore. The fake device (``FakeBackend``) runs the same
code path on CPU tensors; the CUDA tests at the end run it on a GPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from async_stager import Checkpointer, Checksums, IntegrityError, Stager
from async_stager.__main__ import main as cli_main
from async_stager._checkpoint.integrity import checksum_state
from async_stager._core.checksum import digest as _digest, wordhash as _wordhash
from async_stager.testing import FakeBackend

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

MiB = 1 << 20


def splitmix(seed: int, n: int) -> list[int]:
    """SplitMix64's first ``n`` outputs from ``seed``, made odd, as unsigned ints: the
    constants WSUM64 defines, computed independently of the library."""
    mask = (1 << 64) - 1
    out = []
    state = seed
    for _ in range(n):
        state = (state + _wordhash.LEN_MUL) & mask
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        z ^= z >> 31
        out.append(z | 1)
    return out


ROWS = _wordhash.PIECE_BYTES // 4 // _wordhash.COLS
CONSTANTS = splitmix(0x5EED_57A6_E5, _wordhash.COLS + ROWS)


def reference(data: bytes) -> list[int]:
    """WSUM64 as its docstring defines it, in numpy's unsigned (wrapping) arithmetic."""
    np = pytest.importorskip("numpy")
    a = np.array(CONSTANTS[: _wordhash.COLS], dtype=np.uint64)
    b = np.array(CONSTANTS[_wordhash.COLS :], dtype=np.uint64)
    size = _wordhash.PIECE_BYTES
    out = []
    for piece in [data[i : i + size] for i in range(0, len(data), size)] or [b""]:
        padded = piece + b"\0" * (-len(piece) % 4)
        w = np.frombuffer(padded, dtype="<i4").astype(np.int64).view(np.uint64)
        j = np.arange(len(w))
        with np.errstate(over="ignore"):
            h = np.uint64(len(piece)) * np.uint64(_wordhash.LEN_MUL) + (
                w * (a[j % _wordhash.COLS] * b[j // _wordhash.COLS])
            ).sum(dtype=np.uint64)
        out.append(int(h))
    return out


def raw(t: torch.Tensor) -> bytes:
    """A CPU tensor's bytes in row-major order."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_piece_size_is_the_digests() -> None:
    assert _wordhash.PIECE_BYTES == _digest.PIECE_BYTES
    assert _wordhash.PIECE_BYTES % (4 * _wordhash.COLS) == 0


@pytest.mark.parametrize(
    "n", [0, 1, 3, 4, 5, 4 * 4096 + 2, 8 * MiB - 1, 8 * MiB, 8 * MiB + 3, 3 * 8 * MiB + 12345]
)
def test_wsum64_matches_its_definition(n: int) -> None:
    t = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    assert _wordhash.wsum64_digest(t) == reference(t.numpy().tobytes())
    assert len(_wordhash.wsum64_digest(t)) == _wordhash.piece_count(n)


def test_wsum64_of_any_dtype_and_layout_is_of_its_row_major_bytes() -> None:
    g = torch.Generator().manual_seed(1)
    for t in (
        torch.randn(3, 5, generator=g).half(),
        torch.tensor(2.5),
        torch.randn(100, 64, generator=g).t(),
        torch.randint(0, 2, (7,), generator=g).bool(),
        torch.randn(9, generator=g, dtype=torch.complex64),
    ):
        assert _wordhash.wsum64_digest(t) == reference(raw(t))


def test_wsum64_detects_word_changes_swaps_and_zeroed_ranges() -> None:
    t = torch.randn(3 * MiB // 4, generator=torch.Generator().manual_seed(2))
    base = _wordhash.wsum64_digest(t)
    u8 = t.view(torch.uint8)
    for i in (
        list(range(0, 64)) + list(range(u8.numel() - 64, u8.numel())) + list(range(7, u8.numel(), 65537))
    ):
        for bit in (0x01, 0x80):
            u = t.clone()
            u.view(torch.uint8)[i] ^= bit
            assert _wordhash.wsum64_digest(u) != base, (i, bit)
    u = t.clone()
    u[10], u[4096 + 10] = t[4096 + 10].item(), t[10].item()  # same column, other row
    assert _wordhash.wsum64_digest(u) != base
    u = t.clone()
    u[1000:5000] = 0  # a torn range
    assert _wordhash.wsum64_digest(u) != base
    u = t.clone()
    u.view(torch.uint8)[3] ^= 0x80
    u.view(torch.uint8)[4 * 77 + 3] ^= 0x80  # two sign flips
    assert _wordhash.wsum64_digest(u) != base
    zeros = torch.zeros(100, dtype=torch.uint8)
    assert _wordhash.wsum64_digest(zeros) != _wordhash.wsum64_digest(zeros[:99])  # the length counts


def device_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {
        "big": torch.randn(5 * MiB, generator=g),  # 20 MiB: three pieces
        "mid": torch.randn(MiB // 2, generator=g).bfloat16(),  # 1 MiB: hashed on the device
        "small": [torch.randn(33, generator=g) for _ in range(10)],  # host-hashed later
        "strided": torch.randn(1024, 1024, generator=g)[:, 1],  # not hashable on the device
    }


async def test_fake_device_hashes_big_sources_as_of_the_call() -> None:
    backend = FakeBackend(polls=3)  # the copies land after a few polls
    sd = device_state()
    stream = backend.stream(torch.device("cpu"))
    stream.enqueue(lambda: sd["big"].add_(1))  # a producer still queued at the call
    expected_big = sd["big"] + 1
    async with Stager(backend=backend) as stager:
        coro = stager.lease(sd, checksums=True)
        stream.enqueue(lambda: sd["big"].mul_(-1))  # queued after the call: not staged
        lease = await coro
        staged = lease.state_dict
        sums = lease.checksums
        assert isinstance(sums, Checksums)
        assert backend.device_hashes == 2
        assert torch.equal(staged["big"], expected_big)
        for name in ("big", "mid"):
            assert sums.algorithm_of(staged[name]) == "wsum64"
            digest = sums.get(staged[name])
            assert digest == Checksums.compute(staged[name], "wsum64") == reference(raw(staged[name]))
        assert len(sums.get(staged["big"]) or []) == 3
        for t in staged["small"] + [staged["strided"]]:
            assert sums.get(t) is None and sums.algorithm_of(t) is None
        table, hashed_now = checksum_state(staged, known=sums)
        assert table["big@0"]["hash"] == "wsum64" and table["mid@0"]["hash"] == "wsum64"
        assert "hash" not in table["small.0@0"] and "hash" not in table["strided@0"]
        assert hashed_now == 10 * 33 * 4 + 1024 * 4
        lease.release()


async def test_without_checksums_nothing_is_hashed_on_the_device() -> None:
    backend = FakeBackend()
    async with Stager(backend=backend) as stager:
        lease = await stager.lease(device_state())
        assert lease.checksums is None and backend.device_hashes == 0
        lease.release()


async def test_the_checkpointer_hashes_the_staged_host_copy_on_a_device(tmp_path: Path, capsys: Any) -> None:
    """Issues 24/25: the Checkpointer never hashes on the device (the device hash reads
    the source at another moment than the copy); the write's thread hashes the staged
    host copy, so the manifest covers exactly the bytes staged, and a flipped byte is
    still found on restore, named down to its tensor."""
    w = torch.arange(float(MiB // 2))  # 2 MiB: a device would hash it
    b = torch.arange(16.0)
    backend = FakeBackend(delay=0.01)
    async with Checkpointer(tmp_path, keep=3, stager=Stager(backend=backend)) as ckpt:
        for step in (1, 2):
            w += 10_000_000
            b += 1
            await ckpt.save({"layer": {"w": w, "b": b}}, step=step)
        await ckpt.wait()
    assert backend.device_hashes == 0
    manifest = json.loads((tmp_path / "step-00000002" / "checksums.json").read_text())
    assert manifest["format"] == "async_stager-checksums/4"
    assert "hash" not in manifest["tensors"]["layer.w@0"]  # the default (host) hash
    assert cli_main(["verify", str(tmp_path)]) == 0
    path = tmp_path / "step-00000002" / "__0_0.distcp"
    data = bytearray(path.read_bytes())
    i = data.find(torch.tensor([20_000_123.0]).numpy().tobytes())
    assert i >= 0
    data[i] ^= 0x01
    path.write_bytes(bytes(data))
    async with Checkpointer(tmp_path) as ckpt:
        out = {"layer": {"w": torch.empty(MiB // 2), "b": torch.empty(16)}}
        with pytest.raises(IntegrityError) as info:
            await ckpt.restore(out, fallback=False)
        assert info.value.step == 2 and info.value.tensor == "layer.w"
        assert await ckpt.restore(out) == 1
        assert torch.equal(out["layer"]["w"], torch.arange(float(MiB // 2)) + 10_000_000)
    capsys.readouterr()
    assert cli_main(["verify", str(tmp_path)]) == 1


async def test_a_cpu_state_names_no_per_entry_hash(tmp_path: Path) -> None:
    async with Checkpointer(tmp_path, stager=Stager()) as ckpt:
        await ckpt.save({"w": torch.randn(2 * MiB)}, step=1)
        await ckpt.wait()
    manifest = json.loads((tmp_path / "step-00000001" / "checksums.json").read_text())
    assert manifest["format"] == "async_stager-checksums/4"
    assert all("hash" not in e for e in manifest["tensors"].values())


async def test_an_unknown_hash_in_a_manifest_is_not_trusted(tmp_path: Path) -> None:
    async with Checkpointer(tmp_path, stager=Stager(backend=FakeBackend())) as ckpt:
        await ckpt.save({"w": torch.randn(2 * MiB)}, step=1)
        await ckpt.wait()
    path = tmp_path / "step-00000001" / "checksums.json"
    doc = json.loads(path.read_text())
    doc["tensors"]["w@0"]["hash"] = "md5"
    path.write_text(json.dumps(doc))
    async with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(IntegrityError, match="unknown hash 'md5'"):
            await ckpt.restore({"w": torch.empty(2 * MiB)}, fallback=False)


# -- on a GPU -------------------------------------------------------------------------


@pytest.mark.cuda
async def test_cuda_sources_are_hashed_on_the_gpu_before_the_copy() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    sd: dict[str, Any] = {
        "big": torch.randn(5 * MiB, device="cuda", generator=g),
        "bf16": torch.randn(3 * MiB, device="cuda", generator=g).bfloat16(),
        "small": [torch.randn(40, device="cuda", generator=g) for _ in range(50)],
    }
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    async with Stager() as stager:
        for round_ in range(3):
            with torch.cuda.stream(side):
                torch.cuda._sleep(50_000_000)  # the producer is still busy at the call
                sd["big"].add_(1)
            torch.cuda.current_stream().wait_stream(side)
            expected = sd["big"].clone()
            lease = await stager.lease(sd, checksums=True)
            sd["big"].mul_(-1)  # after the call, on the current stream: not staged
            staged = lease.state_dict
            sums = lease.checksums
            assert sums is not None
            assert torch.equal(staged["big"], expected.cpu()), round_
            for name in ("big", "bf16"):
                assert sums.algorithm_of(staged[name]) == "wsum64"
                assert sums.get(staged[name]) == Checksums.compute(staged[name], "wsum64"), (round_, name)
            assert sums.get(staged["big"]) == _wordhash.wsum64_digest(expected)  # GPU == CPU
            assert all(sums.get(t) is None for t in staged["small"])
            lease.release()
            sd["big"].mul_(-1)


def test_tables_made_on_a_device_equal_the_constants() -> None:
    a, b, w = _wordhash.make_tables(torch.device("cpu"))
    signed = [c - (1 << 64) if c >> 63 else c for c in CONSTANTS]
    assert a.tolist() == signed[: _wordhash.COLS] and b.view(-1).tolist() == signed[_wordhash.COLS :]
    assert w.tolist() == [1, 256, 65536]
    assert all(v & 1 for v in a.tolist() + b.view(-1).tolist())


async def test_views_not_on_a_word_boundary_are_hashed_from_the_host_copy() -> None:
    # A bf16 view one element into a flat buffer: its bytes start 2 bytes into the
    # storage, so they cannot be read as int32 words in place.
    flat = torch.randn(MiB + 1, generator=torch.Generator().manual_seed(5)).bfloat16()
    view = flat[1:]
    assert _wordhash.wsum64_digest(view) == reference(raw(view))
    assert _wordhash.device_pairs([view.clone()], [view]) == []
    backend = FakeBackend()
    async with Stager(backend=backend) as stager:
        lease = await stager.lease({"v": view, "w": torch.randn(MiB)}, checksums=True)
        sums = lease.checksums
        assert sums is not None
        staged = lease.state_dict
        assert torch.equal(staged["v"], view)
        assert sums.algorithm_of(staged["w"]) == "wsum64"
        assert sums.get(staged["v"]) is None  # left to the host copy
        table, _ = checksum_state(staged, known=sums)
        assert table["v@0"]["digest"] == _digest.tensor_digest(view)
        lease.release()


@pytest.mark.cuda
def test_a_restore_read_into_host_memory_is_hashed_on_the_gpu_identically() -> None:
    torch.cuda.init()
    t = torch.randint(0, 256, (3 * 8 * MiB + 5,), dtype=torch.uint8)
    assert t.numel() >= _wordhash.OFFLOAD_BYTES
    assert _wordhash.wsum64_digest(t) == reference(raw(t))  # hashed on the GPU
    assert _wordhash.wsum64_digest(t.cuda()) == reference(raw(t))


# -- threads hashing a staged copy ------------------------------------------------------


@pytest.mark.parametrize(
    ("affinity", "machine", "env", "want"),
    [
        (16, 16, {}, 15),  # one rank, the whole machine: all cores but one
        (16, 16, {"LOCAL_WORLD_SIZE": "8"}, 1),  # 8 ranks share it: 2 cores each, less one
        (64, 64, {"LOCAL_WORLD_SIZE": "8"}, 7),
        (8, 64, {"LOCAL_WORLD_SIZE": "8"}, 7),  # bound to its own 8 cores: its share already
        (64, 64, {"OMP_NUM_THREADS": "4"}, 4),  # the process's thread budget caps it
        (4, 64, {}, 3),  # the affinity, not the machine's count
        (1, 1, {}, 1),
    ],
)
def test_hash_threads_are_this_processs_share(
    monkeypatch: pytest.MonkeyPatch, affinity: int, machine: int, env: dict[str, str], want: int
) -> None:
    # Review finding 6: the Checkpointer hashed with os.cpu_count() - 1 threads in every
    # process, ignoring affinity, OMP_NUM_THREADS and the ranks per node.
    import os

    from async_stager._core.checksum.digest import hash_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(affinity)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: machine)
    for name in ("LOCAL_WORLD_SIZE", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert hash_threads() == want


def test_checkpointer_default_checksum_threads_follow_hash_threads(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    from async_stager import Checkpointer
    from async_stager._core.checksum.digest import hash_threads

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    ckpt = Checkpointer(tmp_path)
    assert ckpt.options.checksum_threads == hash_threads() == 1


def test_a_source_at_an_odd_address_is_not_hashed_on_the_device() -> None:
    # Review finding 10: a DLPack view whose storage starts at an odd address passed the
    # offset check and its int32 loads fault the kernel on a GPU.
    from async_stager._core.checksum.wordhash import device_pairs, wsum64_digest

    buf = bytearray(_wordhash.MIN_DEVICE_BYTES + 8)
    odd = torch.frombuffer(buf, dtype=torch.uint8, offset=1, count=_wordhash.MIN_DEVICE_BYTES)
    assert odd.storage_offset() == 0 and odd.data_ptr() % 4 == 1
    aligned = torch.zeros(_wordhash.MIN_DEVICE_BYTES, dtype=torch.uint8)
    dst = torch.empty_like(aligned)
    assert device_pairs([dst, dst], [odd, aligned]) == [(dst, aligned)]
    odd.copy_(torch.arange(odd.numel()).to(torch.uint8))
    assert wsum64_digest(odd) == wsum64_digest(odd.clone())
