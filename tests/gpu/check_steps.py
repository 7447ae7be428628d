"""The standalone steps of scripts/gpu_check.sh, on a device given by name.

``python tests/gpu/check_steps.py STEP`` runs one step on ``GPU_CHECK_DEVICE`` (``cuda``:
the GPU; ``sim``: the simulated device of ``async_stager.testing``, which runs the same
logic on the CPU for the script's dry run) at ``GPU_CHECK_SCALE``, and prints one line
``RESULT | detail`` last (RESULT: ok, FAILED or skipped). Timings on ``sim`` mean
nothing; the checks of correctness hold there too.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import torch

from async_stager import Checkpointer, Stager, UnsupportedError
from async_stager._core.aio.stager import stager_internals
from async_stager.testing import SimulatedBackend, SimulatedDevice

SCALE = float(os.environ.get("GPU_CHECK_SCALE", "1"))


class Device:
    """The check's device: CUDA, or the simulated device (``kind="sim"``)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.sim: SimulatedDevice | None = None
        #: The simulated backends made (the dry run reports what they did).
        self.backends: list[SimulatedBackend] = []
        if kind == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.sim = SimulatedDevice(
                seed=1, delay=(0.0, 0.002), capacity=max(256 << 20, int((4 << 30) * SCALE))
            )
            self.device = self.sim.device

    def stager(self, **kw: Any) -> Stager:
        if self.sim is not None:
            backend = SimulatedBackend(self.sim)
            self.backends.append(backend)
            return Stager(backend=backend, **kw)
        return Stager(**kw)

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        """``t``'s values on the device (contiguous)."""
        if self.sim is not None:
            return self.sim.tensor(t)
        return t.to(self.device)

    def full(self, numel: int, value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.sim is not None:
            return self.sim.tensor(torch.full((numel,), value, dtype=dtype))
        return torch.full((numel,), value, dtype=dtype, device=self.device)

    def stream(self) -> Any:
        if self.sim is not None:
            return self.sim.stream("side")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        return s

    def using(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        if self.sim is not None:
            return self.sim.using(stream)
        return torch.cuda.stream(stream)

    def busy(self, seconds: float) -> None:
        """A kernel that keeps the current stream busy for about ``seconds``."""
        if self.sim is not None:
            self.sim.launch(lambda: time.sleep(seconds))
        else:
            torch.cuda._sleep(int(seconds * 1.5e9))

    def run(self, fn: Callable[[], Any]) -> None:
        """Device work (kernels writing device tensors) on the current stream."""
        if self.sim is not None:
            self.sim.launch(fn)
        else:
            fn()

    def copy_to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """An asynchronous copy into host memory on the current stream."""
        if self.sim is not None:
            self.sim.copy([dst], [src])
        else:
            dst.copy_(src, non_blocking=True)

    def pinned(self, numel: int) -> torch.Tensor:
        t = torch.zeros(numel)
        return t if self.sim is not None else t.pin_memory()

    def sync_stream(self) -> None:
        """Wait for the current stream only (not the stager's copy streams)."""
        if self.sim is not None:
            ev = self.sim.record(self.sim.current_stream())
            while not self.sim.query(ev):
                time.sleep(0.0002)
        else:
            torch.cuda.current_stream().synchronize()

    def synchronize(self) -> None:
        if self.sim is not None:
            self.sim.synchronize()
        else:
            torch.cuda.synchronize()

    @contextlib.contextmanager
    def capturing(self) -> Iterator[Callable[[], None]]:
        """A graph capture on the current stream; yields the replay (after exit)."""
        if self.sim is not None:
            stream = self.sim.current_stream()
            stream.capturing = True
            try:
                yield lambda: None
            finally:
                stream.capturing = False
        else:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                yield g.replay

    def close(self) -> None:
        if self.sim is not None:
            self.sim.close()
            assert self.sim.errors == [], self.sim.errors


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().resolve_conj().resolve_neg().cpu().clone(memory_format=torch.contiguous_format)
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def say(ok: bool, detail: str) -> None:
    print(("ok" if ok else "FAILED") + " | " + detail)


# -- 3. fresh tensors --------------------------------------------------------------------


async def fresh(dev: Device) -> None:
    """Fresh tensors each checkpoint (state-dict hooks): (a) the old ones dropped: the
    host memory is kept and nothing is pinned again; (b) the old ones kept alive: each
    live state holds its own host copy, so host memory grows by about one state per
    live dict, never more, and never a stale value."""
    n, numel = 64, max(1, int((1 << 30) * SCALE) // 64 // 4)
    state = n * numel * 4

    def new(k: int) -> dict[str, torch.Tensor]:
        return {f"w{i}": dev.full(numel, float(i + k)) for i in range(n)}

    async with dev.stager() as stager:
        times, held = [], []
        for k in range(4):  # (a)
            sd = new(k)
            dev.synchronize()
            t = time.perf_counter()
            staged = await stager.stage(sd)
            times.append(time.perf_counter() - t)
            held.append(stager.host_bytes)
            assert torch.equal(staged["w7"][:16].cpu(), torch.full((16,), 7.0 + k)), "wrong data"
            del staged, sd
        alive, grown = [], []
        for k in range(3):  # (b)
            sd = new(10 + k)
            alive.append(sd)
            staged = await stager.stage(sd)
            assert torch.equal(staged["w7"][:16].cpu(), torch.full((16,), 17.0 + k)), "wrong data"
            grown.append(stager.host_bytes)
            del staged
    again = statistics.median(times[1:])
    kept = held[1:] == held[:1] * 3
    bounded = all(g <= held[0] + (i + 2) * state * 1.05 for i, g in enumerate(grown))
    print(
        f"times {[round(t, 4) for t in times]}; held {[h >> 20 for h in held]} MiB; live {[g >> 20 for g in grown]} MiB"
    )
    say(
        kept and bounded,
        f"{state / 1e9:.2f} GB: first {times[0]:.3f} s, re-stage of fresh tensors {again:.3f} s "
        f"({state / 1e9 / again:.1f} GB/s), host memory {'kept' if kept else 'GREW'} when the old ones die, "
        f"{'at most one state per live dict' if bounded else 'MORE than one state per live dict'} when kept",
    )


# -- 4. side-stream snapshot ---------------------------------------------------------------


async def side_stream(dev: Device) -> None:
    n = 8 << 20 if dev.sim is None else 1 << 16
    x, src, w = dev.full(n, 0.0), dev.full(n, 3.0), dev.full(n, 1.0)
    buf = dev.pinned(n)
    side = dev.stream()
    problems = []
    async with dev.stager() as stager:
        await stager.reserve({"x": x, "buf": buf, "w": w})
        with dev.using(side):
            dev.busy(0.05)  # the producer is still running at the call
            dev.run(lambda: x.fill_(7.0))
            dev.copy_to_host(buf, src)  # a pending copy into a pinned CPU leaf
            pending = stager.stage({"x": x, "buf": buf, "w": w})
            fence = stager.fence()  # reads the side stream now
        await fence
        with dev.using(side):
            dev.run(lambda: w.add_(1.0))  # the optimizer step: after the copies
        staged = await pending
        dev.synchronize()
        if not bool((staged["x"] == 7.0).all()):
            problems.append("producer write missed")
        if not bool((staged["buf"] == 3.0).all()):
            problems.append("pending copy into the pinned CPU leaf missed")
        if not bool((staged["w"] == 1.0).all()):
            problems.append("the step after fence() ran before the copies")
    detail = "; ".join(problems) or "producer, pinned CPU leaf and fence ordered"
    if dev.sim is not None:
        # The simulated device's modes the dry run covers: the CPU leaf through the
        # host copier (after its wait for the captures), streams from a pool.
        hosts = sum(len(b.host_made) for b in dev.backends)
        detail += (
            f"; simulated: CPU leaf by the host copier {hosts > 0}, pooled streams {dev.sim.streams_made}"
        )
        if not hosts:
            problems.append("the CPU leaf was not copied by the host copier")
    say(not problems, detail)


# -- 5. graph capture ----------------------------------------------------------------------


async def graph(dev: Device) -> None:
    x = dev.full(1 << 10, 1.0)
    async with dev.stager() as stager:
        await stager.stage({"x": x})
        refused: list[str] = []
        msg = ""
        y: torch.Tensor | None = None
        with dev.capturing() as replay:
            if dev.sim is None:
                y = x * 2
            for name, call in (("stage", lambda: stager.stage({"x": x})), ("fence", stager.fence)):
                try:
                    coro = call()
                except UnsupportedError as e:
                    refused.append(name)
                    msg = str(e)
                else:
                    coro.close()  # type: ignore[attr-defined]
        dev.run(lambda: x.fill_(3.0))
        replay()
        dev.synchronize()
        replay_ok = y is None or bool((y == 6.0).all())
        after = await stager.stage({"x": x})
        usable = bool((after["x"] == 3.0).all())
    ok = refused == ["stage", "fence"] and replay_ok and usable and "thread_local" in msg
    say(ok, f"refused {refused}, graph replays {replay_ok}, stager usable after {usable}")


# -- 6. checksums ----------------------------------------------------------------------------


async def checksums(dev: Device) -> None:
    from async_stager import Checksums

    h = max(512 if dev.sim is not None else 64, int(512 * SCALE**0.5))
    g = torch.Generator().manual_seed(0)

    def p(*shape: int) -> torch.Tensor:
        return dev.tensor(torch.randn(*shape, generator=g))

    sd = {"emb": p(8192 if dev.sim is None else 1024, h)}
    for i in range(8 if dev.sim is None else 2):
        for name, shape in (("q", (h, h)), ("o", (h, h)), ("up", (4 * h, h)), ("down", (h, 4 * h))):
            for kind in ("w", "m", "v2"):
                sd[f"{i}.{name}.{kind}"] = p(*shape)
        for j in range(8):
            sd[f"{i}.norm{j}"] = p(h)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    async with dev.stager() as stager:
        plain: list[float] = []
        summed: list[float] = []
        bad: list[str] = []
        on_gpu: list[str] = []
        for r in range(5):
            for with_sums in (False, True) if r % 2 else (True, False):
                dev.synchronize()
                t = time.perf_counter()
                lease = await stager.lease(sd, checksums=with_sums)
                (summed if with_sums else plain).append(time.perf_counter() - t)
                if with_sums and r == 0:
                    sums = lease.checksums
                    assert sums is not None
                    on_gpu = [k for k, v in lease.state_dict.items() if sums.algorithm_of(v) == "wsum64"]
                    bad = [
                        k
                        for k in on_gpu
                        if sums.get(lease.state_dict[k]) != Checksums.compute(lease.state_dict[k], "wsum64")
                    ]
                lease.release()
    a, b = statistics.median(plain[1:]), statistics.median(summed[1:])
    say(
        not bad and bool(on_gpu),
        f"{nbytes / 2**20:.0f} MiB in {len(sd)} tensors: stage {a * 1e3:.2f} ms, with checksums "
        f"{b * 1e3:.2f} ms ({100 * (b / a - 1):+.1f}%), {len(on_gpu)} hashed on the device, "
        f"{len(bad)} digests differ from the host copy",
    )


# -- 7. training loop ----------------------------------------------------------------------------


async def training(dev: Device) -> None:
    """Step time of a transformer's forward, backward and optimizer step: alone, with a
    stage overlapping forward/backward (fence before the optimizer step), and with a
    Checkpointer saving every step the same way. Each step is timed to the end of its
    own stream's work (an event on it), not a device-wide synchronize, which would also
    wait for the copies the measurement is about."""
    sim = dev.sim is not None
    d = 64 if sim else max(256, int(1024 * SCALE**0.5)) // 64 * 64
    torch.manual_seed(0)
    where = "cpu" if sim else dev.device
    layer = torch.nn.TransformerEncoderLayer(d, d // 64, 4 * d, batch_first=True, device=where)
    model = torch.nn.TransformerEncoder(layer, 2 if sim else 8, enable_nested_tensor=False).to(where)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(4 if sim else 16, 64 if sim else 256, d, device=where)

    def fwd_bwd() -> None:
        # Reads the parameters, writes only gradients: may overlap the copies.
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()

    def step_alone() -> float:
        t = time.perf_counter()
        fwd_bwd()
        opt.step()
        dev.sync_stream()
        return time.perf_counter() - t

    for _ in range(2):
        step_alone()
    alone = [step_alone() for _ in range(6)]
    loop = asyncio.get_running_loop()
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3
    staged_steps: list[float] = []
    async with dev.stager() as stager:
        await stager.reserve(sd)
        for _ in range(6):
            dev.sync_stream()
            t = time.perf_counter()
            pending = stager.stage(sd)
            fence = stager.fence()
            await loop.run_in_executor(None, fwd_bwd)
            await fence
            dev.run(opt.step)  # queued on the stream the fence ordered
            dev.sync_stream()
            staged_steps.append(time.perf_counter() - t)
            await pending
    saving: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        stager = dev.stager()
        async with Checkpointer(tmp, keep=2, stager=stager) as ckpt:
            want: dict[str, torch.Tensor] = {}
            for step in range(1, 7):
                dev.sync_stream()
                if step == 6:  # the values at the call (bits() waits for the stream)
                    want = {k: bits(v) for k, v in model.state_dict().items()}
                t = time.perf_counter()
                await ckpt.save({"model": model.state_dict(), "optim": opt.state_dict()}, step=step)
                await loop.run_in_executor(None, fwd_bwd)
                await ckpt.fence()
                dev.run(opt.step)
                dev.sync_stream()
                saving.append(time.perf_counter() - t)
            await ckpt.wait()
            back: dict[str, Any] = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
            await ckpt.restore(back, step=6)
        await stager.aclose()
    differ = [k for k, v in want.items() if not torch.equal(bits(back["model"][k]), v)]
    exact = bool(want) and not differ
    if differ:
        print(f"restored step 6 differs in {differ[:5]}")
    a, b, c = statistics.median(alone), statistics.median(staged_steps), statistics.median(saving)
    slow = 100 * (b / a - 1)
    print(
        f"alone {[round(t * 1e3, 2) for t in alone]} ms; staged {[round(t * 1e3, 2) for t in staged_steps]} ms"
    )
    print(f"saving {[round(t * 1e3, 2) for t in saving]} ms")
    say(
        exact and (sim or slow < 50),
        f"{nbytes / 2**20:.0f} MiB model+Adam: step {a * 1e3:.2f} ms alone, {b * 1e3:.2f} ms with a stage "
        f"overlapping fwd/bwd ({slow:+.1f}%), {c * 1e3:.2f} ms with a Checkpointer save every step "
        f"({100 * (c / a - 1):+.1f}%); restored bit-exact {exact}",
    )


# -- 8. shared memory ----------------------------------------------------------------------------


async def share(dev: Device) -> None:
    """share_memory=True: bit-exact, and a writer process gets the staged copy without
    a copy (its arenas' descriptors, not torch's share_memory_()); time against a
    private stager. (Arena storages are memfd-backed: ``is_shared()`` is False for them
    by design; the handoff is what matters.)"""
    from async_stager._share import reducers as _mp_reduce

    numel = max(1 << 10, int((256 << 20) * SCALE) // 16 // 4)
    sd = {f"w{i}": dev.tensor(torch.randn(numel)) for i in range(16)}
    sd["small"] = dev.tensor(torch.arange(100).to(torch.bfloat16))

    async def timed(shared: bool) -> tuple[float, bool, int | None]:
        async with dev.stager(share_memory=shared) as stager:
            await stager.stage(sd)
            dev.synchronize()
            t = time.perf_counter()
            staged = await stager.stage(sd)
            s = time.perf_counter() - t
            same = all(torch.equal(bits(staged[k]), bits(v)) for k, v in sd.items())
            copied = None
            if shared:
                _mp_reduce.counters(reset=True)
                got = pickle.loads(ForkingPickler.dumps(staged))
                copied = _mp_reduce.counters().copied_bytes
                same = same and all(torch.equal(bits(got[k]), bits(v)) for k, v in sd.items())
            return s, same, copied

    private, same_p, _ = await timed(False)
    shared_s, same_s, copied = await timed(True)
    gb = 16 * numel * 4 / 1e9
    say(
        same_p and same_s and copied == 0,
        f"{gb:.2f} GB: shared {shared_s * 1e3:.1f} ms ({gb / shared_s:.1f} GB/s), private {private * 1e3:.1f} ms; "
        f"bit-exact {same_s and same_p}, bytes copied handing it to a writer: {copied}",
    )


# -- 9. budgeted pipeline ----------------------------------------------------------------------


async def budget(dev: Device) -> None:
    import torch.distributed.checkpoint as dcp

    import async_stager.dcp as adcp

    total = max(8 << 20, int((2 << 30) * SCALE))
    n = 32
    numel = total // n // 4
    g = torch.Generator().manual_seed(3)
    sd: dict[str, Any] = {f"w{i}": dev.tensor(torch.randn(numel, generator=g)) for i in range(n)}
    sd["bias"] = [dev.tensor(torch.randn(64, generator=g)) for _ in range(200)]
    sd["step"] = 7
    budget_bytes = max(2 * numel * 4 + (1 << 20), total // 8)
    want = {k: bits(v) for k, v in sd.items() if isinstance(v, torch.Tensor)}
    stats: list[Any] = []
    with tempfile.TemporaryDirectory() as tmp:
        async with dev.stager() as stager:
            for i in range(2):  # the second save reuses the ring and the streams
                t = time.perf_counter()
                await adcp.save(
                    sd,
                    stager=stager,
                    checkpoint_id=Path(tmp) / str(i),
                    no_dist=True,
                    host_budget_bytes=budget_bytes,
                    on_budget_stats=stats.append,
                )
                secs = time.perf_counter() - t
            # Budgeted saves in parallel, twice: the second round takes the lanes (their
            # streams) of the first, and draws none from the device's pool.
            part = {k: sd[k] for k in list(sd)[:4]}
            lanes = []
            for r in range(2):
                await asyncio.gather(
                    *(
                        adcp.save(
                            part,
                            stager=stager,
                            checkpoint_id=Path(tmp) / f"p{r}{j}",
                            no_dist=True,
                            host_budget_bytes=budget_bytes,
                        )
                        for j in range(2)
                    )
                )
                lanes.append(stager_internals(stager).lanes.made)
        out: dict[str, Any] = {
            k: torch.zeros(v.shape, dtype=v.dtype) for k, v in sd.items() if isinstance(v, torch.Tensor)
        }
        out["bias"] = [torch.zeros(64) for _ in range(200)]
        dcp.load(out, checkpoint_id=str(Path(tmp) / "1"), no_dist=True)
    exact = all(torch.equal(bits(out[k]), v) for k, v in want.items())
    exact = exact and all(torch.equal(bits(a), bits(b)) for a, b in zip(out["bias"], sd["bias"]))
    s = stats[1]
    reused = lanes[0] == lanes[1]
    ok = exact and reused and s.peak_bytes <= budget_bytes and s.arena_bytes <= budget_bytes
    say(
        ok,
        f"{total / 2**20:.0f} MiB through a {budget_bytes / 2**20:.0f} MiB ring: {total / 1e9 / secs:.2f} GB/s "
        f"to disk, peak {s.peak_bytes / 2**20:.0f} MiB, fence after {s.fence_seconds:.2f} s, blocked "
        f"{s.blocked_seconds:.2f} s; bit-exact {exact}; parallel saves: lanes {lanes} "
        f"({'no stream drawn again' if reused else 'NEW STREAMS DRAWN'})",
    )


# -- 10. bit-exactness -------------------------------------------------------------------------


async def bitexact(dev: Device) -> None:
    import torch.distributed.checkpoint as dcp

    import async_stager.dcp as adcp

    g = torch.Generator().manual_seed(5)
    dtypes = [
        torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
        torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
        torch.float8_e4m3fn, torch.float8_e5m2,
    ]  # fmt: skip
    sd: dict[str, Any] = {}
    for dt in dtypes:
        raw = torch.randint(
            0, 256, (4099 * torch.empty((), dtype=dt).element_size(),), dtype=torch.uint8, generator=g
        )
        sd[str(dt).removeprefix("torch.")] = dev.tensor(raw.view(dt))  # every bit pattern, NaN payloads too
    z = dev.tensor(torch.randn(33, 17, dtype=torch.complex64, generator=g))
    m = dev.tensor(torch.randn(96, 40, generator=g))
    sd.update({"conj": z.conj(), "neg": z.conj().imag, "t": m.t(), "step": m[::3, 1::2]})
    for i in range(300):  # gathered through scratch
        sd[f"small{i}"] = dev.tensor(torch.randn(5, generator=g).half())
    want = {k: bits(v) for k, v in sd.items()}
    bad: list[str] = []
    async with dev.stager() as stager:
        staged = await stager.stage(sd)
        bad += [f"stage:{k}" for k, v in want.items() if not torch.equal(bits(staged[k]), v)]
        del staged
        with tempfile.TemporaryDirectory() as tmp:
            await adcp.save(sd, stager=stager, checkpoint_id=tmp, no_dist=True, host_budget_bytes=1 << 20)
            out = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in sd.items()}
            dcp.load(out, checkpoint_id=tmp, no_dist=True)
        bad += [f"budget:{k}" for k, v in want.items() if not torch.equal(bits(out[k]), v)]
    say(
        not bad,
        f"{len(dtypes)} dtypes, conj/neg/non-contiguous views, 300 small: staged and budgeted save bit-exact"
        if not bad
        else f"differ: {bad[:8]}",
    )


# -- 11. DTensor -------------------------------------------------------------------------------


async def dtensor(dev: Device) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "gloo" if dev.sim is not None else "nccl",
            init_method=f"file://{tmp}/store",
            rank=0,
            world_size=1,
        )
        try:
            mesh = init_device_mesh("cpu" if dev.sim is not None else "cuda", (1,))
            full = torch.randn(256, 64, generator=torch.Generator().manual_seed(9))
            dt = distribute_tensor(full.to(mesh.device_type), mesh, [Shard(0)])
            if dev.sim is not None:
                local = dev.tensor(dt.to_local())
                dt = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
            async with dev.stager() as stager:
                staged = await stager.stage({"w": dt})
            got = staged["w"]
            ok = isinstance(got, DTensor) and got.to_local().device.type == "cpu"
            ok = ok and torch.equal(bits(got.to_local()), bits(full))
        finally:
            dist.destroy_process_group()
    say(ok, f"a sharded DTensor on {dev.kind} staged as a DTensor of host memory, bit-exact {ok}")


STEPS: dict[str, Callable[[Device], Any]] = {
    "fresh": fresh,
    "side_stream": side_stream,
    "graph": graph,
    "checksums": checksums,
    "training": training,
    "share": share,
    "budget": budget,
    "bitexact": bitexact,
    "dtensor": dtensor,
}


def main(argv: list[str]) -> int:
    kind = os.environ.get("GPU_CHECK_DEVICE", "cuda")
    if kind == "cuda" and not torch.cuda.is_available():
        print("skipped | no CUDA")
        return 0
    dev = Device("cuda" if kind == "cuda" else "sim")
    try:
        asyncio.run(STEPS[argv[1]](dev))
    finally:
        dev.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
