#!/usr/bin/env bash
# A second venv, .venv-triton36, with the Triton the GPU machine has (3.6) beside the CPU torch of .venv,
# to run the interpreter kernel tests and the compile gate against that Triton too. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-triton36
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
if ! "$VENV/bin/python" -c "import triton, sys; sys.exit(0 if triton.__version__.startswith('3.6') else 1)" 2>/dev/null; then
  echo "venv-triton36: torch==2.13.0 (CPU) and triton==3.6.0"
  $PIP install -q "torch==2.13.0" "triton==3.6.0" 2>&1 | grep -v "^WARNING: Location" || true
fi
# numpy < 2.3: triton 3.6's interpreter holds scalars as 1-element arrays and calls int() on them,
# which numpy 2.3 and newer refuse ("only 0-dimensional arrays can be converted to Python scalars").
$PIP install -q -e . pytest hypothesis jaxtyping "triton==3.6.0" "numpy<2.3" 2>&1 | grep -v "^WARNING: Location" || true
"$VENV/bin/python" -c "import torch, triton; print(f'venv-triton36: torch {torch.__version__}, triton {triton.__version__}')"
