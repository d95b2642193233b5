"""The teaching notebooks: each executes top to bottom, imports stagewise, redefines nothing, draws.

Notebooks live in `notebooks/` as a jupytext percent-format `.py` (the source, reviewable in git)
paired with an `.ipynb` that holds the outputs of its last execution (`make notebooks-outputs`:
figures and printed numbers a reader sees without running anything) and, in its metadata, the
sha256 of the `.py` it was made from. Here the `.ipynb` is checked against its `.py` without
executing (same cells, same hash, the `stagewise` kernel), and every notebook is executed in
memory with STAGEWISE_NOTEBOOK_QUICK=1, which shrinks workloads without changing what they
teach; the committed files are never rewritten.
"""

import hashlib
import re
from pathlib import Path

import jupytext
import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
EXPECTED = [
    "00_pipeline",
    "01_tokenize",
    "02_embedding_rmsnorm",
    "03_qkv_gqa",
    "04_rope",
    "05_attention",
    "06_ffn",
    "07_lm_head_sampling",
    "08_kv_cache",
    "09_paged_kv_cache",
    "09b_radix_cache",
    "10_continuous_batching",
    "11_roofline",
    "12a_triton_kernels",
    "12b_triton_kernels",
    "13_tensor_parallel",
    "14_quantization",
    "15_speculative_decoding",
    "16_capstone",
    "17_batch_invariance",
]
FORBIDDEN = [
    (r"@triton\.jit", "defines a Triton kernel"),
    (r"^\s*import triton", "imports triton directly (kernels live in stagewise.kernels)"),
    (r"^\s*def (naive|torch|triton|optimized)\b", "re-implements a stage"),
    (r"^\s*class \w*(Scheduler|BlockManager|Tokenizer|Tracer)\b", "re-implements an engine part"),
]
# 12a's exercises are Triton kernels the student completes, so that notebook (and only it) defines
# kernels and imports triton; every kernel the package runs still lives in stagewise.kernels.
WRITES_KERNELS = {"12a_triton_kernels"}
KERNEL_PATTERNS = {r"@triton\.jit", r"^\s*import triton"}


def code_of(nb) -> str:
    return "\n".join(c.source for c in nb.cells if c.cell_type == "code")


@pytest.mark.parametrize("name", EXPECTED)
def test_notebook_is_paired_rendered_and_uses_the_package(name):
    ipynb, py = NOTEBOOKS / f"{name}.ipynb", NOTEBOOKS / f"{name}.py"
    assert ipynb.is_file() and py.is_file(), f"{name}: both the .ipynb and its jupytext .py must exist"
    nb = nbformat.read(ipynb, as_version=4)
    source = jupytext.read(py)
    assert [c.source for c in nb.cells] == [c.source for c in source.cells], f"{name}: .ipynb out of sync with .py"
    rendered = nb.metadata.get("stagewise", {})
    assert rendered.get("source_sha256") == hashlib.sha256(py.read_bytes()).hexdigest(), (
        f"{name}: the .ipynb's outputs were not made from this .py; run `make notebooks-outputs NOTEBOOKS={name}`"
    )
    assert rendered.get("mode") in ("quick", "full"), f"{name}: metadata does not say which mode made the outputs"
    assert nb.metadata.get("kernelspec", {}).get("name") == "stagewise", f"{name}: kernelspec is not 'stagewise'"
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"], f"{name}: a committed output is an error"
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{name}: no figure among the committed outputs"
    code = code_of(nb)
    assert re.search(r"^\s*(from|import) stagewise", code, re.M), f"{name} does not import stagewise"
    for pattern, why in FORBIDDEN:
        if name in WRITES_KERNELS and pattern in KERNEL_PATTERNS:
            continue
        assert not re.search(pattern, code, re.M), f"{name} {why}"
    assert "plt." in code or "matplotlib" in code, f"{name} draws no figure"


# Notes for the project's developers, not for a student: how loaded the machine was (the render
# log holds that, scripts/render_notebooks.py), the project's own GPU runs
DEVELOPER_NOTES = [r"other processes used \d+%", r"reference run on another machine", r"committed device check"]


@pytest.mark.parametrize("name", EXPECTED)
def test_no_note_for_developers_in_the_committed_outputs(name):
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    for pattern in DEVELOPER_NOTES:
        found = re.search(pattern, text)
        assert not found, f"{name}: a committed output says {found.group(0)!r}"


def test_the_rendered_outputs_name_their_machine():
    nb = nbformat.read(NOTEBOOKS / "00_pipeline.ipynb", as_version=4)
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert re.search(r"^machine: .+ logical cores", text, re.M), "00's outputs do not name the machine they ran on"


@pytest.mark.parametrize("name", EXPECTED)
def test_notebook_executes_and_draws(name, monkeypatch):
    monkeypatch.setenv("STAGEWISE_NOTEBOOK_QUICK", "1")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = jupytext.read(NOTEBOOKS / f"{name}.py")  # the source, in memory: the committed .ipynb is never rewritten
    client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()  # raises CellExecutionError on the first failing cell
    images = [
        o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if "image/png" in o.get("data", {})
    ]
    assert images, f"{name} executed but showed no figure"


def test_no_unexpected_notebooks():
    found = sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb"))
    assert found == EXPECTED, f"notebooks/ holds {found}; update EXPECTED (and the README list) when adding one"


def test_readme_lists_every_notebook():
    readme = (NOTEBOOKS.parent / "README.md").read_text()
    for name in EXPECTED:
        assert f"notebooks/{name}.ipynb" in readme, f"README does not list {name}"
