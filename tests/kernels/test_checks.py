"""Launcher checks shared by every kernel: tensors must live where Triton runs in this process."""

import pytest
import torch

from stagewise.kernels import INTERPRETER
from stagewise.kernels.checks import KernelInputError
from stagewise.kernels.rmsnorm import rmsnorm


def test_tensors_on_the_wrong_device_get_a_one_line_error():
    # Interpreter: a CUDA-less process, so the wrong device is "meta". GPU: CPU tensors (Triton would
    # otherwise fail deep inside with "Pointer argument cannot be accessed from Triton").
    wrong = "meta" if INTERPRETER else "cpu"
    x, w = torch.zeros(4, 8, device=wrong), torch.ones(8, device=wrong)
    with pytest.raises(KernelInputError, match=r"^rmsnorm: tensors ") as err:
        rmsnorm(x, w, 1e-5)
    assert "\n" not in str(err.value)


def test_mixed_devices_are_named():
    home = "cpu" if INTERPRETER else "cuda"
    with pytest.raises(KernelInputError, match="different devices"):
        rmsnorm(torch.zeros(4, 8, device=home), torch.ones(8, device="meta"), 1e-5)
