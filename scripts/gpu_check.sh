#!/usr/bin/env bash
# GPU check: one prepared script for a CUDA machine, under 5 minutes on one GPU.
# Each step's bound (its timeout) is given; the steps add up to 280 s at most.
#
#   1. pytest tests/gpu/test_cuda.py tests/core/test_device_ordering.py and every other cuda-marked
#      test (the Checkpointer round trip, two devices refused): the CUDA path and its
#      ordering logic. Fails when CUDA is there but no CUDA test ran (all skipped). 90 s
#   2. the benchmark on the GPU, modest runs; its row: GB/s against a one-buffer pinned
#      copy, small tensors against DCP, loop lag p99                               60 s
#   3. fresh tensors re-staged, the old ones kept alive (new addresses each time): host
#      memory kept, no re-pinning (timings)                                        25 s
#   4. a snapshot under a side stream: producer still running, pinned CPU leaf being
#      filled, fence read at the call                                              15 s
#   5. a stage inside a CUDA graph capture is refused, and the capture survives    15 s
#   6. checksums on the GPU: staging time with and without (WSUM64 before the copy),
#      digests equal to the host copy's                                            25 s
#   7. training-step slowdown: a transformer forward/backward on the GPU, alone and
#      while a stage and a write to disk overlap it                                35 s
#   8. share_memory=True on CUDA: bit-exact, shared storages, time against private 15 s
#   then one table (also in summary.txt).
#
# Imports: the package no longer needs sniffio (async_stager._waiting tells the running
# event loop itself), so an anyio without sniffio is enough. Every import the package
# and the steps need (torch, anyio, xxhash, pytest) is checked; the missing ones are
# installed from wheels/ when that folder is carried (Python 3.12 wheels: `pip download
# xxhash anyio idna typing_extensions --no-deps --only-binary=:all: --python-version
# 3.12 --platform manylinux2014_x86_64 -d wheels`, then carry "wheels").
# pytest-asyncio, pytest-timeout, hypothesis, trio, uvloop and matplotlib are optional:
# pytest-asyncio is always left out (-p no:asyncio), its and pytest-timeout's ini
# options are then unknown (ignored config warnings), without pytest-timeout the
# strict-markers option is dropped, without trio (uvloop) the trio- (uvloop-)
# parametrized tests are deselected. Pass/fail is pytest's own result (its exit status
# and JUnit report); a module that cannot be imported is a failure, not skipped.
#
# Results go to "$OUT" if set, else ./gpu_out: env.txt, pytest.txt, pytest.xml,
# bench_cuda.{txt,json}, checks.txt, summary.txt, summary.json. Exit status non-zero if
# a step failed. Python is "$PYTHON" if set, else python3.
#
# Dry run on a CPU machine (the CUDA steps then report "skipped: no CUDA"):
#   GPU_CHECK_DEVICE=cpu GPU_CHECK_SCALE=0.01 scripts/gpu_check.sh
# GPU_CHECK_BLOCK="trio uvloop pytest_asyncio hypothesis matplotlib" makes those
# modules unimportable (a sitecustomize first on PYTHONPATH), as on the GPU machine;
# CI runs that (tests/gpu/test_gpu_readiness.py::test_gpu_check_dry_run).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-$PWD/gpu_out}"
DEVICE="${GPU_CHECK_DEVICE:-cuda}"
SCALE="${GPU_CHECK_SCALE:-1}"
PY="${PYTHON:-python3}"
BENCH_RUNS="${GPU_CHECK_RUNS:-3}"
mkdir -p "$OUT_DIR"
: > "$OUT_DIR/summary.txt"
: > "$OUT_DIR/checks.txt"
# The package from this working tree, whether or not it is installed.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
failed=0
rows=()
if [ -n "${GPU_CHECK_BLOCK:-}" ]; then
    # Modules the GPU machine may lack, made unimportable for the dry run.
    mkdir -p "$OUT_DIR/blocked"
    cat > "$OUT_DIR/blocked/sitecustomize.py" <<EOF
import sys

_BLOCKED = set("${GPU_CHECK_BLOCK}".split())


class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in _BLOCKED:
            raise ImportError(f"{name} blocked by gpu_check's dry run")
        return None


sys.meta_path.insert(0, _Block())
EOF
    export PYTHONPATH="$OUT_DIR/blocked:$PYTHONPATH"
fi
# Every import the package and the steps need; the missing ones from wheels/ if carried.
missing=()
for m in torch anyio xxhash pytest; do
    "$PY" -c "import $m" >/dev/null 2>&1 || missing+=("$m")
done
if [ "${#missing[@]}" -gt 0 ] && [ -d wheels ]; then
    echo "missing: ${missing[*]}; installing from wheels/ (no index)"
    "$PY" -m pip install --quiet --no-index --find-links wheels "${missing[@]}" \
        || "$PY" -m pip install --quiet --no-index --no-deps wheels/*.whl \
        || echo "wheels/: install failed"
fi

note() { echo "[gpu_check $(date -u +%H:%M:%S)] $*" | tee -a "$OUT_DIR/summary.txt"; }
has() { "$PY" -c "import $1" >/dev/null 2>&1; }
# row STEP RESULT SECONDS DETAIL
row() { rows+=("$(printf '%-28s %-8s %7s  %s' "$1" "$2" "$3" "$4")"); }
now() { date +%s.%N; }
since() { "$PY" -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$(now)"; }

{
    date -u
    nvidia-smi 2>&1 || echo "nvidia-smi: not available"
    "$PY" -c 'import sys, torch; print("python", sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(), "devices", torch.cuda.device_count())'
    for m in pytest anyio xxhash trio uvloop pytest_asyncio pytest_timeout hypothesis numpy matplotlib; do
        if has "$m"; then echo "module $m: yes"; else echo "module $m: no"; fi
    done
    nproc
    free -g 2>/dev/null || true
} > "$OUT_DIR/env.txt" 2>&1

cuda_ok=0
if [ "$DEVICE" = cuda ] && "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    cuda_ok=1
fi
for m in torch anyio xxhash pytest; do
    has "$m" || note "required module $m is missing: steps that need it fail"
done

# -- 1. tests --------------------------------------------------------------------------
t0=$(now)
# GPU_CHECK_TESTS: the test ids to run instead (the CI dry run takes a short list).
read -r -a tests <<< "${GPU_CHECK_TESTS:-tests/gpu/test_cuda.py tests/core/test_device_ordering.py tests/core/test_device_checksums.py tests/checkpoint/test_checkpointer.py::test_cuda_state_round_trip tests/reliability/test_reliability_input.py::test_two_cuda_devices_in_one_state_dict_are_refused}"
common_args=(-p no:asyncio -p no:cacheprovider -p no:benchmark
    -W "ignore::pytest.PytestConfigWarning" -W "ignore::pytest.PytestUnknownMarkWarning")
# Hazard: an installed but unimportable plugin (the dry run's blocked hypothesis) still
# loads through its entry point and fails at the summary; the GPU machine has none.
has hypothesis || common_args+=(-p no:hypothesispytest)
pytest_args=("${tests[@]}" -q -rfEs --junitxml "$OUT_DIR/pytest.xml" "${common_args[@]}")
if ! has pytest_timeout; then
    # @pytest.mark.timeout is then an unknown marker: drop --strict-markers (from
    # addopts) and let the outer `timeout` bound the run instead.
    pytest_args+=(-o "addopts=-ra")
    note "pytest-timeout missing: per-test timeouts off, the run is bounded at 90 s"
fi
deselect=()
for m in trio uvloop; do
    if ! has "$m"; then
        deselect+=("not $m")
        note "$m missing: $m-parametrized tests deselected"
    fi
done
if [ "${#deselect[@]}" -gt 0 ]; then
    expr="${deselect[0]}"
    for d in "${deselect[@]:1}"; do expr="$expr and $d"; done
    pytest_args+=(-k "$expr")
fi
timeout 90 "$PY" -m pytest "${pytest_args[@]}" > "$OUT_DIR/pytest.txt" 2>&1
rc=$?
# The cuda-marked tests among them (collection only: a few seconds), one id a line.
timeout 30 "$PY" -m pytest "${tests[@]}" "${common_args[@]}" -m cuda --collect-only -q -o "addopts=" \
    2>/dev/null | grep '::' > "$OUT_DIR/cuda_tests.txt"
# Counts from pytest's JUnit report (absent if pytest did not get that far).
counts=$("$PY" - "$OUT_DIR/pytest.xml" "$OUT_DIR/cuda_tests.txt" <<'EOF' 2>/dev/null
import sys
import xml.etree.ElementTree as ET

root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root)
t = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
# CUDA tests that ran: the cuda-marked ids (path::name[params]) that passed. JUnit
# names a case by its dotted module path ("tests.test_cuda") and its name.
cuda_ids = set()
for line in open(sys.argv[2]).read().split():
    path, _, name = line.partition("::")
    cuda_ids.add((path.removesuffix(".py").replace("/", "."), name.replace("::", ".")))
cuda_ran = 0
for case in root.iter("testcase"):
    ran = not any(child.tag in ("skipped", "failure", "error") for child in case)
    cls, name = case.get("classname", ""), case.get("name", "")
    # A test in a class: classname carries the class, the id carries it after "::".
    module, _, klass = cls.rpartition(".") if (cls, name) not in cuda_ids else (cls, "", "")
    if ran and ((cls, name) in cuda_ids or (module, f"{klass}.{name}") in cuda_ids):
        cuda_ran += 1
print(f"{t['tests'] - t['failures'] - t['errors'] - t['skipped']} passed, {t['failures']} failed, "
      f"{t['errors']} errors, {t['skipped']} skipped, {cuda_ran} CUDA tests ran")
EOF
)
counts=${counts:-"no report"}
cuda_tests=$(printf '%s' "$counts" | sed -n 's/.* \([0-9][0-9]*\) CUDA tests ran$/\1/p')
tail -n 3 "$OUT_DIR/pytest.txt" | sed 's/^/    /' >> "$OUT_DIR/summary.txt"
if [ "$rc" -eq 0 ] && [ "$cuda_ok" -eq 1 ] && [ "${cuda_tests:-0}" -eq 0 ]; then
    row "pytest (cuda + ordering)" FAILED "$(since "$t0")" "$counts; CUDA is here but no CUDA test ran"
    failed=1
elif [ "$rc" -eq 0 ]; then
    row "pytest (cuda + ordering)" ok "$(since "$t0")" "$counts"
else
    why="rc $rc"
    [ "$rc" -eq 124 ] && why="timed out"
    [ "$rc" -eq 2 ] && why="interrupted or a module failed to import (rc 2)"
    [ "$rc" -eq 5 ] && why="no test collected (rc 5)"
    row "pytest (cuda + ordering)" FAILED "$(since "$t0")" "$counts; $why; see pytest.txt"
    failed=1
fi

# -- 2. benchmark -------------------------------------------------------------------------
t0=$(now)
timeout 60 "$PY" -m async_stager bench --device "$DEVICE" --scale "$SCALE" --runs "$BENCH_RUNS" --warmup 1 --quiet \
    --workloads "${GPU_CHECK_WORKLOADS:-transformer,small20k,large1g,fresh}" ${GPU_CHECK_BENCH_ARGS:-} --json "$OUT_DIR/bench_${DEVICE}.json" > "$OUT_DIR/bench_${DEVICE}.txt" 2>&1
rc=$?
if [ "$rc" -eq 0 ]; then
    # The row's numbers: ours in GB/s against the one-buffer copy (large1g), small
    # tensors against DCP (small20k), loop lag p99 (worst over workloads), failures.
    detail=$("$PY" - "$OUT_DIR/bench_${DEVICE}.json" <<'EOF' 2>&1
import json
import sys

report = json.load(open(sys.argv[1]))
parts, lag, failed = [], 0.0, []
for w in report["workloads"]:
    ours = next(s for s in w["stagers"] if s["name"] == "async_stager")
    for s in w["stagers"]:
        if s["error"] is not None:
            failed.append(f"{s['name']} on {w['name']}")
    if ours["error"] is not None:
        continue
    lag = max(lag, ours["lag"]["p99_ms"])
    if w["name"] == "large1g":
        parts.append(f"large {ours['gbps']:.1f} GB/s vs 1-buffer {w['bound']['gbps']:.1f}")
    if w["name"] == "small20k":
        vs = ours["vs_dcp"]
        parts.append(f"small {ours['us_per_tensor']:.1f} us/tensor" + (f", {vs:.1f}x DCP" if vs else ", no DCP"))
parts.append(f"lag p99 {lag:.1f} ms")
if failed:
    parts.append("failed (footnote): " + ", ".join(failed))
print("; ".join(parts))
EOF
)
    row "bench ($DEVICE, scale $SCALE)" ok "$(since "$t0")" "$detail"
else
    row "bench ($DEVICE, scale $SCALE)" FAILED "$(since "$t0")" "rc $rc$([ "$rc" -eq 124 ] && echo ', timed out'); see bench_${DEVICE}.txt"
    failed=1
fi

# -- 3-8. standalone checks -----------------------------------------------------------
# Each prints one line "RESULT | detail" last; RESULT is ok, FAILED or skipped.
check() {
    local name=$1 limit=$2 code=$3 t0 out rc line
    t0=$(now)
    out=$(GPU_CHECK_SCALE="$SCALE" timeout "$limit" "$PY" -c "$code" 2>&1)
    rc=$?
    { echo "== $name (rc $rc)"; echo "$out"; } >> "$OUT_DIR/checks.txt"
    line=$(printf '%s\n' "$out" | grep -E '^(ok|FAILED|skipped) \|' | tail -n 1)
    if [ "$rc" -ne 0 ] || [ -z "$line" ]; then
        row "$name" FAILED "$(since "$t0")" "rc $rc$([ "$rc" -eq 124 ] && echo ', timed out'); see checks.txt"
        failed=1
        return
    fi
    row "$name" "${line%% |*}" "$(since "$t0")" "${line#*| }"
    [ "${line%% |*}" = FAILED ] && failed=1
}

if [ "$cuda_ok" -ne 1 ]; then
    row "fresh tensors re-staged" skipped 0 "no CUDA"
    row "side-stream snapshot" skipped 0 "no CUDA"
    row "graph capture refused" skipped 0 "no CUDA"
    row "checksums on the GPU" skipped 0 "no CUDA"
    row "training-step slowdown" skipped 0 "no CUDA"
    row "share_memory on CUDA" skipped 0 "no CUDA"
else
check "fresh tensors re-staged" 25 '
import asyncio, os, time, torch
from async_stager import Stager

scale = float(os.environ["GPU_CHECK_SCALE"])
n, numel = 64, max(1, int((1 << 30) * scale) // 64 // 4)  # 1 GiB at scale 1, in 64 tensors

def fresh():
    return {f"w{i}": torch.full((numel,), float(i), device="cuda") for i in range(n)}

async def main():
    async with Stager() as stager:
        times, held, alive, ptrs = [], [], [], set()
        for k in range(4):
            # New allocations each time (what state_dict() hooks often make); the old
            # dicts stay alive, so the caching allocator cannot hand their addresses back.
            sd = fresh()
            alive.append(sd)
            ptrs.update(t.data_ptr() for t in sd.values())
            torch.cuda.synchronize()
            t = time.perf_counter()
            staged = await stager.stage(sd)
            times.append(time.perf_counter() - t)
            held.append(stager.host_bytes)
            assert torch.equal(staged["w7"][:16], torch.full((16,), 7.0)), "wrong data"
            del staged
        assert len(ptrs) == 4 * n, "a fresh tensor got an old address back"
        gb = n * numel * 4 / 1e9
        again = sorted(times[1:])[len(times[1:]) // 2]
        kept = held[1:] == held[:1] * 3
        mem = "kept" if kept else "grew"
        ok = kept and again < times[0]
        print(f"times {[round(t, 4) for t in times]}, host bytes {[h >> 20 for h in held]} MiB")
        print(("ok" if ok else "FAILED") + f" | {gb:.2f} GB, new addresses each time: first {times[0]:.3f} s "
              f"(pins), re-stage {again:.3f} s ({gb / again:.1f} GB/s), host memory {mem}")

asyncio.run(main())
'

check "side-stream snapshot" 15 '
import asyncio, torch
from async_stager import Stager

SPIN = 50_000_000

async def main():
    n = 8 << 20
    x = torch.zeros(n, device="cuda")
    src = torch.full((n,), 3.0, device="cuda")
    buf = torch.zeros(n).pin_memory()
    w = torch.ones(n, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    problems = []
    async with Stager() as stager:
        await stager.reserve({"x": x, "buf": buf, "w": w})
        with torch.cuda.stream(side):
            torch.cuda._sleep(4 * SPIN)  # the producer is still running at the call
            x.fill_(7.0)
            buf.copy_(src, non_blocking=True)  # a pending copy into a pinned CPU leaf
            pending = stager.stage({"x": x, "buf": buf, "w": w})
            fence = stager.fence()  # reads the side stream now
        await fence  # awaited with the default stream current
        with torch.cuda.stream(side):
            w.add_(1.0)  # the optimizer step: after the copies
        staged = await pending
        torch.cuda.synchronize()
        if not bool((staged["x"] == 7.0).all()):
            problems.append("producer write missed")
        if not bool((staged["buf"] == 3.0).all()):
            problems.append("pending copy into the pinned CPU leaf missed")
        if not bool((staged["w"] == 1.0).all()):
            problems.append("the step after fence() ran before the copies")
    print(("FAILED | " + "; ".join(problems)) if problems else "ok | producer, pinned CPU leaf and fence ordered")

asyncio.run(main())
'

check "graph capture refused" 15 '
import asyncio, torch
from async_stager import Stager, UnsupportedError

async def main():
    x = torch.ones(1 << 10, device="cuda")
    async with Stager() as stager:
        await stager.stage({"x": x})
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y = x * 2  # warm-up
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        refused = []
        msg = ""
        with torch.cuda.graph(g):
            y = x * 2
            for name, call in (("stage", lambda: stager.stage({"x": x})), ("fence", stager.fence)):
                try:
                    coro = call()
                except UnsupportedError as e:
                    refused.append(name)
                    msg = str(e)
                else:
                    coro.close()
        x.fill_(3.0)
        g.replay()
        torch.cuda.synchronize()
        replay_ok = bool((y == 6.0).all())
        after = await stager.stage({"x": x})
        usable = bool((after["x"] == 3.0).all())
    ok = refused == ["stage", "fence"] and replay_ok and usable and "thread_local" in msg
    print(f"refused: {refused}; replay ok: {replay_ok}; usable after: {usable}")
    print(("ok" if ok else "FAILED") + f" | refused {refused}, graph replays, stager usable after")

asyncio.run(main())
'

check "checksums on the GPU" 25 '
import asyncio, os, statistics, time, torch
from async_stager import Checksums, Stager

scale = float(os.environ["GPU_CHECK_SCALE"])
h = max(64, int(512 * scale ** 0.5))
g = torch.Generator(device="cuda").manual_seed(0)
def p(*shape):
    return torch.randn(*shape, device="cuda", generator=g)
# The bench transformer layout: per layer 4 h*h and 2 h*4h matrices, norms, biases; Adam
# state twice over; a vocabulary embedding.
sd = {"emb": p(8192, h)}
for i in range(8):
    for name, shape in (("q", (h, h)), ("k", (h, h)), ("v", (h, h)), ("o", (h, h)), ("up", (4 * h, h)), ("down", (h, 4 * h))):
        for kind in ("w", "m", "v2"):
            sd[f"{i}.{name}.{kind}"] = p(*shape)
    for j in range(8):
        sd[f"{i}.norm{j}"] = p(h)
nbytes = sum(t.numel() * t.element_size() for t in sd.values())

async def main():
    async with Stager() as stager:
        plain, summed = [], []
        for r in range(9):
            for with_sums in ((False, True) if r % 2 else (True, False)):
                torch.cuda.synchronize()
                t = time.perf_counter()
                lease = await stager.lease(sd, checksums=with_sums)
                (summed if with_sums else plain).append(time.perf_counter() - t)
                if with_sums and r == 0:
                    sums = lease.checksums
                    on_gpu = [k for k, v in lease.state_dict.items() if sums.algorithm_of(v) == "wsum64"]
                    bad = [k for k in on_gpu if sums.get(lease.state_dict[k]) != Checksums.compute(lease.state_dict[k], "wsum64")]
                lease.release()
        a, b = statistics.median(plain[1:]), statistics.median(summed[1:])
        cost = 100 * (b / a - 1)
        print(f"plain {[round(x * 1e3, 2) for x in plain]} ms; with checksums {[round(x * 1e3, 2) for x in summed]} ms")
        ok = not bad and len(on_gpu) > 0
        print(("ok" if ok else "FAILED") + f" | {nbytes / 2**20:.0f} MiB in {len(sd)} tensors: stage {a * 1e3:.2f} ms, "
              f"with checksums {b * 1e3:.2f} ms ({cost:+.1f}%), {len(on_gpu)} hashed on the GPU, "
              f"{len(bad)} digests differ from the host copy")

asyncio.run(main())
'

check "training-step slowdown" 35 '
import asyncio, os, statistics, tempfile, threading, time, torch
from async_stager import Stager

scale = float(os.environ["GPU_CHECK_SCALE"])
d = max(256, int(1024 * scale ** 0.5)) // 64 * 64
torch.manual_seed(0)
layer = torch.nn.TransformerEncoderLayer(d, d // 64, 4 * d, batch_first=True, device="cuda")
model = torch.nn.TransformerEncoder(layer, 8, enable_nested_tensor=False).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randn(16, 256, d, device="cuda")

def fwd_bwd():
    opt.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    torch.cuda.synchronize()

def timed_steps(n):
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fwd_bwd()
        opt.step()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return out

async def main():
    timed_steps(3)
    alone = timed_steps(10)
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3
    loop = asyncio.get_running_loop()
    async with Stager() as stager:
        await stager.reserve(sd)
        with tempfile.TemporaryDirectory() as tmp:
            overlapped, writes = [], []
            deadline = time.perf_counter() + 10
            while len(overlapped) < 10 and time.perf_counter() < deadline:
                # The documented overlap: stage at the step boundary, forward/backward
                # while the copies run, await the fence before the optimizer writes,
                # and the previous checkpoint is written to disk meanwhile.
                torch.cuda.synchronize()
                t = time.perf_counter()
                pending = stager.stage(sd)
                fence = stager.fence()
                await loop.run_in_executor(None, fwd_bwd)
                await fence
                opt.step()
                torch.cuda.synchronize()
                overlapped.append(time.perf_counter() - t)
                staged = await pending
                writes.append(loop.run_in_executor(None, torch.save, staged, os.path.join(tmp, f"c{len(writes) % 2}.pt")))
                if len(writes) > 1:
                    await writes[-2]
            await asyncio.gather(*writes)
    stages = len(overlapped)
    a, b = statistics.median(alone), statistics.median(overlapped)
    slow = 100 * (b / a - 1)
    print(f"alone {[round(t * 1e3, 2) for t in alone]} ms; overlapped {[round(t * 1e3, 2) for t in overlapped]} ms")
    ok = len(overlapped) > 0 and slow < 50
    print(("ok" if ok else "FAILED") + f" | {nbytes / 2**20:.0f} MiB model+Adam, step {a * 1e3:.2f} ms alone, "
          f"{b * 1e3:.2f} ms with a stage and write overlapping ({slow:+.1f}%, {stages} stages)")

asyncio.run(main())
'

check "share_memory on CUDA" 15 '
import asyncio, os, time, torch
from async_stager import Stager

scale = float(os.environ["GPU_CHECK_SCALE"])
numel = max(1 << 10, int((256 << 20) * scale) // 16 // 4)
sd = {f"w{i}": torch.randn(numel, device="cuda") for i in range(16)}
sd["small"] = torch.arange(100, device="cuda", dtype=torch.bfloat16)

async def timed(share):
    async with Stager(share_memory=share) as stager:
        await stager.stage(sd)
        torch.cuda.synchronize()
        t = time.perf_counter()
        staged = await stager.stage(sd)
        s = time.perf_counter() - t
        same = all(torch.equal(staged[k].view(torch.uint8), v.cpu().view(torch.uint8)) for k, v in sd.items())
        shared = all(v.is_shared() for v in staged.values())
        return s, same, shared

async def main():
    private, same_p, _ = await timed(False)
    shared_s, same_s, shared = await timed(True)
    ok = same_p and same_s and shared
    gb = 16 * numel * 4 / 1e9
    print(("ok" if ok else "FAILED") + f" | {gb:.2f} GB: shared {shared_s * 1e3:.1f} ms ({gb / shared_s:.1f} GB/s), "
          f"private {private * 1e3:.1f} ms; bit-exact {same_s and same_p}, storages shared {shared}")

asyncio.run(main())
'
fi

# -- summary --------------------------------------------------------------------------
{
    echo
    printf '%-28s %-8s %7s  %s\n' "step" "result" "seconds" "detail"
    printf '%s\n' "${rows[@]}"
    echo
    echo "overall: $([ "$failed" -eq 0 ] && echo ok || echo FAILED); results in $OUT_DIR"
} | tee -a "$OUT_DIR/summary.txt"
printf '%s\n' "${rows[@]}" | "$PY" -c '
import json, sys
rows = [dict(zip(("step", "result", "seconds", "detail"), (l[:28].strip(), l[29:37].strip(), l[38:45].strip(), l[47:])))
        for l in sys.stdin.read().splitlines()]
json.dump({"failed": bool(int(sys.argv[1])), "rows": rows}, open(sys.argv[2], "w"), indent=1)
' "$failed" "$OUT_DIR/summary.json"
exit "$failed"
