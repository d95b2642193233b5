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


@pytest.fixture(autouse=True)
def fresh_launch_plans():
    """Launchers keep their plans per shape (kernels/plan_cache.py): a test that changes a tile rule's
    constant (monkeypatch) must not get a plan made before it, nor leave its own to the next test."""
    from stagewise.kernels.plan_cache import clear_plan_caches

    clear_plan_caches()
    yield
    clear_plan_caches()
