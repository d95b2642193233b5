"""The dequantize-GEMM: `x @ w` when w is kept as group-wise integer codes (`PackedWeight`).

    x [M, K] @ dequantize(w) [K, N] -> [M, N]

qkv_proj, o_proj, ffn and lm_head call this stage when their weight is packed
(a GGUF's Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K tensors, kept with the file's
values, or a float checkpoint quantized at load), in the
tier they run themselves; the embedding gathers its rows with `gather_rows`.

naive: the textbook (`stages/dequantize.py`). Expand every group of 32 codes
back to numbers,

    w[n, 32 g + j] = d[n, g] * (q[n, g, j] - offset) + m[n, g]

(`packed_weight.py` has the table), then multiply as usual. It reproduces
llama.cpp's reference dequantization (`gguf.quants.dequantize`) bit for bit:
the same float32 operations in the same order. It also makes the point of the
faster tiers plain: this tier writes a whole float32 matrix, 4 bytes per
weight, before reading it back, so it streams *more* bytes than a float32 model.

torch (`stages/dequant_gemm_torch.py`): PyTorch's stock CPU kernels that read
the codes directly; triton (`kernels/dequant_matmul.py`): one kernel that
loads codes and scales, expands a tile in registers and multiplies it, so only
the packed bytes leave memory.
"""

import torch

from stagewise.config import ModelConfig
from stagewise.stages import dequant_gemm_torch
from stagewise.stages.base import Stage
from stagewise.stages.dequantize import (  # noqa: F401  (the textbook formula, by rows)
    dequantize,
    dequantize_rows,
    gather_rows,
    unpack_codes,
)
from stagewise.stages.packed_weight import PackedWeight


def naive(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """x [M, K], w packed [K, N] -> [M, N] in x's dtype: dequantize, then the plain product."""
    return x @ dequantize(w).to(x.dtype)  # [M, K] @ [K, N] -> [M, N]


def optimized(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """x [M, K], w packed [K, N] -> [M, N] through the fused Triton dequantize-GEMM."""
    # lazy: importing kernels chooses GPU or interpreter first
    from stagewise.kernels.dequant_matmul import dequant_matmul

    return dequant_matmul(
        x, w.codes, w.scales, w.mins, bits=w.bits, offset=w.offset, group_size=w.group_size
    )


def example_inputs(config: ModelConfig, num_tokens: int, device, dtype) -> dict:
    """x [T, hidden] and the qkv projection's weight quantized to q4_1 (round to nearest)."""
    from stagewise.stages.quantize import quantize  # the quantizer is only for examples here

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(num_tokens, config.hidden_size, generator=gen)
    w = torch.randn(config.hidden_size, config.qkv_size, generator=gen) / config.hidden_size**0.5
    return {"x": x.to(device, dtype), "w": quantize(w, "q4_1").to(device)}


STAGE = Stage(
    name="dequant_gemm",
    summary="x @ w with w kept as 4- or 8-bit group codes and float16 scales",
    shapes="[T, K] @ packed [K, N] -> [T, N]",
    naive=naive,
    triton=optimized,
    triton_kind="triton: codes and scales expanded in registers, tiled dot (split-K decode)",
    torch=dequant_gemm_torch.gemm,
    torch_kind="torch: int4pack / bfloat16 stock CPU kernels, bfloat16 activations",
    example_inputs=example_inputs,
    outputs=("out",),
    axes={"x": "num_tokens K", "w": "K N", "out": "num_tokens N"},
)
