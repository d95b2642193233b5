"""12a's kernel checks: only a launch of the student's own kernel passes, and a bad mask reads FAIL.

The wrong answers the issue lists: plain PyTorch, the package's own kernel, the reference stage's
output, softmax(s) @ v without tiles, and the mask that runs past the row (`cols < 2*inter`),
which once aborted the whole Python process. Also: the stubs of the notebook read "not yet", and
the poisoned guard bands catch an overrun by themselves (the interpreter's watch switched off, as
on a GPU).
"""

import importlib.util
import sys

import jupytext
import nbformat
import pytest
import torch
from nbclient import NotebookClient

import stagewise.exercises.kernel_launch as kernel_launch
from stagewise.exercises import my_parts, result
from stagewise.kernels import activation, rmsnorm
from stagewise.stages.ffn import silu_and_mul_naive
from tests.exercises import wrong_kernels as wrong
from tests.exercises.test_notebook_exercises import NOTEBOOKS, solutions

NB12A = solutions("12a_triton_kernels")

WRONG = [
    ("12a.silu_and_mul", silu_and_mul_naive, "not a Python function"),  # plain PyTorch
    (
        "12a.silu_and_mul",
        lambda gate_up: silu_and_mul_naive(gate_up).clone(),
        "not a Python function",
    ),  # the stage's output
    ("12a.silu_and_mul", activation._silu_and_mul_kernel, "package's own kernel"),
    ("12a.silu_and_mul", wrong.silu_mask_past_the_row, "past the end of gate_up"),
    ("12a.silu_and_mul", wrong.silu_without_masks, "outside gate_up"),
    ("12a.silu_and_mul", wrong.silu_rows_assumed_contiguous, "gap between two rows"),
    ("12a.silu_and_mul", wrong.silu_store_unmasked, "outside out"),
    ("12a.rmsnorm", lambda x, w, eps: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w, "not a Python"),
    ("12a.rmsnorm", rmsnorm._rmsnorm_kernel, "package's own kernel"),
    ("12a.rmsnorm", wrong.rmsnorm_mean_over_the_block, "values differ"),
    ("12a.rmsnorm", wrong.rmsnorm_unmasked_load, "outside x"),
    ("12a.rmsnorm", wrong.rmsnorm_rows_assumed_contiguous, "gap between two rows of x"),
    ("12a.online_softmax", lambda s, v, block_n: torch.softmax(s, -1) @ v, "not a Python function"),  # no tiles
    ("12a.online_softmax", wrong.softmax_whole_row_at_once, "at a time"),
    ("12a.online_softmax", wrong.softmax_without_rescale, "values differ"),
    ("12a.online_softmax", wrong.softmax_in_two_passes, "more than once"),
    ("12a.online_softmax", wrong.softmax_far_out_of_bounds, "stopped before the access"),
    ("12a.online_softmax", NB12A["12a.silu_and_mul"], "the check launches the kernel as"),  # another exercise's kernel
]


@pytest.mark.parametrize(("check_name", "kernel", "says"), WRONG, ids=[f"{c}-{s}" for c, _, s in WRONG])
def test_a_wrong_kernel_fails_and_says_why(check_name, kernel, says):
    outcome = result(check_name, kernel)
    assert outcome.status == "fail" and says in outcome.message, outcome.line()


def test_the_guard_bands_alone_catch_an_overrun(monkeypatch):
    """On a GPU there is no watch: the poisoned bands must catch the `cols < 2*inter` mask by themselves."""
    monkeypatch.setattr(kernel_launch, "interpreted", lambda: False)
    outcome = result("12a.silu_and_mul", wrong.silu_mask_past_the_row)
    assert outcome.status == "fail" and "outside out" in outcome.message, outcome.line()
    outcome = result("12a.rmsnorm", wrong.rmsnorm_unmasked_load)
    assert outcome.status == "fail" and "NaN" in outcome.message, outcome.line()


def _stub_kernels(tmp_path) -> dict:
    """The notebook's own stub kernels, imported from a file (the check reads their source for TODO)."""
    cells = [c.source for c in jupytext.read(NOTEBOOKS / "12a_triton_kernels.py").cells if c.cell_type == "code"]
    header = "import stagewise.kernels  # noqa\nimport triton\nimport triton.language as tl\n\n"
    path = tmp_path / "stubs_12a.py"
    path.write_text(header + "\n\n".join(c for c in cells if c.startswith("@triton.jit")))
    spec = importlib.util.spec_from_file_location("stubs_12a", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["stubs_12a"] = module
    spec.loader.exec_module(module)
    return {
        "12a.silu_and_mul": module.my_silu_and_mul_kernel,
        "12a.rmsnorm": module.my_rmsnorm_kernel,
        "12a.online_softmax": module.my_online_softmax_kernel,
    }


def test_the_notebooks_stub_kernels_read_not_yet(tmp_path):
    for check_name, stub in _stub_kernels(tmp_path).items():
        outcome = result(check_name, stub)
        assert outcome.status == "not yet" and "TODO" in outcome.message, outcome.line()


def test_the_overrunning_mask_prints_fail_and_the_next_cell_runs(tmp_path):
    """In a live kernel, as a student meets it: the check cell prints FAIL, the cell after it runs; and a
    passing answer, function or kernel, is kept in my_parts.py with the helper it calls, for notebook 16."""
    nb = nbformat.v4.new_notebook()
    wrong_source = (NOTEBOOKS.parent / "tests" / "exercises" / "wrong_kernels.py").read_text()
    solved = (NOTEBOOKS / "solutions" / "nb12a.py").read_text().split("SOLUTIONS = {")[0]
    allocate = (NOTEBOOKS / "solutions" / "nb09.py").read_text().split("def my_free")[0]  # blocks_needed too
    nb.cells = [
        nbformat.v4.new_code_cell(wrong_source),
        nbformat.v4.new_code_cell("from stagewise.exercises import check"),
        nbformat.v4.new_code_cell('check("12a.silu_and_mul", silu_mask_past_the_row)'),
        nbformat.v4.new_code_cell('print("the next cell ran")'),
        nbformat.v4.new_code_cell(solved),
        nbformat.v4.new_code_cell('check("12a.rmsnorm", rmsnorm_kernel, save=True)'),
        nbformat.v4.new_code_cell(allocate),
        nbformat.v4.new_code_cell('check("09.allocate", my_allocate, save=True)'),
    ]
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    printed = ["".join(o.get("text", "") for o in c.get("outputs", [])) for c in nb.cells]
    assert printed[2].startswith("[FAIL] 12a.silu_and_mul"), printed[2]
    assert "the next cell ran" in printed[3]
    assert "kept in my_parts.py" in printed[5] and "kept in my_parts.py" in printed[7], printed
    kept, broken = my_parts.load(tmp_path)
    assert sorted(kept) == ["09.allocate", "12a.rmsnorm"] and not broken
    for name, answer in kept.items():
        assert result(name, answer).passed, name
