#!/usr/bin/env bash
# The package's CPU suite on torch 2.11 (what the GPU machine has), beside CI's 2.13.
#
# A venv under ${VENV:-/tmp/venv-torch211} that sees the system site-packages (pytest,
# anyio, xxhash, ...) with torch 2.11.0 installed over them, then the test files whose
# behaviour depends on the torch version: the DCP drop-in stagers, the Stager, dcp.save,
# the engine. The system python is never changed.
#
# torch 2.11.0: the CPU wheel from PyTorch's CPU index where that index is reachable;
# else PyPI's wheel, which is the CUDA build and pulls the nvidia-* runtime packages
# (several GB); it runs on a CPU-only machine all the same.
#
#   scripts/ci_torch211.sh            # exit status: pytest's
#   PYTHON=python3.12 scripts/ci_torch211.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV="${VENV:-/tmp/venv-torch211}"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv --system-site-packages "$VENV"
fi
if ! "$VENV/bin/python" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.11.") else 1)' 2>/dev/null; then
    "$VENV/bin/python" -m pip install --quiet torch==2.11.0 --index-url https://download.pytorch.org/whl/cpu \
        || "$VENV/bin/python" -m pip install --quiet torch==2.11.0
fi
"$VENV/bin/python" -c 'import torch; print("torch", torch.__version__, torch.__file__)'
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    tests/dcp/test_default_stager.py tests/dcp/test_default_stager_dropin.py tests/core/test_stager.py \
    tests/dcp/test_dcp.py tests/core/test_engine.py "$@"
