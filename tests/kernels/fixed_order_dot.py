"""A fixed-order `tl.dot` for the CPU interpreter: what the batch-invariance tests run under.

Triton's interpreter computes `tl.dot(a, b, acc)` as `np.matmul(a, b) + acc`, and numpy hands the
product to its BLAS, whose kernels block the rows of `a`: one row of a [16, K] tile gives up to
three results depending on its position in the block and on how many rows the block has. That is
the interpreter's property, not the kernels' (on a GPU each output element of a tensor-core dot is
one chain of instructions whatever the row), so the invariance tests install this dot: every
output element sums its K products in the order k = 0, 1, ..., K - 1 in the accumulator's dtype,
then adds the accumulator, as the interpreter's own dot does. A row's bits then depend on its own
operands only, and a difference a test finds is the kernel's (a config, a split, a sum order).

Used as a fixture: `from tests.kernels.fixed_order_dot import fixed_order_dot` in a test module,
then `@pytest.mark.usefixtures("fixed_order_dot")`.
"""

import numpy as np
import pytest
import torch


def fixed_order_matmul(a: np.ndarray, b: np.ndarray, dtype) -> np.ndarray:
    """a [..., M, K] @ b [..., K, N] in `dtype`, each element summed over k in order."""
    a, b = a.astype(dtype), b.astype(dtype)
    products = a[..., :, :, None] * b[..., None, :, :]  # [..., M, K, N]
    # accumulate is a running sum, s_k = s_(k-1) + p_k: the order k = 0, 1, ... by definition
    return np.add.accumulate(products, axis=-2)[..., -1, :]  # [..., M, N]


def _dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    from triton.runtime.interpreter import TensorHandle

    if a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating():
        raise NotImplementedError("fixed_order_dot: fp8 operands are not used by these kernels")
    out = fixed_order_matmul(a.data, b.data, d.data.dtype) + d.data
    return TensorHandle(out, d.dtype.scalar)


@pytest.fixture
def fixed_order_dot(monkeypatch):
    """The interpreter's `tl.dot` summed in a fixed order for the test (nothing to do on a GPU)."""
    if torch.cuda.is_available():
        yield
        return
    from triton.runtime.interpreter import InterpreterBuilder

    monkeypatch.setattr(InterpreterBuilder, "create_dot", _dot)
    yield
