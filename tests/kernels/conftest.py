"""Kernel tests compare fp32 results at ~1e-5: they assume IEEE fp32 dots.

The interpreter always computes full fp32; on a GPU `dot_policy` follows
torch.backends.cuda.matmul.allow_tf32, so every kernel test runs with it off
(PyTorch's default) unless the test turns it on itself (test_precision.py).
"""

import contextlib

import pytest
import torch


@contextlib.contextmanager
def tf32(allowed: bool):
    """torch.backends.cuda.matmul.allow_tf32 set for a block (monkeypatch cannot restore this attribute)."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = allowed
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


@pytest.fixture(autouse=True)
def ieee_fp32_dots():
    with tf32(False):
        yield
