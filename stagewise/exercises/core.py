"""Running one exercise check: the student's function against the package's reference.

A check is a function `check_fn(student_fn) -> str` that builds seeded inputs,
calls the student's function and the package's own reference (a stage's naive
path, the calculator, the engine), and raises `Mismatch` with a readable
message when they differ; on success it returns a one-line summary of what it
compared. `run_check` turns every outcome into a `CheckResult`, so a notebook
cell never crashes on an unsolved or wrong exercise:

    pass      the function agrees with the reference on every case
    not yet   the stub is still a stub (it raises NotImplementedError or returns None / ...)
    fail      it returned something, and that something is wrong (the message says where)
    error     it raised another exception (the message names it)
"""

from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode


class Mismatch(AssertionError):
    """The student's answer differs from the reference."""


class NotYet(Exception):
    """The student's function is still a stub."""


@dataclass(frozen=True)
class CheckResult:
    name: str  # the check's name, e.g. "05.causal_attention"
    status: str  # "pass", "not yet", "fail" or "error"
    message: str  # what was compared (pass) or what went wrong

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    def line(self) -> str:
        mark = {"pass": "PASS", "not yet": "not yet", "fail": "FAIL", "error": "ERROR"}[self.status]
        return f"[{mark}] {self.name}: {self.message}"


def answer(value):
    """The student's return value; None or Ellipsis (an untouched `...` stub) means not yet."""
    if value is None or value is Ellipsis:
        raise NotYet("your function returns None: fill in the stub")
    return value


def call(fn, *args, **kwargs):
    """Call the student's function; NotImplementedError means the stub is untouched."""
    try:
        return answer(fn(*args, **kwargs))
    except NotImplementedError as err:
        raise NotYet(str(err) or "the stub still raises NotImplementedError") from None


class _OpRecorder(TorchFunctionMode):
    """Records the name of every torch function and Tensor method called under it."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.add(getattr(func, "__name__", str(func)).rstrip("_"))  # exp_ (in place) counts as exp
        return func(*args, **(kwargs or {}))


def call_recording_ops(fn, *args, **kwargs):
    """(answer, names of the torch ops it used): for checks about how a result is computed, not only what."""
    with _OpRecorder() as recorder:
        got = call(fn, *args, **kwargs)
    return got, recorder.names


class _KernelRecorder(TorchDispatchMode):
    """Records every ATen operator that runs under it, however it was reached (F.silu, nn.SiLU, torch.ops)."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__.rstrip("_"))  # silu_ (in place) counts as silu
        return func(*args, **(kwargs or {}))


def call_recording_kernels(fn, *args, **kwargs):
    """(answer, names of the ATen operators it ran): below torch's Python API, where no alias hides a call."""
    with _KernelRecorder() as recorder:
        got = call(fn, *args, **kwargs)
    return got, recorder.names


def close(got, want: torch.Tensor, what: str, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    """Raise Mismatch unless `got` is a tensor of want's shape with values within tolerance."""
    if not isinstance(got, torch.Tensor):
        raise Mismatch(f"{what}: expected a tensor, got {type(got).__name__}")
    if tuple(got.shape) != tuple(want.shape):
        raise Mismatch(f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    diff = (got.double() - want.double()).abs()
    bound = atol + rtol * want.double().abs()
    if torch.isnan(got).any() and not torch.isnan(want).any():
        raise Mismatch(f"{what}: NaN in your output")
    bad = diff > bound
    if bad.any():
        worst = int(diff.flatten().argmax())
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), diff.shape))
        raise Mismatch(
            f"{what}: {int(bad.sum())} of {want.numel()} values differ; worst at {list(index)}: "
            f"yours {got.flatten()[worst].item():.6g}, reference {want.flatten()[worst].item():.6g}"
        )


def equal(got, want, what: str) -> None:
    """Raise Mismatch unless got == want (ints, lists, tuples; tensors compared exactly)."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor) or got.shape != want.shape or not torch.equal(got.to(want.dtype), want):
            raise Mismatch(f"{what}: yours {_short(got)}, reference {_short(want)}")
        return
    if isinstance(got, torch.Tensor):
        got = got.tolist()
    if isinstance(want, tuple) and isinstance(got, list):
        got = tuple(got)
    if got != want:
        raise Mismatch(f"{what}: yours {_short(got)}, reference {_short(want)}")


def near(got, want: float, what: str, rel: float = 1e-9) -> None:
    """Raise Mismatch unless the number `got` is within `rel` (relative) of `want`."""
    if isinstance(got, torch.Tensor) and got.numel() == 1:
        got = got.item()
    if not isinstance(got, (int, float)):
        raise Mismatch(f"{what}: expected a number, got {type(got).__name__}")
    if abs(got - want) > rel * max(abs(want), 1e-30):
        raise Mismatch(f"{what}: yours {got:.6g}, reference {want:.6g}")


def _short(value) -> str:
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def run_check(name: str, check_fn, student_fn) -> CheckResult:
    """Run one check; every outcome becomes a CheckResult (nothing propagates)."""
    try:
        summary = check_fn(student_fn)
    except NotYet as err:
        return CheckResult(name, "not yet", str(err))
    except Mismatch as err:
        return CheckResult(name, "fail", str(err))
    except Exception as err:  # a bug in the student's code: report it, do not stop the notebook
        return CheckResult(name, "error", f"{type(err).__name__}: {err}")
    return CheckResult(name, "pass", summary)
