"""Fused SwiGLU activation `silu_and_mul` in Triton.

    gate_up [T, 2*inter] -> out [T, inter],   out = silu(gate) * up,   silu(g) = g * sigmoid(g)

The FFN's fused gate/up GEMM writes gate and up side by side in one row:
columns [0, inter) are the gate, columns [inter, 2*inter) the up projection.
Unfused, PyTorch reads gate to write silu(gate), then reads that and up to
write the product: three passes over [T, inter] tensors plus a temporary. This
kernel reads each input element once and writes each output element once, so
it moves the minimum bytes; it is purely memory bound, and on a GPU its speed
is measured against a plain copy of the same bytes.

Tiling: a 2-D grid, one program per (row, block of BLOCK columns). A program
loads BLOCK gate values and the BLOCK up values `inter` columns further along
the same row, computes in fp32 and stores in the input dtype. Rows may be
strided (a row slice of a larger buffer); the last dimension must be
contiguous so each program's loads are contiguous.
"""

import torch
import triton
import triton.language as tl

from stagewise.kernels import INTERPRETER
from stagewise.kernels.checks import (
    KernelInputError,
    check_dim,
    check_dtype,
    check_last_dim_contiguous,
    check_same_device,
)
from stagewise.kernels.matmul import round_to_bf16

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,  # [T, 2*inter] input: gate in columns [0, inter), up in [inter, 2*inter); last dim contiguous
    out_ptr,  # [T, inter] output, contiguous
    inter,  # width of each half
    stride_in_row,  # elements between rows of gate_up
    stride_out_row,  # elements between rows of out
    INTERPRETED: tl.constexpr,  # True under the CPU interpreter: round bf16 stores by hand
    BLOCK: tl.constexpr,  # columns per program
):
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride may pass 2**31 on long prefills
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < inter
    in_row = gate_up_ptr + row * stride_in_row
    gate = tl.load(in_row + cols, mask=mask, other=0.0).to(tl.float32)  # [BLOCK]
    up = tl.load(in_row + inter + cols, mask=mask, other=0.0).to(tl.float32)  # [BLOCK]
    # silu(gate) * up in fp32; sigmoid written out (tl.sigmoid is a @jit helper, slow to call in the interpreter)
    out = gate / (1.0 + tl.exp(-gate)) * up
    if INTERPRETED and out_ptr.dtype.element_ty == tl.bfloat16:
        out = round_to_bf16(out)
    tl.store(out_ptr + row * stride_out_row + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2*inter] -> silu(gate_up[:, :inter]) * gate_up[:, inter:] as a new contiguous [T, inter]."""
    check_dim("silu_and_mul", "gate_up", gate_up, 2)
    check_dtype("silu_and_mul", "gate_up", gate_up, FLOAT_DTYPES)
    check_same_device("silu_and_mul", gate_up=gate_up)
    if gate_up.shape[1] % 2:
        raise KernelInputError(f"silu_and_mul: gate_up last dimension must be even (gate | up), got {gate_up.shape[1]}")
    if gate_up.shape[1]:
        check_last_dim_contiguous("silu_and_mul", "gate_up", gate_up)
    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((num_tokens, inter), device=gate_up.device, dtype=gate_up.dtype)
    if out.numel() == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    grid = (num_tokens, triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](
        gate_up_ptr=gate_up,
        out_ptr=out,
        inter=inter,
        stride_in_row=gate_up.stride(0),
        stride_out_row=out.stride(0),
        INTERPRETED=INTERPRETER,
        BLOCK=block,
        num_warps=4,
    )
    return out
