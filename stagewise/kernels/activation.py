"""Fused SwiGLU activation `silu_and_mul` in Triton.

    gate_up [T, 2*inter] -> out [T, inter],   out = silu(gate) * up,   silu(g) = g * sigmoid(g)

The FFN's fused gate/up GEMM writes gate and up side by side in one row:
columns [0, inter) are the gate, [inter, 2*inter) the up projection. Unfused,
PyTorch reads gate to write silu(gate), then reads that and up to write the
product; this kernel reads each input once and writes each output once, the
minimum bytes: it is purely memory bound.

Tiling: program (i, j) owns a [BLOCK_T, BLOCK_C] tile of the output. It loads
the gate tile and the up tile `inter` columns further along the same rows,
both issued before either is waited on, computes in fp32 and stores in the
input dtype. BLOCK_C is a power of 2 dividing `inter` when one of at least
MIN_BLOCK does (14336 = 7 x 2048), so no lane is masked off for a real model;
rows may be strided, the last dimension is contiguous. On a GPU BLOCK_T and
num_warps are autotuned (row_tiles.py; measurements: benchmarks/README.md,
"Kernel notes"). bf16 stores are rounded by hand in the interpreter
(precision.py).
"""

import torch
import triton
import triton.language as tl

from stagewise.kernels import INTERPRETER
from stagewise.kernels.checks import (
    FLOAT_DTYPES,
    KernelInputError,
    check_dim,
    check_dtype,
    check_last_dim_contiguous,
    check_same_device,
)
from stagewise.kernels.plan_cache import cdiv, plan_cache
from stagewise.kernels.precision import round_to_bf16
from stagewise.kernels.row_tiles import (
    TileConfig,
    gpu_candidates,
    launch,
    token_bucket,
    tokens_per_program,
    warps_for,
)
from stagewise.kernels.targets import checked_target

MAX_BLOCK = 2048  # columns per program
MIN_BLOCK = 256  # narrowest column block chosen to divide `inter` exactly
# elements of one tensor's [BLOCK_T, BLOCK_C] tile: 8 KB in bf16 (interpreter; GPU: around it)
TOKEN_TILE = 4096


@triton.jit(do_not_specialize=["num_tokens", "tokens_bucket"])  # one compiled variant for every T
def _silu_and_mul_kernel(
    # [T, 2*inter] input: gate in columns [0, inter), up in [inter, 2*inter); last dim contiguous
    gate_up_ptr,
    out_ptr,  # [T, inter] output, contiguous
    num_tokens,  # T: rows of the last row tile beyond it are masked off
    inter,  # width of each half
    stride_in_row,  # elements between rows of gate_up
    stride_out_row,  # elements between rows of out
    tokens_bucket,  # next power of 2 >= T: only the GPU autotuner's key, unused here
    INTERPRETED: tl.constexpr,  # True under the CPU interpreter: round bf16 stores by hand
    BLOCK_T: tl.constexpr,  # rows per program, a power of 2
    BLOCK_C: tl.constexpr,  # columns per program, a power of 2
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C]
    mask = (rows < num_tokens)[:, None] & (cols < inter)[None, :]  # [BLOCK_T, BLOCK_C]
    rows64 = rows.to(tl.int64)[:, None]  # int64: row * stride may pass 2**31 on long prefills
    gate_ptrs = gate_up_ptr + rows64 * stride_in_row + cols[None, :]
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_T, BLOCK_C]
    up = tl.load(gate_ptrs + inter, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_T, BLOCK_C]
    # silu(gate) * up in fp32; sigmoid written out (tl.sigmoid is a @jit helper, slow to call in the
    # interpreter)
    out = gate / (1.0 + tl.exp(-gate)) * up
    if INTERPRETED and out_ptr.dtype.element_ty == tl.bfloat16:
        out = round_to_bf16(out)
    tl.store(
        out_ptr + rows64 * stride_out_row + cols[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


@plan_cache
def silu_and_mul_tiles(
    num_tokens: int, inter: int, interpreter: bool = INTERPRETER
) -> tuple[TileConfig, ...]:
    """Tile candidates: one under the interpreter, a few around it on a GPU (kept per shape).

    BLOCK_C: up to MAX_BLOCK columns, a power of 2 dividing `inter` when one >= MIN_BLOCK does;
    BLOCK_T: rows so that one tensor's tile is about TOKEN_TILE elements.
    """
    block_c = min(triton.next_power_of_2(inter), MAX_BLOCK)
    largest_divisor = inter & -inter  # the largest power of 2 dividing inter
    if inter % block_c and largest_divisor >= MIN_BLOCK:
        block_c = min(largest_divisor, MAX_BLOCK)
    block_t = tokens_per_program(num_tokens, block_c, TOKEN_TILE)
    best = TileConfig(block_t, warps_for(block_t * block_c), block_c)
    return (best,) if interpreter else gpu_candidates(best)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2*inter] -> silu(gate_up[:, :inter]) * gate_up[:, inter:] as a new contiguous [T,
    inter]."""
    check_dim("silu_and_mul", "gate_up", gate_up, 2)
    check_dtype("silu_and_mul", "gate_up", gate_up, FLOAT_DTYPES)
    check_same_device("silu_and_mul", gate_up=gate_up)
    if gate_up.shape[1] % 2:
        raise KernelInputError(
            f"silu_and_mul: gate_up last dimension must be even (gate | up), got {gate_up.shape[1]}"
        )
    if gate_up.shape[1]:
        check_last_dim_contiguous("silu_and_mul", "gate_up", gate_up)
    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((num_tokens, inter), device=gate_up.device, dtype=gate_up.dtype)
    if out.numel() == 0:
        return out
    checked_target("silu_and_mul", gate_up)  # the pre-Ampere policy (targets.py)
    launch(
        _silu_and_mul_kernel,
        silu_and_mul_tiles(num_tokens, inter),
        key=("tokens_bucket", "inter"),
        grid=lambda meta: (cdiv(num_tokens, meta["BLOCK_T"]), cdiv(inter, meta["BLOCK_C"])),
        gate_up_ptr=gate_up,
        out_ptr=out,
        num_tokens=num_tokens,
        inter=inter,
        stride_in_row=gate_up.stride(0),
        stride_out_row=out.stride(0),
        tokens_bucket=token_bucket(num_tokens),
        INTERPRETED=INTERPRETER,
    )
    return out
