#!/usr/bin/env bash
# GPU check: one prepared script for a CUDA machine, under 5 minutes on one GPU.
# Each step's bound (its timeout, in seconds) is given; the bounds add up to 290 s
# (tests/gpu/test_gpu_readiness.py checks this sum against the bounds below).
#
#   0. the requirements: every import of the package and the steps that is missing
#      (the dependencies but torch, and the `gpu-check` extra: pytest, pytest-timeout;
#      `python scripts/requirements.py gpu-check` lists them) is installed with pip:
#      from wheels/ when that folder is carried (no index), else from the index  15 s
#   1. pytest tests/gpu/test_cuda.py tests/core/test_device_ordering.py and every other
#      cuda-marked test (the Checkpointer round trip, two devices refused): the CUDA
#      path and its ordering logic. Fails when CUDA is there but no CUDA test ran (all
#      skipped)                                                                    65 s
#      then the cuda-marked ids among them (collection only)                       15 s
#   2. the benchmark on the GPU, modest runs; its row: GB/s against a one-buffer pinned
#      copy, small tensors against DCP, loop lag p99                               40 s
#   Steps 3-11 are tests/gpu/check_steps.py (STEP in brackets), on $GPU_CHECK_DEVICE:
#   3. [fresh] fresh tensors re-staged: the old ones dropped (host memory kept, no
#      re-pinning, timings), and the old ones kept alive (at most one state per live
#      dict)                                                                       20 s
#   4. [side_stream] a snapshot under a side stream: producer still running, pinned
#      CPU leaf being filled, fence read at the call                               15 s
#   5. [graph] a stage inside a CUDA graph capture is refused, the capture survives 10 s
#   6. [checksums] on the device: staging time with and without (WSUM64 before the
#      copy), digests equal to the host copy's                                     15 s
#   7. [training] a transformer's forward/backward/step alone, with a stage overlapping
#      forward and backward (fence before the step), and with a Checkpointer saving
#      every step the same way (restored bit-exact); each step timed to the end of its
#      own stream, never a device-wide synchronize (which also waits for the copies) 35 s
#   8. [share] share_memory=True: bit-exact, handed to a writer without a copy (arena
#      descriptors, not share_memory_()), time against private                     15 s
#   9. [budget] the budgeted pipeline beyond toy size (2 GiB through a ring of 1/8),
#      twice (the second reuses ring and streams), and budgeted saves in parallel
#      (no new stream drawn the second time): bit-exact, peak within budget       20 s
#  10. [bitexact] every dtype (every bit pattern), conj/neg/non-contiguous views, many
#      small tensors: staged and budgeted-saved bit-exact                          15 s
#  11. [dtensor] a sharded DTensor on the device staged as a DTensor of host memory 10 s
#   then one table.
#
# Carried wheels for a machine without an index (Python 3.12, say):
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       -d wheels $(python scripts/requirements.py gpu-check)
# then carry "wheels". The package itself comes from this working tree (PYTHONPATH).
# pytest-asyncio, hypothesis, trio, uvloop and matplotlib are optional: pytest-asyncio
# is always left out (-p no:asyncio), its ini options are then unknown (ignored config
# warnings), without pytest-timeout the strict-markers option is dropped, without trio
# (uvloop) the trio- (uvloop-) parametrized tests are deselected. Pass/fail is pytest's
# own result (its exit status and JUnit report); a module that cannot be imported is a
# failure, not skipped.
#
# Results go to "$OUT" if set, else ./gpu_out, three files at most (a run's machinery
# may bring back only a few): summary.txt (notes and the table), summary.json (the
# rows), logs.tar.gz (env.txt, pip.txt, pytest.txt, pytest.xml, cuda_tests.txt,
# bench_*.{txt,json}, checks.txt). All three are rewritten after every step, so a run
# cut short still has what it did. Exit status non-zero if a step failed. Python is
# "$PYTHON" if set, else python3; pip is "$GPU_CHECK_PIP" if set, else "$PYTHON -m pip".
#
# Dry run on a CPU machine: every step's logic on the simulated device (timings there
# mean nothing; correctness checks hold), the benchmark on the CPU:
#   GPU_CHECK_DEVICE=sim GPU_CHECK_SCALE=0.01 scripts/gpu_check.sh
# (GPU_CHECK_SLACK=N multiplies every step's bound, for a loaded machine.)
# (GPU_CHECK_DEVICE=cuda without a GPU reports steps 3-11 "skipped: no CUDA".)
# GPU_CHECK_BLOCK="trio uvloop pytest_asyncio hypothesis matplotlib" makes those
# modules unimportable (a sitecustomize first on PYTHONPATH), as on the GPU machine;
# CI runs that (tests/gpu/test_gpu_readiness.py::test_gpu_check_dry_run).
# GPU_CHECK_ONLY=requirements stops after step 0.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-$PWD/gpu_out}"
# The device every step runs on: cuda, or sim (the simulated device of
# async_stager.testing: the dry run, every step's logic on the CPU; the benchmark then
# runs on the CPU). cpu is taken as sim.
DEVICE="${GPU_CHECK_DEVICE:-cuda}"
[ "$DEVICE" = cpu ] && DEVICE=sim
BENCH_DEVICE=$([ "$DEVICE" = cuda ] && echo cuda || echo cpu)
SCALE="${GPU_CHECK_SCALE:-1}"
PY="${PYTHON:-python3}"
BENCH_RUNS="${GPU_CHECK_RUNS:-3}"
# Multiplies every step's bound: a dry run on a loaded CI machine spends most of a step
# starting Python and importing torch (seconds), which the GPU run does not.
SLACK="${GPU_CHECK_SLACK:-1}"
# Each step's bound in seconds (the header's list; they add up to its total).
B_REQUIREMENTS=15
B_PYTEST=65
B_COLLECT=15
B_BENCH=40
CHECKS=(  # name, bound, check_steps.py STEP
    "fresh tensors re-staged|20|fresh"
    "side-stream snapshot|15|side_stream"
    "graph capture refused|10|graph"
    "checksums on the device|15|checksums"
    "training loop|35|training"
    "share_memory handoff|15|share"
    "budgeted pipeline|20|budget"
    "bit-exact dtypes and views|15|bitexact"
    "DTensor|10|dtensor"
)
mkdir -p "$OUT_DIR"
# Logs are written here and bundled into $OUT_DIR/logs.tar.gz after every step: $OUT
# holds three files at most.
LOGS="$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")"
trap 'rm -rf "$LOGS" "$LOGS.tar.gz"' EXIT
rm -f "$OUT_DIR/summary.txt" "$OUT_DIR/summary.json" "$OUT_DIR/logs.tar.gz"
: > "$LOGS/notes.txt"
: > "$LOGS/checks.txt"
# The package from this working tree, whether or not it is installed.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
failed=0
rows=()
if [ -n "${GPU_CHECK_BLOCK:-}" ]; then
    # Modules the GPU machine may lack, made unimportable for the dry run.
    mkdir -p "$LOGS/blocked"
    cat > "$LOGS/blocked/sitecustomize.py" <<EOF
import importlib.machinery
import sys

_BLOCKED = set("${GPU_CHECK_BLOCK}".split())


class _Missing:
    # Importing raises ModuleNotFoundError, as for a module that is not installed.
    def create_module(self, spec):
        raise ModuleNotFoundError(f"{spec.name} blocked by gpu_check's dry run", name=spec.name)

    def exec_module(self, module):
        raise ModuleNotFoundError(f"{module.__name__} blocked by gpu_check's dry run")


class _Block:
    # A spec without an origin: importlib.util.find_spec callers (torch._dynamo) then
    # treat the module as absent, and importing it fails.
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in _BLOCKED:
            return importlib.machinery.ModuleSpec(name, _Missing(), origin=None)
        return None


sys.meta_path.insert(0, _Block())
EOF
    export PYTHONPATH="$LOGS/blocked:$PYTHONPATH"
fi

note() { echo "[gpu_check $(date -u +%H:%M:%S)] $*" | tee -a "$LOGS/notes.txt"; }
has() { "$PY" -c "import $1" >/dev/null 2>&1; }
# row STEP RESULT SECONDS DETAIL
row() { rows+=("$(printf '%-28s %-8s %7s  %s' "$1" "$2" "$3" "$4")"); }
now() { date +%s.%N; }
since() { "$PY" -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$(now)"; }
# The three results, rewritten after every step (a run cut short keeps what it did):
# the notes and the table so far, the rows as JSON, the logs bundled.
report() {
    local final=${1:-}
    {
        cat "$LOGS/notes.txt"
        echo
        printf '%-28s %-8s %7s  %s\n' "step" "result" "seconds" "detail"
        [ "${#rows[@]}" -gt 0 ] && printf '%s\n' "${rows[@]}"
        echo
        if [ -n "$final" ]; then
            echo "overall: $([ "$failed" -eq 0 ] && echo ok || echo FAILED); results in $OUT_DIR"
        else
            echo "(in progress)"
        fi
    } > "$OUT_DIR/summary.txt.part" && mv "$OUT_DIR/summary.txt.part" "$OUT_DIR/summary.txt"
    [ "${#rows[@]}" -gt 0 ] && printf '%s\n' "${rows[@]}" | "$PY" -c '
import json, sys
rows = [dict(zip(("step", "result", "seconds", "detail"), (l[:28].strip(), l[29:37].strip(), l[38:45].strip(), l[47:])))
        for l in sys.stdin.read().splitlines()]
json.dump({"failed": bool(int(sys.argv[1])), "finished": sys.argv[3] == "1", "rows": rows}, open(sys.argv[2], "w"), indent=1)
' "$failed" "$OUT_DIR/summary.json.part" "$([ -n "$final" ] && echo 1 || echo 0)" \
        && mv "$OUT_DIR/summary.json.part" "$OUT_DIR/summary.json"
    tar -czf "$LOGS.tar.gz" -C "$LOGS" --exclude=blocked --exclude=notes.txt . 2>/dev/null \
        && mv "$LOGS.tar.gz" "$OUT_DIR/logs.tar.gz"
}

# -- 0. requirements ----------------------------------------------------------------------
# What the package and the steps import, from the package's own metadata (the
# dependencies but torch, and the gpu-check extra); pip installs those missing.
t0=$(now)
read -r -a PIP <<< "${GPU_CHECK_PIP:-$PY -m pip}"
mapfile -t reqs < <("$PY" scripts/requirements.py gpu-check 2>>"$LOGS/pip.txt")
mapfile -t missing < <("$PY" scripts/requirements.py --missing gpu-check 2>>"$LOGS/pip.txt")
if [ "${#reqs[@]}" -eq 0 ]; then
    row "requirements" FAILED "$(since "$t0")" "scripts/requirements.py listed nothing; see pip.txt"
    failed=1
elif [ "${#missing[@]}" -eq 0 ]; then
    row "requirements" ok "$(since "$t0")" "all ${#reqs[@]} present"
else
    where=(); from="the index"
    if [ -d wheels ]; then where=(--no-index --find-links wheels); from="wheels/"; fi
    echo "+ ${PIP[*]} install ${where[*]} ${missing[*]}" >> "$LOGS/pip.txt"
    timeout "$((B_REQUIREMENTS * SLACK))" "${PIP[@]}" install --quiet "${where[@]}" "${missing[@]}" >> "$LOGS/pip.txt" 2>&1
    rc=$?
    mapfile -t still < <("$PY" scripts/requirements.py --missing gpu-check 2>>"$LOGS/pip.txt")
    if [ "${#still[@]}" -eq 0 ]; then
        row "requirements" ok "$(since "$t0")" "installed from $from: ${missing[*]}"
    else
        row "requirements" FAILED "$(since "$t0")" "rc $rc; still missing ${still[*]} (from $from); see pip.txt"
        failed=1
    fi
fi
report
[ "${GPU_CHECK_ONLY:-}" = requirements ] && { report final; exit "$failed"; }

{
    date -u
    nvidia-smi 2>&1 || echo "nvidia-smi: not available"
    "$PY" -c 'import sys, torch; print("python", sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(), "devices", torch.cuda.device_count())'
    for m in pytest anyio xxhash trio uvloop pytest_asyncio pytest_timeout hypothesis numpy matplotlib; do
        if has "$m"; then echo "module $m: yes"; else echo "module $m: no"; fi
    done
    nproc
    free -g 2>/dev/null || true
} > "$LOGS/env.txt" 2>&1

cuda_ok=0
if [ "$DEVICE" = cuda ] && "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    cuda_ok=1
fi
for m in torch anyio numpy xxhash pytest; do
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
pytest_args=("${tests[@]}" -q -rfEs --junitxml "$LOGS/pytest.xml" "${common_args[@]}")
if ! has pytest_timeout; then
    # @pytest.mark.timeout is then an unknown marker: drop --strict-markers (from
    # addopts) and let the outer `timeout` bound the run instead.
    pytest_args+=(-o "addopts=-ra")
    note "pytest-timeout missing: per-test timeouts off, the run is bounded at $((B_PYTEST * SLACK)) s"
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
timeout "$((B_PYTEST * SLACK))" "$PY" -m pytest "${pytest_args[@]}" > "$LOGS/pytest.txt" 2>&1
rc=$?
# The cuda-marked tests among them (collection only: a few seconds), one id a line.
timeout "$((B_COLLECT * SLACK))" "$PY" -m pytest "${tests[@]}" "${common_args[@]}" -m cuda --collect-only -q -o "addopts=" \
    2>/dev/null | grep '::' > "$LOGS/cuda_tests.txt"
# Counts from pytest's JUnit report (absent if pytest did not get that far).
counts=$("$PY" - "$LOGS/pytest.xml" "$LOGS/cuda_tests.txt" <<'EOF' 2>/dev/null
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
tail -n 3 "$LOGS/pytest.txt" | sed 's/^/    /' >> "$LOGS/notes.txt"
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
report
timeout "$((B_BENCH * SLACK))" "$PY" -m async_stager bench --device "$BENCH_DEVICE" --scale "$SCALE" --runs "$BENCH_RUNS" --warmup 1 --quiet \
    --workloads "${GPU_CHECK_WORKLOADS:-transformer,small20k,large1g,fresh}" ${GPU_CHECK_BENCH_ARGS:-} --json "$LOGS/bench_${BENCH_DEVICE}.json" > "$LOGS/bench_${BENCH_DEVICE}.txt" 2>&1
rc=$?
if [ "$rc" -eq 0 ]; then
    # The row's numbers: ours in GB/s against the one-buffer copy (large1g), small
    # tensors against DCP (small20k), loop lag p99 (worst over workloads), failures.
    detail=$("$PY" - "$LOGS/bench_${BENCH_DEVICE}.json" <<'EOF' 2>&1
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
    row "bench ($BENCH_DEVICE, scale $SCALE)" ok "$(since "$t0")" "$detail"
else
    row "bench ($BENCH_DEVICE, scale $SCALE)" FAILED "$(since "$t0")" "rc $rc$([ "$rc" -eq 124 ] && echo ', timed out'); see bench_${BENCH_DEVICE}.txt"
    failed=1
fi

# -- 3-11. standalone checks ------------------------------------------------------------
# Each is a step of tests/gpu/check_steps.py on $DEVICE (cuda; sim: the simulated
# device, the same logic on the CPU) and prints one line "RESULT | detail" last; RESULT
# is ok, FAILED or skipped.
check() {
    local name=$1 limit=$2 step=$3 t0 out rc line
    t0=$(now)
    out=$(GPU_CHECK_DEVICE="$DEVICE" GPU_CHECK_SCALE="$SCALE" timeout "$((limit * SLACK))" "$PY" tests/gpu/check_steps.py "$step" 2>&1)
    rc=$?
    { echo "== $name (rc $rc)"; echo "$out"; } >> "$LOGS/checks.txt"
    line=$(printf '%s\n' "$out" | grep -E '^(ok|FAILED|skipped) \|' | tail -n 1)
    if [ "$rc" -ne 0 ] || [ -z "$line" ]; then
        row "$name" FAILED "$(since "$t0")" "rc $rc$([ "$rc" -eq 124 ] && echo ', timed out'); see checks.txt"
        failed=1
        return
    fi
    row "$name" "${line%% |*}" "$(since "$t0")" "${line#*| }"
    [ "${line%% |*}" = FAILED ] && failed=1
}
report

for entry in "${CHECKS[@]}"; do
    IFS='|' read -r name bound step <<< "$entry"
    if [ "$DEVICE" = cuda ] && [ "$cuda_ok" -ne 1 ]; then
        row "$name" skipped 0 "no CUDA"
    else
        check "$name" "$bound" "$step"
        report
    fi
done

# -- summary --------------------------------------------------------------------------
report final
# The table, once, last in the output.
sed -n '/^step  /,$p' "$OUT_DIR/summary.txt"
exit "$failed"
