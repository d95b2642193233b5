"""Stage 4: fused QKV projection — one GEMM produces queries, keys and values.

    x [T, hidden] @ w_qkv [hidden, (H + 2*Hkv) * d] -> qkv [T, (H + 2*Hkv) * d]

The three projections W_q [hidden, H*d], W_k [hidden, Hkv*d] and W_v
[hidden, Hkv*d] are concatenated along their output columns, so the input is
read once and one large GEMM replaces three smaller ones. With GQA the K and V
slices are narrower than Q (SmolLM2: 576 + 192 + 192 = 960 columns). The
caller splits the result with views (`split_qkv`), no copy.

Weights have the shape [in, out] so the code reads `x @ w`, like the math
(their memory layout is chosen per device: `models/weights.py`).

A weight kept quantized (`PackedWeight`, a GGUF's Q4_1 blocks) goes through
the dequantize-GEMM stage (`stages/dequant_gemm.py`) in the same tier.

Torch tier (`stages/gemm_torch.py`): the same product asked the way this CPU's
BLAS streams the weights fastest (measured at load), about 1.9x faster than
`x @ w` for one decode row on a 2-core AMD EPYC.

Triton: a tiled Triton GEMM (`kernels/matmul.py`) with fp32 accumulation and
grouped program ordering, so tiles running together share rows of x and
columns of w_qkv in L2. Decode steps (M <= 16 tokens) are a memory-bound
matrix-vector product over the weights: they run a split-K kernel
(`kernels/matmul_decode.py`) whose programs each stream one range of K of a
thin tile of columns, so every SM has weight loads in flight. Batch-invariant
(the default), that split-K kernel serves every T, so a row's bits never depend
on the rows beside it; `triton_variant` keeps the tiled GEMM for prefill.
"""

import torch

from stagewise.config import ModelConfig
from stagewise.quant.packed_weight import is_packed
from stagewise.stages import dequant_gemm, gemm_torch
from stagewise.stages.base import Stage


def naive(x: torch.Tensor, w_qkv: torch.Tensor) -> torch.Tensor:
    """x [T, hidden], w_qkv [hidden, (H+2Hkv)*d] -> [T, (H+2Hkv)*d]."""
    if is_packed(w_qkv):  # kept quantized: the dequantize-GEMM stage, same tier
        return dequant_gemm.naive(x, w_qkv)
    return x @ w_qkv  # [T, hidden] @ [hidden, (H+2Hkv)*d] -> [T, (H+2Hkv)*d]


def triton(x: torch.Tensor, w_qkv: torch.Tensor, batch_invariant: bool = True) -> torch.Tensor:
    """x [T, hidden], w_qkv [hidden, (H+2Hkv)*d] -> [T, (H+2Hkv)*d] through the Triton GEMM.

    batch_invariant: one kernel configuration for every T (kernels/matmul_decode.py)."""
    # lazy: importing kernels chooses GPU or interpreter first
    from stagewise.kernels.matmul import matmul

    if is_packed(w_qkv):
        return dequant_gemm.triton(x, w_qkv, batch_invariant)
    # [T, hidden] @ [hidden, (H+2Hkv)*d] -> [T, (H+2Hkv)*d]
    return matmul(x, w_qkv, batch_invariant=batch_invariant)


def triton_variant(x: torch.Tensor, w_qkv: torch.Tensor) -> torch.Tensor:
    """`batch_invariant=False`: decode (T <= 16) and prefill shapes each take their fastest GEMM."""
    return triton(x, w_qkv, batch_invariant=False)


def split_qkv(
    qkv: torch.Tensor, config: ModelConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, (H+2Hkv)*d] -> q [T, H, d], k [T, Hkv, d], v [T, Hkv, d] (views, no copy)."""
    q, k, v = qkv.split([config.q_size, config.kv_size, config.kv_size], dim=-1)
    num_tokens = qkv.shape[0]
    q = q.view(num_tokens, config.num_heads, config.head_dim)  # [T, H*d] -> [T, H, d]
    k = k.view(num_tokens, config.num_kv_heads, config.head_dim)  # [T, Hkv*d] -> [T, Hkv, d]
    v = v.view(num_tokens, config.num_kv_heads, config.head_dim)  # [T, Hkv*d] -> [T, Hkv, d]
    return q, k, v


def example_inputs(config: ModelConfig, num_tokens: int, device, dtype) -> dict:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(num_tokens, config.hidden_size, generator=gen)
    w = torch.randn(config.hidden_size, config.qkv_size, generator=gen) / config.hidden_size**0.5
    return {"x": x.to(device, dtype), "w_qkv": w.to(device, dtype)}


STAGE = Stage(
    name="qkv_proj",
    summary="one GEMM against the concatenated [W_q | W_k | W_v] weight",
    shapes="[T, hidden] -> [T, (H + 2*Hkv) * d]",
    naive=naive,
    triton=triton,
    triton_variant=triton_variant,
    triton_kind="triton: tiled GEMM, grouped ordering",
    torch=gemm_torch.qkv_proj,
    torch_variant=gemm_torch.qkv_proj_variant,
    torch_kind="torch: x @ w in the CPU BLAS form measured fastest at load",
    example_inputs=example_inputs,
    outputs=("qkv",),
    axes={"x": "num_tokens hidden", "w_qkv": "hidden qkv_size", "qkv": "num_tokens qkv_size"},
)
