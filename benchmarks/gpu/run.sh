#!/usr/bin/env bash
# The device check in one command, for a CUDA machine that has torch and triton but no network:
#
#   bash benchmarks/gpu/run.sh              # results in $OUT (the lent machine) or benchmarks/gpu/out
#   bash benchmarks/gpu/run.sh --dry-run    # the same on a CPU, tiny shapes (is the check itself sound?)
#
# Packages that machine lacks (gguf) travel as wheels in .whl/ (scripts/device_wheels.sh fetches them);
# they are unpacked into /tmp/site, never over the machine's own packages.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
if [ -x .venv/bin/python ] && ! "$PY" -c "import torch" 2>/dev/null; then PY=.venv/bin/python; fi
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 STAGEWISE_QUIET=1 HF_HUB_OFFLINE=1
exec "$PY" -m stagewise.devtools.device_check --out "${OUT:-benchmarks/gpu/out}" "$@"
