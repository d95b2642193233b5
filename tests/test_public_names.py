"""Every import a user reads — in the README, the benchmark report and the docstrings — works as shown."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
IMPORT = re.compile(r"^\s*(from stagewise[\w.]* import [\w, ]+|import stagewise[\w.]*)\s*$", re.MULTILINE)


def docstrings(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            text = ast.get_docstring(node)
            if text:
                yield text


def shown_imports() -> list[tuple[str, str]]:
    found = set()
    for doc in (ROOT / "README.md", ROOT / "benchmarks" / "README.md"):
        if doc.exists():
            found |= {(doc.name, m) for m in IMPORT.findall(doc.read_text())}
    for path in sorted((ROOT / "stagewise").rglob("*.py")):
        for text in docstrings(path):
            found |= {(str(path.relative_to(ROOT)), m.strip()) for m in IMPORT.findall(text)}
    return sorted(found)


SHOWN = shown_imports()


def test_the_documented_entry_points_are_among_them():
    statements = {s for _, s in SHOWN}
    assert "from stagewise import LLM, SamplingParams" in statements
    assert "from stagewise.trace import Tracer" in statements


@pytest.mark.parametrize(("where", "statement"), SHOWN, ids=[f"{w}: {s}" for w, s in SHOWN])
def test_shown_import_works(where, statement):
    exec(compile(statement, where, "exec"), {})
