"""The notebooks' exercises: one `check` per task, against the package's own reference.

Each notebook ends with a few tasks: a stub the student fills in
(`def my_rmsnorm(x, weight, eps): raise NotImplementedError`) and a check cell

    from stagewise.exercises import check
    check("02.rmsnorm", my_rmsnorm)

that runs the student's function and the reference (the stage's naive path,
the calculator, the engine) on the same seeded inputs and prints one line:
PASS, FAIL with the worst mismatch, "not yet" while the stub is a stub, or
ERROR with the exception. It never raises, so an unsolved exercise never stops
the notebook. `notebooks/solutions/` holds solved versions, and
`tests/exercises/test_notebook_exercises.py` runs every check on them (and on wrong
answers, which must fail).
"""

from stagewise.exercises import (
    block_checks,
    capstone_checks,
    engine_checks,
    invariance_checks,
    kernel_checks,
    my_parts,
    quant_checks,
    radix_checks,
    schedule_checks,
    spec_checks,
    stage_checks,
    systems_checks,
)
from stagewise.exercises.core import CheckResult, run_check

CHECKS = {
    **stage_checks.CHECKS,
    **engine_checks.CHECKS,
    **systems_checks.CHECKS,
    **block_checks.CHECKS,
    **radix_checks.CHECKS,
    **schedule_checks.CHECKS,
    **kernel_checks.CHECKS,
    **quant_checks.CHECKS,
    **spec_checks.CHECKS,
    **capstone_checks.CHECKS,
    **invariance_checks.CHECKS,
}  # "NN.name" -> check function


def result(name: str, student_fn) -> CheckResult:
    """Run the check `name` on `student_fn`; never raises (an unknown name is an error result)."""
    if name not in CHECKS:
        return CheckResult(name, "error", f"no such check; known: {', '.join(sorted(CHECKS))}")
    return run_check(name, CHECKS[name], student_fn)


def check(name: str, student_fn, save: bool = False) -> None:
    """Run the check `name` on `student_fn` and print its one-line verdict (`result` returns it instead).

    save=True: when it passes, keep the answer in my_parts.py beside the notebook, for the
    capstone (notebook 16; stagewise/exercises/my_parts.py). It returns None, so a notebook cell
    ending in `check(...)` shows the verdict and nothing else.
    """
    verdict = result(name, student_fn)
    print(verdict.line())
    if save and verdict.passed:
        try:
            where = my_parts.save(name, student_fn)
        except (OSError, TypeError) as err:  # a source Python cannot read back: say so, never stop the notebook
            print(f"  not kept for the capstone: {type(err).__name__}: {err}")
        else:
            print(f"  kept in {where.name} for the capstone (notebook 16)")


__all__ = ["CHECKS", "CheckResult", "check", "result"]
