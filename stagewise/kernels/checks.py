"""Launcher-side checks: every kernel states the layout it assumes and rejects anything else.

A Triton kernel trusts its pointers and strides; a wrong layout gives a silent
wrong answer or an out-of-bounds read, not an error. So each public launcher
checks its inputs first and raises `KernelInputError` with one clear line.
"""

import torch

from stagewise.errors import StagewiseError

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the activations a kernel takes


class KernelInputError(StagewiseError):
    """A tensor passed to a kernel launcher has the wrong shape, dtype, device or layout."""


def check_dtype(kernel: str, name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise KernelInputError(
            f"{kernel}: {name} has dtype {str(t.dtype).removeprefix('torch.')}, expected {names}"
        )


def check_dim(kernel: str, name: str, t: torch.Tensor, ndim: int) -> None:
    if t.dim() != ndim:
        raise KernelInputError(f"{kernel}: {name} must be {ndim}-D, got shape {list(t.shape)}")


def check_shape(kernel: str, name: str, t: torch.Tensor, shape: tuple) -> None:
    """`shape` may hold None for a free dimension. (A plain loop: launchers call this on every
    launch, and a generator inside all() costs more than the comparisons.)"""
    actual = t.shape
    if len(actual) == len(shape):
        for s, n in zip(shape, actual):
            if s is not None and s != n:
                break
        else:
            return
    want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
    raise KernelInputError(f"{kernel}: {name} has shape {list(t.shape)}, expected {want}")


def check_contiguous(kernel: str, name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise KernelInputError(
            f"{kernel}: {name} must be contiguous (got strides {list(t.stride())}); "
            "call .contiguous()"
        )


def check_last_dim_contiguous(kernel: str, name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise KernelInputError(
            f"{kernel}: {name} must have a contiguous last dimension (strides {list(t.stride())})"
        )


def check_same_device(kernel: str, **tensors: torch.Tensor) -> None:
    """All tensors on one device, of the type this process runs Triton on (cuda, or cpu for the
    interpreter). Runs on every launch: the common case is a few attribute reads, no dict."""
    first, *others = tensors.values()
    device = first.device
    if device.type == _launch_device_type():
        for t in others:
            if t.device != device:
                break
        else:
            return
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise KernelInputError(f"{kernel}: tensors are on different devices: {devices}")
    device = next(iter(devices.values()))
    if device.type not in ("cpu", "cuda"):
        raise KernelInputError(
            f"{kernel}: tensors must be on cpu (interpreter) or cuda, got {devices}"
        )
    from stagewise.kernels import INTERPRETER  # the package sets it before any kernel module loads

    if device.type != ("cpu" if INTERPRETER else "cuda"):
        where = "the CPU interpreter" if INTERPRETER else "the GPU"
        raise KernelInputError(
            f"{kernel}: tensors are on {device.type}, but Triton runs on {where} in this process"
        )


def _launch_device_type() -> str:
    """ "cpu" under the interpreter, else "cuda": read from stagewise.kernels once, then kept."""
    global _LAUNCH_DEVICE_TYPE
    if _LAUNCH_DEVICE_TYPE is None:
        from stagewise.kernels import INTERPRETER

        _LAUNCH_DEVICE_TYPE = "cpu" if INTERPRETER else "cuda"
    return _LAUNCH_DEVICE_TYPE


_LAUNCH_DEVICE_TYPE = None


def check_head_dim(kernel: str, head_dim: int) -> None:
    if head_dim not in (16, 32, 64, 128, 256):
        raise KernelInputError(
            f"{kernel}: head_dim {head_dim} is not supported; use 16, 32, 64, 128 or 256"
        )
