"""Where Triton kernels run: a CUDA GPU, or Triton's CPU interpreter.

`TRITON_INTERPRET=1` must be in the environment before any `@triton.jit`
function is defined (Triton reads it at decoration time), so
`configure_triton()` runs when `stagewise.kernels` is first imported: with no
CUDA device it switches the interpreter on and says so once on stderr.
Triton ships wheels for Linux only; elsewhere asking for the triton backend
explains why it is unavailable instead of failing on an import.

Also here, because kernels, stages and the engine all need them: the switch
for launchers' value checks (`debug_checks`, a host read each, so off by
default) and `to_device`, the host -> device copy that does not make the host
wait; and `load_phase`, which names each slow step of loading a model (reading a file's
metadata, dequantizing, calibrating) for whoever shows progress (the CLI's status line).

A third mode, "compile", is for the compile gate (`stagewise.devtools.compile_gate`):
`STAGEWISE_TRITON=compile` keeps the kernels real `@triton.jit` functions on a
machine without a GPU, so Triton can compile them ahead of time for a GPU
target; nothing can be launched in that process. The gate runs it in a child
process, because the interpreter switch cannot be undone once Triton is imported.
"""

import importlib.util
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

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


COMPILE_MODE_ENV = "STAGEWISE_TRITON"  # set to "compile" for ahead-of-time compilation without a GPU


def configure_triton() -> str:
    """Choose GPU or interpreter mode before kernels are defined; returns 'cuda', 'interpreter' or 'compile'."""
    global _announced
    reason = triton_unavailable_reason()
    if reason is not None:
        raise StagewiseError(reason)
    if os.environ.get(COMPILE_MODE_ENV) == "compile":
        if os.environ.get("TRITON_INTERPRET") == "1":
            raise RuntimeError(
                f"{COMPILE_MODE_ENV}=compile needs TRITON_INTERPRET unset: interpreted kernels cannot compile"
            )
        return "compile"
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


DEBUG_CHECKS_ENV = "STAGEWISE_DEBUG_CHECKS"


def debug_checks() -> bool:
    """True when launchers should also check *values* (index ranges, cu_seqlens order): env STAGEWISE_DEBUG_CHECKS=1.

    Checks of shapes, dtypes and strides read only a tensor's metadata and always run. Checking
    values (are all ids < vocab? is cu_seqlens monotonic?) means reading the tensors on the host:
    on a GPU that waits for every queued kernel (a host sync), which makes a step host-bound and
    cannot be captured in a CUDA graph. So value checks are off by default and on in the tests.
    Read at each call, so a test can switch it with monkeypatch.
    """
    return os.environ.get(DEBUG_CHECKS_ENV, "0") == "1"


def to_device(values: list, dtype: torch.dtype, device) -> torch.Tensor:
    """A list of host numbers as a tensor on `device`, copied without making the host wait.

    `torch.tensor(values, device="cuda")` copies from pageable memory and then synchronizes the
    stream: the host waits for every kernel already queued. From pinned (page-locked) memory with
    `non_blocking=True` the copy is queued like a kernel instead, and the host runs on.
    """
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


# Listeners of load phases: fn(text, None) when a phase starts, fn(text, seconds) when it ends.
_phase_listeners: list[Callable[[str, float | None], None]] = []


@contextmanager
def load_phase(text: str) -> Iterator[None]:
    """One slow step of loading a model, e.g. "reading the GGUF metadata", told to the listeners.

    The layers that do the work (models, stages, engine) only say what they are doing; a front end
    (`listen_to_load_phases`) decides how to show it. With no listener this costs nothing.
    """
    for listener in list(_phase_listeners):
        listener(text, None)
    start = time.perf_counter()
    yield  # a phase that raises is not reported as done
    for listener in list(_phase_listeners):
        listener(text, time.perf_counter() - start)


@contextmanager
def listen_to_load_phases(listener: Callable[[str, float | None], None]) -> Iterator[None]:
    """Call `listener` for every `load_phase` inside the block."""
    _phase_listeners.append(listener)
    try:
        yield
    finally:
        _phase_listeners.remove(listener)
