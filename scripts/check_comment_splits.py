"""Find statements a formatter split over three or more lines only because of a trailing comment.

`ruff format` keeps a statement on one line while it fits the line length *with* its trailing
comment. When the comment pushes it over, the formatter cannot move the comment, so it splits the
statement instead:

    self.special_tokens = (
        special_tokens  # True: prompts may hold control tokens (trusted input only)
    )

The statement itself fits in one line; the comment belongs above it:

    # True: prompts may hold control tokens (trusted input only)
    self.special_tokens = special_tokens

The formatter leaves the comment where it can: at the end of the statement's last line, or
alone with the whole expression inside the brackets of a three-line statement. A comment at an
opening bracket, or beside one element of a longer statement, was put there by hand and is left
alone. So a finding is a statement (or a compound statement's header) that spans three or more
lines, holds exactly one comment (not a pragma such as `# noqa` or `# fmt: skip`) in one of the
formatter's places and no multi-line string, and that `ruff format` puts on a single line once
the comment is gone (magic trailing commas ignored: the formatter added them when it split).
The line length is the one ruff uses for the file: the nearest `ruff.toml` with a `line-length`,
else pyproject.toml's.

    python scripts/check_comment_splits.py [PATH ...]        list findings (exit 1 if any)
    python scripts/check_comment_splits.py --fix [PATH ...]  move each comment above its statement

`--fix` rewrites the files and then runs `ruff format` on them. Default PATH: stagewise tests scripts.
"""

import argparse
import ast
import io
import re
import subprocess
import sys
import tempfile
import tokenize
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRAGMA = re.compile(r"#\s*(noqa|type:|fmt:|pragma|pylint|ruff:|isort:)")
COMPOUND = {"def", "class", "if", "elif", "else", "for", "while", "with", "try", "except", "finally"}
COMPOUND |= {"async", "match", "case"}
SKIP_TOKENS = {tokenize.NL, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT, tokenize.NEWLINE}


@dataclass
class Split:
    path: Path
    first: int  # first line of the statement (1-based)
    last: int  # its last line
    indent: str  # the statement's indentation
    comment: str  # the comment, "# ..."
    code: str  # the statement without the comment, as ruff formats it on one line
    compound: bool  # a compound statement's header (`if ...:`): only the header moves

    def __str__(self) -> str:
        where = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{where}:{self.first}: {self.last - self.first + 1} lines -> {self.code.strip()}"


def line_length(path: Path) -> int:
    """The line length ruff uses for `path`: the nearest ruff.toml that sets one, else pyproject's."""
    for folder in path.resolve().parents:
        for name in ("ruff.toml", "pyproject.toml"):
            config = folder / name
            if config.is_file():
                found = re.search(r"^line-length\s*=\s*(\d+)", config.read_text(), re.M)
                if found:
                    return int(found.group(1))
    return 88  # ruff's own default


def statements(source: str):
    """(tokens of one logical line) for every logical line of `source`."""
    current = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            continue
        if tok.type == tokenize.NL and not [t for t in current if t.type not in SKIP_TOKENS]:
            current = []  # a blank or comment-only line between statements
            continue
        current.append(tok)
        if tok.type == tokenize.NEWLINE:
            yield current
            current = []


def candidates(path: Path):
    """Statements of 3+ lines with exactly one (non-pragma) comment and no multi-line string."""
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines()
    for toks in statements(source):
        code = [t for t in toks if t.type not in SKIP_TOKENS]
        comments = [t for t in toks if t.type == tokenize.COMMENT]
        if not code or len(comments) != 1 or PRAGMA.match(comments[0].string):
            continue
        first, last = code[0].start[0], max(t.end[0] for t in toks if t.type != tokenize.NEWLINE)
        if last - first < 2:
            continue
        if any(t.start[0] != t.end[0] for t in code):
            continue  # a string over several lines: its line breaks are its content
        comment_line = comments[0].start[0]
        if comment_line != last and not (last - first == 2 and comment_line == first + 1):
            continue  # a comment at an opening bracket or on one element: placed there by hand
        compound = code[0].string in COMPOUND
        comment = comments[0]
        pieces = []  # the statement's physical lines without the comment, joined by spaces below
        for number in range(first, last + 1):
            line = lines[number - 1]
            if number == comment.start[0]:
                line = line[: comment.start[1]]
            pieces.append(line.strip().removesuffix("\\").strip())
        text = " ".join(p for p in pieces if p)  # ruff's formatting then settles the spaces
        indent = lines[first - 1][: len(lines[first - 1]) - len(lines[first - 1].lstrip())]
        yield Split(path, first, last, indent, comments[0].string, text, compound)


def snippet(s: Split) -> tuple[str, str, str] | None:
    """(before, the statement, after): the statement alone as a module ruff can parse, or None."""
    head = s.code.split(None, 1)[0]
    before, after = "", ""
    if head.startswith("@"):
        after = "def f():\n    pass\n"  # a decorator needs its function
    elif s.compound and s.code.endswith(":"):
        after = "    pass\n"  # a header needs its body
        if head in ("elif", "else"):
            before = "if x:\n    pass\n"
        elif head in ("except", "finally"):
            before = "try:\n    pass\n"
    try:
        ast.parse(before + s.code + "\n" + after)
    except SyntaxError:
        return None  # e.g. a `case` clause: not checked
    return before, s.code + "\n", after


def formatted_one_line(splits: list[Split]) -> list[Split]:
    """The splits whose statement ruff formats on one line within the file's line length."""
    kept = []
    with tempfile.TemporaryDirectory() as tmp:
        jobs: dict[int, list[tuple[Path, Split, tuple[str, str, str]]]] = {}
        for i, s in enumerate(splits):
            parts = snippet(s)
            if parts is None:
                continue
            width = line_length(s.path) - len(s.indent)
            folder = Path(tmp) / str(width)
            folder.mkdir(exist_ok=True)
            (folder / f"s{i}.py").write_text("".join(parts))
            jobs.setdefault(width, []).append((folder / f"s{i}.py", s, parts))
        for width, items in jobs.items():
            subprocess.run(
                [ruff(), "format", "--no-cache", "--quiet", "--isolated", "--line-length", str(width)]
                + ["--config", "format.skip-magic-trailing-comma = true", str(Path(tmp) / str(width))],
                check=False,
            )
            for file, s, (before, _, after) in items:
                out = file.read_text().splitlines()
                body = out[len(before.splitlines()) : len(out) - len(after.splitlines())]
                if len(body) == 1 and len(body[0]) <= width:
                    s.code = body[0]
                    kept.append(s)
    return kept


def ruff() -> str:
    local = Path(sys.executable).parent / "ruff"
    return str(local) if local.exists() else "ruff"


def find(paths: list[Path]) -> list[Split]:
    files = [p for path in paths for p in ([path] if path.is_file() else sorted(path.rglob("*.py")))]
    return formatted_one_line([s for f in files for s in candidates(f)])


def fix(splits: list[Split]) -> None:
    """Each statement on one line, its comment on the line above; then `ruff format` the files."""
    by_file: dict[Path, list[Split]] = {}
    for s in splits:
        by_file.setdefault(s.path, []).append(s)
    for path, found in by_file.items():
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        for s in sorted(found, key=lambda s: s.first, reverse=True):
            new = [f"{s.indent}{s.comment}\n", f"{s.indent}{s.code}\n"]
            lines[s.first - 1 : s.last] = new
        path.write_text("".join(lines), encoding="utf-8")
    if by_file:
        subprocess.run([ruff(), "format", "--no-cache", "--quiet", *map(str, by_file)], check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path)
    parser.add_argument("--fix", action="store_true", help="move each comment above its statement")
    args = parser.parse_args(argv)
    paths = args.paths or [ROOT / "stagewise", ROOT / "tests", ROOT / "scripts"]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        print(f"check_comment_splits: no such path: {', '.join(missing)}", file=sys.stderr)
        return 2
    splits = find([p.resolve() for p in paths])
    for s in splits:
        print(s)
    if args.fix:
        fix(splits)
        print(f"{len(splits)} statements joined, their comments moved above them")
        return 0
    return 1 if splits else 0


if __name__ == "__main__":
    sys.exit(main())
