# The set-up commands of the README:
#   make trace     install everything, then print the shape flow of a short prompt through the real model
#   make test      install everything, then run the whole test suite
#   make check     install everything, then ruff: lint and format, as CI checks them
#   make notebook  install everything, add JupyterLab and a "stagewise" kernel, open notebooks/
# "install everything" runs scripts/install.sh, which returns at once when pyproject.toml and the script are
# unchanged since its last complete run (a stamp in .venv; STAGEWISE_REINSTALL=1 forces a reinstall)
PROMPT ?= The capital of France is

.PHONY: install trace test check notebook notebooks-outputs lint compile-gate test-triton36
install:
	./scripts/install.sh

trace: install
	.venv/bin/trace "$(PROMPT)"

# One pytest worker per core (at most 4; each loads its own models), work stolen between them as they finish.
# scripts/install_browser.sh first: the page's test drives Debian's chromium (apt, as root, only when missing)
test: install
	./scripts/install_browser.sh
	.venv/bin/python -m pytest -q -n auto --maxprocesses 4 --dist worksteal

# Lint and format check (100 columns in stages/, kernels/, quant/, tuning/, models/, engine/, tokenizer/, kv/:
# their ruff.toml; 120 elsewhere), and no statement split over three lines only by a trailing comment
# (scripts/check_comment_splits.py; --fix moves each such comment above its statement). --no-cache: ruff's
# cache would miss those per-folder ruff.toml files. The notebooks' jupytext sources are linted too (the .ipynb
# are made from them), not format-checked: ruff format would rewrap most of them (their hand-wrapped two-line
# f-strings become three-line calls), and each rewrap means a re-render
check: install
	.venv/bin/ruff check --no-cache stagewise tests scripts notebooks/*.py
	.venv/bin/ruff format --no-cache --check stagewise tests scripts
	.venv/bin/python scripts/check_comment_splits.py

# JupyterLab goes into the same .venv (only here: `make test` runs the notebooks without it); the kernel named
# "stagewise" (this .venv's Python) is registered for any other Jupyter front end too (VS Code, a system Jupyter)
# As root (a container), JupyterLab refuses to start without --allow-root: it is added only then
notebook: install
	.venv/bin/python -m pip install -q jupyterlab
	.venv/bin/python -m ipykernel install --user --name stagewise --display-name "Python (stagewise)"
	.venv/bin/jupyter lab notebooks/ $(if $(filter 0,$(shell id -u)),--allow-root)

# Execute every notebook and store its outputs (figures, printed numbers) in the committed .ipynb, with the
# hash of its .py source in the metadata (tests/test_notebooks.py checks the hash; `make test` executes the
# notebooks in memory and never rewrites them). QUICK=1: the smaller workloads (metadata mode "quick");
# JOBS=N notebooks at once; NOTEBOOKS="00_pipeline 05_attention" only those; STALE=1 only those whose .py changed.
# A notebook whose timing cells ran while other processes used over 25% of the CPU is not written (ALLOW_LOAD=1
# writes it anyway); notebooks/render_log.json records each render's load share
notebooks-outputs: install
	.venv/bin/python scripts/render_notebooks.py $(if $(QUICK),--quick) $(if $(STALE),--stale) \
		$(if $(ALLOW_LOAD),--allow-load) --jobs $(or $(JOBS),1) $(NOTEBOOKS)

lint:
	.venv/bin/ruff check stagewise tests

compile-gate: install
	.venv/bin/python scripts/compile_gate.py

# The interpreter kernel tests and the compile gate under triton 3.6 (the GPU machine's) in .venv-triton36
test-triton36:
	./scripts/venv_triton36.sh
	.venv-triton36/bin/python -m pytest -q -x tests/kernels tests/devtools/test_compile_gate.py
