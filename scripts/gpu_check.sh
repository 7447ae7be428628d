#!/usr/bin/env bash
# GPU check: one prepared script for a CUDA machine, within 8 minutes on one GPU.
#
#   1. pytest tests/test_cuda.py tests/test_device_ordering.py and every other cuda-marked
#      test (the Checkpointer round trip, two devices refused): the CUDA path and its
#      ordering logic
#   2. the benchmark on the GPU, modest runs
#   3. fresh tensors re-staged: host memory kept, no re-pinning (timings)
#   4. a snapshot under a side stream: producer still running, pinned CPU leaf being
#      filled, fence read at the call
#   5. a stage inside a CUDA graph capture is refused, and the capture survives
#   6. checksums on the GPU: staging time with and without (WSUM64 before the copy),
#      digests equal to the host copy's
#   then one summary table (also in summary.txt).
#
# Needs torch with CUDA, anyio, sniffio and pytest; xxhash (the Checkpointer's
# checksums) is installed from wheels/ when that folder is carried (the GPU machine
# has no index: `pip download xxhash --no-deps --only-binary=:all: --python-version
# 3.12 --platform manylinux2014_x86_64 -d wheels`, then carry "wheels"); pytest-asyncio, pytest-timeout,
# hypothesis, trio, uvloop and matplotlib are optional (the GPU machine may lack them):
# pytest-asyncio is always left out (-p no:asyncio), its and pytest-timeout's ini
# options are then unknown (ignored config warnings), without pytest-timeout the
# strict-markers option is dropped, without trio the trio-parametrized tests are
# deselected. Pass/fail is pytest's own result (its exit status and JUnit report);
# a module that cannot be imported is a failure, not skipped.
#
# Results go to "$OUT" if set, else ./gpu_out: env.txt, pytest.txt, pytest.xml,
# bench_cuda.{txt,json}, checks.txt, summary.txt. Exit status non-zero if a step failed.
#
# Dry run on a CPU machine (the CUDA steps then report "skipped: no CUDA"):
#   GPU_CHECK_DEVICE=cpu GPU_CHECK_SCALE=0.05 scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-$PWD/gpu_out}"
DEVICE="${GPU_CHECK_DEVICE:-cuda}"
SCALE="${GPU_CHECK_SCALE:-1}"
PY="${PYTHON:-python}"
mkdir -p "$OUT_DIR"
: > "$OUT_DIR/summary.txt"
: > "$OUT_DIR/checks.txt"
# The package from this working tree, whether or not it is installed.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
failed=0
rows=()
if [ -d wheels ] && ! "$PY" -c "import xxhash" 2>/dev/null; then
    "$PY" -m pip install --quiet --no-index --no-deps wheels/*.whl || echo "wheels/: install failed"
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
    for m in pytest anyio sniffio trio uvloop pytest_asyncio pytest_timeout hypothesis numpy matplotlib; do
        if has "$m"; then echo "module $m: yes"; else echo "module $m: no"; fi
    done
    nproc
    free -g 2>/dev/null || true
} > "$OUT_DIR/env.txt" 2>&1

cuda_ok=0
if [ "$DEVICE" = cuda ] && "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    cuda_ok=1
fi
for m in torch anyio sniffio pytest; do
    has "$m" || note "required module $m is missing: steps that need it fail"
done

# -- 1. tests --------------------------------------------------------------------------
t0=$(now)
pytest_args=(tests/test_cuda.py tests/test_device_ordering.py tests/test_device_checksums.py tests/test_checkpointer.py::test_cuda_state_round_trip
    tests/test_reliability_input.py::test_two_cuda_devices_in_one_state_dict_are_refused -q -rfEs -p no:asyncio
    -p no:cacheprovider --junitxml "$OUT_DIR/pytest.xml"
    -W "ignore::pytest.PytestConfigWarning" -W "ignore::pytest.PytestUnknownMarkWarning")
if ! has pytest_timeout; then
    # @pytest.mark.timeout is then an unknown marker: drop --strict-markers (from
    # addopts) and let the outer `timeout` bound the run instead.
    pytest_args+=(-o "addopts=-ra")
    note "pytest-timeout missing: per-test timeouts off, the run is bounded at 170 s"
fi
if ! has trio; then
    pytest_args+=(-k "not trio")
    note "trio missing: trio-parametrized tests deselected"
fi
timeout 170 "$PY" -m pytest "${pytest_args[@]}" > "$OUT_DIR/pytest.txt" 2>&1
rc=$?
# Counts from pytest's JUnit report (absent if pytest did not get that far).
counts=$("$PY" - "$OUT_DIR/pytest.xml" <<'EOF' 2>/dev/null
import sys
import xml.etree.ElementTree as ET

root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root)
t = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
print(f"{t['tests'] - t['failures'] - t['errors'] - t['skipped']} passed, {t['failures']} failed, "
      f"{t['errors']} errors, {t['skipped']} skipped")
EOF
)
counts=${counts:-"no report"}
tail -n 3 "$OUT_DIR/pytest.txt" | sed 's/^/    /' >> "$OUT_DIR/summary.txt"
if [ "$rc" -eq 0 ]; then
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
timeout 150 "$PY" -m async_stager bench --device "$DEVICE" --scale "$SCALE" --runs 3 --warmup 1 --quiet \
    --json "$OUT_DIR/bench_${DEVICE}.json" > "$OUT_DIR/bench_${DEVICE}.txt" 2>&1
rc=$?
if [ "$rc" -eq 0 ]; then
    row "bench ($DEVICE, scale $SCALE)" ok "$(since "$t0")" "see bench_${DEVICE}.txt"
else
    row "bench ($DEVICE, scale $SCALE)" FAILED "$(since "$t0")" "rc $rc$([ "$rc" -eq 124 ] && echo ', timed out'); see bench_${DEVICE}.txt"
    failed=1
fi

# -- 3-5. standalone checks -----------------------------------------------------------
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
else
check "fresh tensors re-staged" 40 '
import asyncio, os, time, torch
from async_stager import Stager

scale = float(os.environ["GPU_CHECK_SCALE"])
n, numel = 64, max(1, int((1 << 30) * scale) // 64 // 4)  # 1 GiB at scale 1, in 64 tensors

def fresh():
    return {f"w{i}": torch.full((numel,), float(i), device="cuda") for i in range(n)}

async def main():
    async with Stager() as stager:
        times, held = [], []
        for k in range(4):
            sd = fresh()  # new allocations each time: what state_dict() hooks often make
            torch.cuda.synchronize()
            t = time.perf_counter()
            staged = await stager.stage(sd)
            times.append(time.perf_counter() - t)
            held.append(stager.host_bytes)
            assert torch.equal(staged["w7"][:16], torch.full((16,), 7.0)), "wrong data"
            del staged, sd
        gb = n * numel * 4 / 1e9
        again = sorted(times[1:])[len(times[1:]) // 2]
        kept = held[1:] == held[:1] * 3
        mem = "kept" if kept else "grew"
        ok = kept and again < times[0]
        print(f"times {[round(t, 4) for t in times]}, host bytes {[h >> 20 for h in held]} MiB")
        print(("ok" if ok else "FAILED") + f" | {gb:.2f} GB: first {times[0]:.3f} s (pins), fresh re-stage "
              f"{again:.3f} s ({gb / again:.1f} GB/s), host memory {mem}")

asyncio.run(main())
'

check "side-stream snapshot" 40 '
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

check "graph capture refused" 40 '
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

check "checksums on the GPU" 60 '
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
fi

# -- summary --------------------------------------------------------------------------
{
    echo
    printf '%-28s %-8s %7s  %s\n' "step" "result" "seconds" "detail"
    printf '%s\n' "${rows[@]}"
    echo
    echo "overall: $([ "$failed" -eq 0 ] && echo ok || echo FAILED); results in $OUT_DIR"
} | tee -a "$OUT_DIR/summary.txt"
exit "$failed"
