"""The dequantize-GEMM: `x @ w` when w is kept as group-wise integer codes (`PackedWeight`).

    x [M, K] @ dequantize(w) [K, N] -> [M, N]

qkv_proj, o_proj, ffn and lm_head call this stage when their weight is packed
(a GGUF's Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K tensors, kept with the file's
values, or a float checkpoint quantized at load), in the
tier they run themselves; the embedding gathers its rows with `gather_rows`.

naive: the textbook (`quant/dequantize.py`). Expand every group of 32 codes
back to numbers,

    w[n, 32 g + j] = d[n, g] * (q[n, g, j] - offset) + m[n, g]

(`quant/packed_weight.py` has the table), then multiply as usual. It reproduces
llama.cpp's reference dequantization (`gguf.quants.dequantize`) bit for bit:
the same float32 operations in the same order. It also makes the point of the
faster tiers plain: this tier writes a whole float32 matrix, 4 bytes per
weight, before reading it back, so it streams *more* bytes than a float32 model.

torch (`stages/dequant_gemm_torch.py`): PyTorch's stock CPU kernels that read
the codes directly; triton (`kernels/dequant_matmul.py`): one kernel that
loads codes and scales, expands a tile in registers and multiplies it, so only
the packed bytes leave memory.

A fused weight whose parts have different formats (a Q4_K_M file's Q4_K W_q, W_k beside a Q6_K
W_v) arrives as a `PackedParts` (`quant/packed_parts.py`): every tier multiplies part by part
along the output axis, `x @ [W_1 | W_2] = [x @ W_1 | x @ W_2]`. The naive tier dequantizes
every part and multiplies once by the whole float32 matrix, so its numbers are the float32
model's bit for bit.
"""

import torch

from stagewise.config import ModelConfig
from stagewise.quant.dequantize import (  # noqa: F401  (the textbook formula, by rows)
    dequantize,
    dequantize_rows,
    gather_rows,
    unpack_codes,
)
from stagewise.quant.packed_parts import PackedParts
from stagewise.quant.packed_weight import PackedWeight
from stagewise.stages import dequant_gemm_torch
from stagewise.stages.base import Stage


def dequantize_fused(w: PackedWeight) -> torch.Tensor:
    """The [K, N] float32 matrix of w; a PackedParts' parts side by side (an out-major copy)."""
    if not isinstance(w, PackedParts):
        return dequantize(w)
    return torch.cat([dequantize_rows(p) for p in w.parts]).t()  # [sum N_i, K] -> [K, N] view


def naive(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """x [M, K], w packed [K, N] -> [M, N] in x's dtype: dequantize, then the plain product."""
    return x @ dequantize_fused(w).to(x.dtype)  # [M, K] @ [K, N] -> [M, N]


def by_parts(gemm, x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """gemm(x, w) for one PackedWeight; for a PackedParts [x @ W_1 | x @ W_2 | ...] [M, sum N_i]."""
    if not isinstance(w, PackedParts):
        return gemm(x, w)
    return torch.cat([gemm(x, p) for p in w.parts], dim=1)  # [M, N_1] | [M, N_2] -> [M, N]


def _triton(x: torch.Tensor, w: PackedWeight, batch_invariant: bool = True) -> torch.Tensor:
    # lazy: importing kernels chooses GPU or interpreter first
    from stagewise.kernels.dequant_matmul import dequant_matmul

    return dequant_matmul(
        x, w.codes, w.scales, w.mins, bits=w.bits, offset=w.offset, group_size=w.group_size,
        batch_invariant=batch_invariant,
    )  # fmt: skip


def triton(x: torch.Tensor, w: PackedWeight, batch_invariant: bool = True) -> torch.Tensor:
    """x [M, K], w packed [K, N] -> [M, N] through the fused Triton dequantize-GEMM.

    batch_invariant: one kernel configuration for every M (kernels/dequant_matmul.py)."""
    return by_parts(lambda x, p: _triton(x, p, batch_invariant), x, w)


def triton_variant(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """`batch_invariant=False`: decode (M <= 16) and prefill each take their fastest tiles."""
    return triton(x, w, batch_invariant=False)


def torch_tier(x: torch.Tensor, w: PackedWeight, batch_invariant: bool = True) -> torch.Tensor:
    """x [M, K], w packed [K, N] -> [M, N] by PyTorch's stock CPU kernels, part by part.

    `batch_invariant=False`: a bfloat16 copy's rows as they are (their bits then depend on M)."""
    if batch_invariant:
        return by_parts(dequant_gemm_torch.gemm, x, w)
    return by_parts(dequant_gemm_torch.gemm_variant, x, w)


def example_inputs(config: ModelConfig, num_tokens: int, device, dtype) -> dict:
    """x [T, hidden] and the qkv projection's weight quantized to q4_1 (round to nearest)."""
    from stagewise.quant.quantize import quantize  # the quantizer is only for examples here

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(num_tokens, config.hidden_size, generator=gen)
    w = torch.randn(config.hidden_size, config.qkv_size, generator=gen) / config.hidden_size**0.5
    return {"x": x.to(device, dtype), "w": quantize(w, "q4_1").to(device)}


STAGE = Stage(
    name="dequant_gemm",
    summary="x @ w with w kept as 4- or 8-bit group codes and float16 scales",
    shapes="[T, K] @ packed [K, N] -> [T, N]",
    naive=naive,
    triton=triton,
    triton_variant=triton_variant,
    triton_kind="triton: codes and scales expanded in registers, tiled dot (split-K decode)",
    torch=torch_tier,
    torch_kind="torch: int4pack / bfloat16 stock CPU kernels, bfloat16 activations",
    example_inputs=example_inputs,
    outputs=("out",),
    axes={"x": "num_tokens K", "w": "K N", "out": "num_tokens N"},
)
