"""RMSNorm row kernel, with the residual add fused in.

    x [T, hidden] (+ residual [T, hidden]), weight [hidden]
        -> out [T, hidden], residual_out [T, hidden]

    s = x + residual                      (if residual is given; s = x otherwise)
    out = weight * (s / sqrt(mean(s^2) + eps)).to(x.dtype)

One program per row (token) loads the whole row (BLOCK = next power of 2 >=
hidden, masked), adds the residual row, writes that sum out as the new
residual stream, sums the squares in float32, takes `tl.rsqrt`, and stores
the normalised row times the weight: the row never leaves registers.

Memory-bound: ~4 FLOPs per element against 2 * bytes of traffic, so the win
is fewer bytes. Add then norm reads x and residual, writes s, reads s, writes
out (5 row passes, 2 launches); fused, 4 row passes and 1 launch. The weight
row is shared by every row and stays in cache.

Rounding matches Hugging Face / the naive stage: `s` is rounded to the input
dtype (it *is* the residual stream), the normalised row is cast to the input
dtype *before* the multiplication by the weight, and that product is rounded
to the output dtype (the promotion of weight and x dtypes).
"""

import torch
import triton
import triton.language as tl

from stagewise.kernels.checks import (
    FLOAT_DTYPES,
    KernelInputError,
    check_contiguous,
    check_dim,
    check_dtype,
    check_last_dim_contiguous,
    check_same_device,
    check_shape,
)
from stagewise.kernels.plan_cache import plan_cache
from stagewise.kernels.targets import LaunchPlan, checked_target, fixed_plan

NAME = "rmsnorm"
MAX_HIDDEN = 32768  # one row must fit in one program's registers


@triton.jit
def _rmsnorm_kernel(
    x_ptr,  # [T, hidden] input rows, last dim contiguous
    x_row_stride,  # elements between consecutive rows of x
    residual_ptr,  # [T, hidden] residual rows (read only when HAS_RESIDUAL), last dim contiguous
    residual_row_stride,  # elements between consecutive rows of residual
    weight_ptr,  # [hidden] learned scale, contiguous
    out_ptr,  # [T, hidden] normalised output, contiguous (row stride = hidden)
    residual_out_ptr,  # [T, hidden] x + residual, contiguous (written only when HAS_RESIDUAL)
    hidden,  # row width, in elements
    eps,  # added to the mean square before rsqrt
    HAS_RESIDUAL: tl.constexpr,  # fuse `x + residual` in front of the norm
    BLOCK_SIZE: tl.constexpr,  # next power of 2 >= hidden: the whole row in one tile
):
    row = tl.program_id(0).to(tl.int64)  # int64: T * hidden may exceed 2^31
    cols = tl.arange(0, BLOCK_SIZE)  # [BLOCK_SIZE]
    mask = cols < hidden
    # [BLOCK_SIZE], input dtype
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * residual_row_stride + cols, mask=mask, other=0.0)
        # Add in fp32 and round once to the input dtype: exactly what `x + residual` does
        # in PyTorch.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * hidden + cols, x, mask=mask)  # the new residual stream
    xf = x.to(tl.float32)  # accumulate in fp32 whatever the input dtype (masked lanes are 0)
    mean_square = tl.sum(xf * xf, axis=0) / hidden  # scalar
    rstd = tl.rsqrt(mean_square + eps)
    # cast to the input dtype before the weight, like HF
    normed = (xf * rstd).to(x_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    # exact in fp32 for 16-bit inputs: one rounding at the store
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, hidden], weight [hidden], residual [T, hidden] or None -> (out, residual_out).

    Without `residual`, `residual_out` is `x` itself (the same object); with it,
    `residual_out` is a new tensor holding `x + residual`. Inputs are not modified.
    """
    check_dim(NAME, "x", x, 2)
    check_dtype(NAME, "x", x, FLOAT_DTYPES)
    check_dtype(NAME, "weight", weight, FLOAT_DTYPES)
    check_last_dim_contiguous(NAME, "x", x)
    num_tokens, hidden = x.shape
    check_shape(NAME, "weight", weight, (hidden,))
    check_contiguous(NAME, "weight", weight)
    if hidden > MAX_HIDDEN:
        raise KernelInputError(
            f"{NAME}: hidden {hidden} is wider than one program's row ({MAX_HIDDEN})"
        )
    if residual is not None:
        check_shape(NAME, "residual", residual, (num_tokens, hidden))
        check_last_dim_contiguous(NAME, "residual", residual)
        if residual.dtype != x.dtype:
            raise KernelInputError(
                f"{NAME}: residual has dtype {residual.dtype}, but x has {x.dtype}; they must match"
            )
        check_same_device(NAME, x=x, weight=weight, residual=residual)
    else:
        check_same_device(NAME, x=x, weight=weight)

    # what `weight * normed` gives in PyTorch
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(num_tokens, hidden, dtype=out_dtype, device=x.device)
    residual_out = (
        x if residual is None else torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    )
    if num_tokens == 0:
        return out, residual_out

    checked_target(NAME, x)  # the pre-Ampere policy (targets.py)
    _rmsnorm_kernel[(num_tokens,)](
        x_ptr=x,
        x_row_stride=x.stride(0),
        residual_ptr=x if residual is None else residual,  # any valid pointer when unused
        residual_row_stride=x.stride(0) if residual is None else residual.stride(0),
        weight_ptr=weight,
        out_ptr=out,
        residual_out_ptr=residual_out,  # never written when HAS_RESIDUAL is False
        hidden=hidden,
        eps=float(eps),
        **rmsnorm_options(hidden, residual is not None),
    )
    return out, residual_out


@plan_cache
def rmsnorm_options(hidden: int, has_residual: bool) -> dict:
    """The launch kwargs of `rmsnorm_plan`, kept per (hidden, residual): hidden 576 -> BLOCK_SIZE
    1024, 4 warps."""
    return rmsnorm_plan(hidden, has_residual).launch_options()


def rmsnorm_plan(hidden: int, has_residual: bool) -> LaunchPlan:
    """The whole row in one tile (BLOCK_SIZE = next power of 2 >= hidden), more warps for wider
    rows."""
    block_size = triton.next_power_of_2(hidden)
    constexprs = {"HAS_RESIDUAL": has_residual, "BLOCK_SIZE": block_size}
    return fixed_plan(NAME, constexprs, num_warps=_num_warps(block_size))


def _num_warps(block_size: int) -> int:
    """More warps for wider rows, so each thread holds a few vectors, not hundreds of registers."""
    if block_size >= 8192:
        return 16
    if block_size >= 2048:
        return 8
    return 4
