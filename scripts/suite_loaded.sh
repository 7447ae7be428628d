#!/usr/bin/env bash
# The README's test command on a loaded machine, the way the project repeats it: two
# busy processes (Python loops that never sleep, each taking a whole core) run for as
# long as the suite does, then the wall time and the load average are printed. The suite
# must pass like this (issue 37): no test depends on how busy the machine is; a timeout
# is a hang guard. CONTRIBUTING.md ("Tests") gives the times to expect.
#
#   scripts/suite_loaded.sh                    # the README's command beside two busy loops
#   BUSY=0 scripts/suite_loaded.sh             # the same, quiet (for the comparison)
#   scripts/suite_loaded.sh --durations=30     # extra pytest arguments are passed on
#
# Exit status: pytest's. The busy processes are this script's children, ended by their
# process ids when it exits (also on Ctrl-C).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
BUSY="${BUSY:-2}"
busy=()
stop_busy() {
    for pid in "${busy[@]}"; do
        kill "$pid" 2>/dev/null
        wait "$pid" 2>/dev/null
    done
    busy=()
}
trap stop_busy EXIT
trap 'exit 130' INT TERM
for _ in $(seq 1 "$BUSY"); do
    "$PY" -c 'while True: pass' &
    busy+=("$!")
done
echo "suite_loaded: $BUSY busy processes (${busy[*]:-none}) on $(nproc) cores; load average $(cut -d' ' -f1-3 /proc/loadavg)"
start=$(date +%s)
"$PY" -m pytest -q -n auto --dist loadgroup "$@"
status=$?
end=$(date +%s)
stop_busy
echo "suite_loaded: pytest exit status $status after $((end - start)) s wall beside $BUSY busy processes; load average $(cut -d' ' -f1-3 /proc/loadavg)"
exit "$status"
