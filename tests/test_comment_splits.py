"""No statement is split over three lines only because a trailing comment did not fit beside it.

`scripts/check_comment_splits.py` finds such splits (see its docstring); here it runs over the
package, the tests and the scripts, and first on made-up files, to show what it finds and what it
leaves alone.
"""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("check_comment_splits", ROOT / "scripts/check_comment_splits.py")
checker = importlib.util.module_from_spec(spec)
spec.loader.exec_module(checker)

SPLIT = """def f(special_tokens):
    self.special_tokens = (
        special_tokens  # True: prompts may hold control tokens (trusted input only), a long comment
    )
    return x
"""
BY_HAND = """TOL = {  # (atol, rtol) per dtype
    "float32": (1e-5, 1e-5),
    "bfloat16": (1e-2, 2**-7),
}
TOO_LONG = some_function_with_a_long_name(
    first_argument_value, second_argument_value, third_argument_value_that_is_long  # why
)
"""


@pytest.fixture
def write(tmp_path):
    def write(text: str) -> Path:
        (tmp_path / "ruff.toml").write_text("line-length = 100\n")
        path = tmp_path / "module.py"
        path.write_text(text)
        return path

    return write


def test_a_formatter_split_is_found_and_fixed(write):
    path = write(SPLIT)
    found = checker.find([path])
    assert [(s.first, s.last) for s in found] == [(2, 4)]
    checker.fix(found)
    assert path.read_text() == (
        "def f(special_tokens):\n"
        "    # True: prompts may hold control tokens (trusted input only), a long comment\n"
        "    self.special_tokens = special_tokens\n"
        "    return x\n"
    )
    assert checker.find([path]) == []


def test_hand_placed_comments_and_long_statements_are_left_alone(write):
    assert checker.find([write(BY_HAND)]) == []


def test_the_code_has_no_such_split():
    found = checker.find([ROOT / "stagewise", ROOT / "tests", ROOT / "scripts"])
    assert not found, "statements split only by a trailing comment (scripts/check_comment_splits.py --fix):\n" + (
        "\n".join(map(str, found))
    )
