"""Check the notebooks' "In vLLM" sections against a vLLM source tree.

Every notebook ends with a section that names the file and the function doing
the same job in a pinned vLLM release. Names drift between releases, so this
script reads those sections and checks, against the release's own sources:

  - every `vllm/....py` path named exists;
  - every `Name` in backticks that vLLM defines (`def Name` / `class Name` /
    `Name =` somewhere in the tree) and stagewise does not appears in one of
    the files the section names (a path may be written from a folder down,
    `rotary_embedding/__init__.py`, when the full one was named just before).

Other names are skipped: stagewise's own (`split_qkv`), and arguments like
`max_num_seqs`. The tree comes from the release's wheel, which holds the Python sources:

    pip download vllm==0.11.0 --no-deps --only-binary :all: -d /tmp/vllm
    unzip -q /tmp/vllm/vllm-0.11.0-*.whl 'vllm/*' -x '*.so' -d /tmp/vllm/src
    python scripts/check_vllm_names.py /tmp/vllm/src

Exit status 1 when anything is missing, with one line per finding.
"""

import re
import sys
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
PATH = re.compile(r"vllm/[A-Za-z0-9_/]*\.py")
SHORT_PATH = re.compile(r"`([A-Za-z0-9_]+/[A-Za-z0-9_/]*\.py)`")  # a path from a folder down
PACKAGE = Path(__file__).resolve().parents[1] / "stagewise"
NAME = re.compile(r"`([A-Za-z_][A-Za-z0-9_.]*)(?:\(\))?`")


def sections(text: str) -> list[str]:
    """The markdown of each "## In vLLM" section, up to the next heading or code cell."""
    out = []
    for start in (m.start() for m in re.finditer(r"^# ## In vLLM", text, re.M)):
        rest = text[start + 1 :]
        end = re.search(r"^# ## |^# %%", rest, re.M)
        out.append(rest[: end.start()] if end else rest)
    return out


def defined(sources: dict[str, str]) -> set[str]:
    """Every name vLLM defines at the start of a line: functions, classes, module constants."""
    pattern = re.compile(r"^\s*(?:def|class)\s+([A-Za-z_]\w*)|^([A-Za-z_]\w*)\s*[:=]", re.M)
    names = set()
    for text in sources.values():
        for m in pattern.finditer(text):
            names.add(m.group(1) or m.group(2))
    return names


def main(tree: Path) -> int:
    sources = {str(p.relative_to(tree)): p.read_text(errors="ignore") for p in tree.rglob("vllm/**/*.py")}
    if not sources:
        print(f"check_vllm_names: no vllm/**/*.py under {tree}")
        return 2
    ours = defined({str(p): p.read_text() for p in PACKAGE.rglob("*.py")})
    vllm_names = defined(sources) - ours
    findings, checked = [], 0
    for nb in sorted(NOTEBOOKS.glob("*.py")):
        for section in sections(nb.read_text()):
            files = PATH.findall(section)
            for f in files:
                checked += 1
                if f not in sources:
                    findings.append(f"{nb.name}: {f} is not in the tree")
            for short in SHORT_PATH.findall(section):
                if short.startswith("vllm/"):
                    continue
                matches = [f for f in sources if f.endswith("/" + short)]
                if not matches and (PACKAGE / short).exists():
                    continue  # stagewise's own file
                checked += 1
                if not matches:
                    findings.append(f"{nb.name}: no file in the tree ends with {short}")
                files += matches[:1]
            named = "\n".join(sources.get(f, "") for f in files)
            for name in set(NAME.findall(section)):
                base = name.split(".")[-1]
                if base not in vllm_names:
                    continue  # not a vLLM name (stagewise's own, or an argument)
                checked += 1
                if not re.search(rf"\b{re.escape(base)}\b", named):
                    findings.append(f"{nb.name}: `{name}` is in none of the files its section names")
    for line in findings:
        print(line)
    print(f"check_vllm_names: {checked} references checked, {len(findings)} findings")
    return 1 if findings else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__)
        sys.exit(2)
    sys.exit(main(Path(sys.argv[1])))
