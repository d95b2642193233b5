"""The capstone (notebook 16): the student's engine step, on the student's parts, beside LLM()'s engine.

The wrong answers the issue lists, each swapped into the shipped solutions' engine: a scheduler
that ignores the seats, an allocator that refuses exact fits (`>=` for `>`), an engine that stops
making progress. No student work reads "not yet", never PASS. The parts reach notebook 16 through
`my_parts.py`, written by the check cells (`check(..., save=True)`) and read back here.
"""

import pytest

from stagewise.exercises import check, my_parts, result
from stagewise.exercises.capstone import PARTS, Parts
from stagewise.exercises.capstone_checks import STEP, Capstone, assemble, load_solutions
from tests.exercises.test_systems_wrong_answers import WRONG_10, allocate_refusing_exact_fits


def solutions_engine() -> Capstone:
    return assemble(None, folder="/nonexistent", use_solutions=True)  # every part, and the step, the solutions'


def test_the_solutions_engine_matches_llm_step_by_step():
    capstone = solutions_engine()
    assert set(capstone.whose.values()) == {"solution"}
    for name in ("16.engine", "16.shared_prefix"):
        outcome = result(name, capstone)
        assert outcome.passed, outcome.line()


WRONG_PARTS = [
    ("10.schedule_step", WRONG_10["ignores max_num_seqs"], "more than max_num_seqs"),
    ("09.allocate", allocate_refusing_exact_fits, "step 2: tokens computed"),
]


@pytest.mark.parametrize(("name", "wrong", "says"), WRONG_PARTS, ids=[n for n, _, _ in WRONG_PARTS])
def test_a_wrong_part_swapped_in_fails_the_capstone(name, wrong, says):
    capstone = solutions_engine()
    capstone.answers[name], capstone.whose[name] = wrong, "yours"
    outcome = result("16.engine", capstone)
    assert outcome.status == "fail" and says in outcome.message, outcome.line()


def test_an_engine_that_stops_progressing_fails_naming_the_step():
    capstone = solutions_engine()
    solved = capstone.step
    steps = []

    def stalls_after_three(engine, running, waiting):
        steps.append(1)
        return solved(engine, running, waiting) if len(steps) <= 3 else []

    capstone.step = stalls_after_three
    outcome = result("16.engine", capstone)
    assert outcome.status == "fail" and "step 3: your engine stalled" in outcome.message, outcome.line()


def test_no_student_work_is_not_yet_never_pass(tmp_path):
    nothing = assemble(None, folder=tmp_path)
    assert set(nothing.whose.values()) == {"missing"}
    for name in ("16.engine", "16.shared_prefix"):
        assert result(name, nothing).status == "not yet"
    step_only = assemble(load_solutions()["16.engine"], folder=tmp_path)  # a finished step, no parts
    outcome = result("16.engine", step_only)
    assert outcome.status == "not yet" and "09.allocate" in outcome.message, outcome.line()


def test_a_missing_part_is_named():
    answers = load_solutions()
    del answers[PARTS["schedule"]]
    with pytest.raises(KeyError, match="10.schedule_step"):
        Parts(answers)


def test_check_cells_keep_passing_answers_in_my_parts_and_the_capstone_reads_them(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # a notebook's folder
    solved = load_solutions()
    check("09.allocate", lambda *a: False, save=True)  # a failing answer is not kept
    assert not (tmp_path / "my_parts.py").exists()
    for name in ("09.allocate", "12a.rmsnorm", "00.greedy"):
        check(name, solved[name], save=True)
    assert capsys.readouterr().out.count("kept in my_parts.py") == 3
    check("09.allocate", solved["09.allocate"], save=True)  # saved again: replaced, not appended
    assert (tmp_path / "my_parts.py").read_text().count("# ---- 09.allocate\n") == 1
    kept, broken = my_parts.load(tmp_path)
    assert sorted(kept) == ["00.greedy", "09.allocate", "12a.rmsnorm"] and not broken
    assert result("12a.rmsnorm", kept["12a.rmsnorm"]).passed  # a Triton kernel, read back from the file
    capstone = assemble(None)  # this folder's my_parts.py
    assert capstone.whose["09.allocate"] == "yours" and capstone.whose["10.schedule_step"] == "missing"
    assert capstone.whose[STEP] == "missing"


def test_the_committed_capstone_page_says_nothing_is_yours_and_never_pass():
    """Rendered without a my_parts.py (as for anyone who has not done the exercises): no PASS on the page."""
    import nbformat

    from tests.exercises.test_notebook_exercises import NOTEBOOKS

    nb = nbformat.read(NOTEBOOKS / "16_capstone.ipynb", as_version=4)
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "nothing is yours yet" in text and "[not yet] 16.engine" in text
    assert "[PASS]" not in text and "solution" not in text.replace("shipped solutions", "")
