"""Where Triton kernels run: a CUDA GPU, or Triton's CPU interpreter.

`TRITON_INTERPRET=1` must be in the environment before any `@triton.jit`
function is defined (Triton reads it at decoration time), so
`configure_triton()` runs when `stagewise.kernels` is first imported: with no
CUDA device it switches the interpreter on and says so once on stderr.
Triton ships wheels for Linux only; elsewhere asking for the triton backend
explains why it is unavailable instead of failing on an import.
"""

import importlib.util
import os
import platform
import sys

import torch

from stagewise.errors import StagewiseError

_announced = False


def triton_unavailable_reason() -> str | None:
    """None when Triton can be imported, else a one-line reason."""
    # find_spec, not import: importing triton before TRITON_INTERPRET is set would build its
    # language helpers (tl.sum, tl.max, ...) for the GPU path, and the interpreter would then fail.
    if importlib.util.find_spec("triton") is None:
        if platform.system() != "Linux":
            return f"Triton has no wheels for {platform.system()}; use backend='naive' here (Linux only)"
        return "Triton is not installed; pip install triton (Linux), or use backend='naive'"
    return None


def configure_triton() -> str:
    """Choose GPU or interpreter mode before kernels are defined; returns 'cuda' or 'interpreter'."""
    global _announced
    reason = triton_unavailable_reason()
    if reason is not None:
        raise StagewiseError(reason)
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "interpreter"
    if torch.cuda.is_available():
        return "cuda"
    if "triton" in sys.modules:
        raise RuntimeError(
            "triton was imported before stagewise.kernels chose the CPU interpreter; "
            "import stagewise.kernels first or set TRITON_INTERPRET=1"
        )
    os.environ["TRITON_INTERPRET"] = "1"
    if not _announced and not os.environ.get("STAGEWISE_QUIET"):
        print(
            "stagewise: no CUDA device, Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)", file=sys.stderr
        )
        _announced = True
    return "interpreter"
