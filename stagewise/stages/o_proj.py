"""Attention output projection — mix the heads back into the residual stream.

    attn_out [T, H * d] @ w_o [H * d, hidden] -> [T, hidden]

Not one of the seeds' six named steps but a GEMM of the same size as the Q
projection that every block runs right after attention; it is traced and
benchmarked like the other projections.

A packed weight goes through `stages/dequant_gemm.py`, in the same tier.

Torch tier (`stages/gemm_torch.py`): the same product in the CPU BLAS form
measured fastest at load, as for qkv_proj.

Triton: the same tiled Triton GEMM as qkv_proj (`kernels/matmul.py`), fp32
accumulation and grouped program ordering for L2 reuse; `x` may be a strided
view of the attention output, read in place through its strides.
"""

import torch

from stagewise.config import ModelConfig
from stagewise.quant.packed_weight import is_packed
from stagewise.stages import dequant_gemm, gemm_torch
from stagewise.stages.base import Stage


def naive(x: torch.Tensor, w_o: torch.Tensor) -> torch.Tensor:
    """x [T, H*d], w_o [H*d, hidden] -> [T, hidden]."""
    if is_packed(w_o):  # kept quantized: the dequantize-GEMM stage, same tier
        return dequant_gemm.naive(x, w_o)
    return x @ w_o  # [T, H*d] @ [H*d, hidden] -> [T, hidden]


def triton(x: torch.Tensor, w_o: torch.Tensor, batch_invariant: bool = True) -> torch.Tensor:
    """x [T, H*d], w_o [H*d, hidden] -> [T, hidden] through the Triton GEMM.

    batch_invariant: one kernel configuration for every T (kernels/matmul_decode.py)."""
    # lazy: importing kernels chooses GPU or interpreter first
    from stagewise.kernels.matmul import matmul

    if is_packed(w_o):
        return dequant_gemm.triton(x, w_o, batch_invariant)
    # [T, H*d] @ [H*d, hidden] -> [T, hidden]
    return matmul(x, w_o, batch_invariant=batch_invariant)


def triton_variant(x: torch.Tensor, w_o: torch.Tensor) -> torch.Tensor:
    """`batch_invariant=False`: decode (T <= 16) and prefill shapes each take their fastest GEMM."""
    return triton(x, w_o, batch_invariant=False)


def example_inputs(config: ModelConfig, num_tokens: int, device, dtype) -> dict:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(num_tokens, config.q_size, generator=gen)
    w = torch.randn(config.q_size, config.hidden_size, generator=gen) / config.q_size**0.5
    return {"x": x.to(device, dtype), "w_o": w.to(device, dtype)}


STAGE = Stage(
    name="o_proj",
    summary="one GEMM from the concatenated head outputs back to hidden",
    shapes="[T, H * d] -> [T, hidden]",
    naive=naive,
    triton=triton,
    triton_variant=triton_variant,
    triton_kind="triton: tiled GEMM, grouped ordering",
    torch=gemm_torch.o_proj,
    torch_variant=gemm_torch.o_proj_variant,
    torch_kind="torch: x @ w in the CPU BLAS form measured fastest at load",
    example_inputs=example_inputs,
    outputs=("out",),
    axes={"x": "num_tokens q_size", "w_o": "q_size hidden", "out": "num_tokens hidden"},
)
