"""The package's layers run one way (README.md, "Layout"), and no import runs in a circle.

Every module's imports are read with `ast` — at the top of the file and inside
functions alike (a lazy import is still a dependency) — and checked against the
documented order, bottom to top:

    ground (config, errors, runtime, sampling_params, files) <- kernels <- quant <- tuning <- cpu <- stages
    <- tokenizer <- kv <- trace <- models <- parallel <- engine <- serve <- calc <- bench <- viz
    (the notebooks' figures) <- devtools <- exercises <- cli

A module may import its own layer and the layers below it. Nothing imports the
package root `stagewise` (its lazy `__getattr__` would hide an upward import of
`LLM`), and within a layer the module graph has no cycle.
"""

import ast
import importlib.util
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "stagewise"
GROUND = ("config", "errors", "runtime", "sampling_params", "files")
ORDER = (
    "ground",
    "kernels",
    "quant",
    "tuning",
    "cpu",
    "stages",
    "tokenizer",
    "kv",
    "trace",
    "models",
    "parallel",
    "engine",
    "serve",
    "calc",
    "bench",
    "viz",
    "devtools",
    "exercises",
    "cli",
)


def module_names() -> dict[str, Path]:
    """'stagewise.stages.rope' -> its file, for every module of the package."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def layer_of(module: str) -> str:
    """'stagewise.stages.rope' -> 'stages'; the ground's single files -> 'ground'; the root -> 'root'."""
    parts = module.split(".")
    if len(parts) == 1:
        return "root"
    if parts[1] == "__main__":
        return "cli"  # `python -m stagewise`: an entry point, as the CLI's
    return "ground" if parts[1] in GROUND else parts[1]


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The stagewise modules `module` imports (the longest name that is a module of the package)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = importlib.util.resolve_name(
                    "." * node.level + (node.module or ""), module if is_package else module.rpartition(".")[0]
                )
            else:
                base = node.module or ""
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            if target != "stagewise" and not target.startswith("stagewise."):
                continue
            while target not in modules:  # `stagewise.stages.rope.naive` -> `stagewise.stages.rope`
                target = target.rpartition(".")[0]
            if target != module:
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    modules = module_names()
    return {m: imports_of(m, p, modules) for m, p in modules.items()}


def test_every_module_is_in_a_known_layer():
    unknown = sorted(m for m in module_names() if layer_of(m) not in (*ORDER, "root"))
    assert not unknown, f"modules outside the documented layers (add the package to ORDER and the README): {unknown}"


def test_no_import_goes_up_the_layers():
    rank = {name: i for i, name in enumerate(ORDER)}
    upward = []
    for module, targets in graph().items():
        if layer_of(module) == "root":
            continue
        for target in sorted(targets):
            if layer_of(target) == "root":
                upward.append(f"{module} imports the package root (its lazy loader): import the module itself")
            elif rank.get(layer_of(target), -1) > rank.get(layer_of(module), len(ORDER)):
                upward.append(f"{module} [{layer_of(module)}] imports {target} [{layer_of(target)}]")
    assert not upward, "imports against the layer order:\n  " + "\n  ".join(upward)


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycle():
    cycles = find_cycles(graph())
    assert not cycles, "import cycles:\n  " + "\n  ".join(" <-> ".join(c) for c in cycles)


def test_the_checker_sees_a_cycle_and_an_upward_import():
    """The checks above can fail: a made-up graph with a circle and an upward edge is caught."""
    edges = {"stagewise.kernels.a": {"stagewise.kernels.b"}, "stagewise.kernels.b": {"stagewise.kernels.a"}}
    assert find_cycles(edges) == [["stagewise.kernels.a", "stagewise.kernels.b"]]
    assert find_cycles({"stagewise.kernels.a": {"stagewise.kernels.b"}, "stagewise.kernels.b": set()}) == []
    assert layer_of("stagewise.engine.llm") == "engine" and layer_of("stagewise.config") == "ground"
    assert layer_of("stagewise.viz") == layer_of("stagewise.viz.engine") == "viz"
    assert layer_of("stagewise.devtools.gpu.kernel_bench") == "devtools"
    assert ORDER.index(layer_of("stagewise.engine.llm")) > ORDER.index(layer_of("stagewise.stages.rope"))


# what the stages share, beside the stage modules and their torch tiers (the "nothing else")
STAGES_SHARED = {
    "__init__",  # the registry
    "base",  # the Stage record
    "attention_metadata",  # the per-step metadata object the attention stages read
    "chunked_attention",  # every query row over fixed-size key chunks (the attention tiers)
    "chunked_decode",  # decode rows over fixed-size key chunks (the attention tiers)
    "pre_tokenizers",  # the tokenize stage's pre-tokenizer regexes
    "tokenize_sentencepiece",  # the tokenize stage for SentencePiece vocabularies
    "dequant_gemm",  # the dequantize-GEMM the projections send a packed weight to
    "dequant_gemm_torch",  # its torch tier
}


def test_the_stages_folder_holds_stages_their_torch_tiers_and_what_they_share():
    """Codecs live in quant/, measured choices in tuning/: `ls stagewise/stages` shows stages only."""
    from stagewise.stages import STAGES

    stages = {s.naive.__module__.rpartition(".")[2] for s in STAGES.values()}
    torch_tiers = {s.torch.__module__.rpartition(".")[2] for s in STAGES.values() if s.torch is not None}
    assert all(name.endswith("_torch") for name in torch_tiers), torch_tiers
    found = {p.stem for p in (PACKAGE / "stages").glob("*.py")}
    others = sorted(found - stages - torch_tiers - STAGES_SHARED)
    assert not others, f"stagewise/stages holds modules that are neither a stage, a torch tier nor shared: {others}"
    assert {"quant", "tuning"} <= {p.name for p in PACKAGE.iterdir() if p.is_dir()}
