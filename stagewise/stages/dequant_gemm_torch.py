"""The torch tier of the dequantize-GEMM: PyTorch's stock CPU kernels that read packed weights.

    x [M, K] @ packed w [K, N] -> [M, N]

4-bit (q4_0, q4_1): `torch.ops.aten._weight_int4pack_mm_for_cpu`, the kernel
behind gpt-fast / torchao's int4 weight-only CPU path. It reads four-bit codes
from its own tiled layout (built once, `_convert_weight_to_int4pack_for_cpu`)
and per group a (scale, zero) pair in bfloat16, with the rule

    w = (q - 8) * scale + zero

which holds both GGUF 4-bit formats exactly: q4_0 (d * (q - 8)) is scale = d,
zero = 0; q4_1 (d * q + m) is scale = d, zero = m + 8 d. What changes is the
rounding: scale and zero are rounded to bfloat16 (8 bits of mantissa, the file
keeps d and m in float16 with 11) and so are the activations, and the kernel
accumulates in float32.

8-bit (q8_0): the stock int8 kernel (`_weight_int8pack_mm`) takes one scale
per *output row*, which cannot hold q8_0's scale per group of 32; the values
are instead expanded once to a bfloat16 copy (each d * q re-rounded to
bfloat16) and multiplied with `F.linear` in bfloat16 (2 bytes per weight
instead of 4).

Why bfloat16 activations: with float32 activations both kernels take a slow
path (measured ~10x slower). Measured on a 2-core AMD EPYC (shared, so
indicative), one thread, SmolLM2-135M's 30 layers of projections (4 per layer,
K x N from 576 x 192 to 1536 x 576), one decode row: float32 `F.linear` 112 ms
per pass, int4pack with bfloat16 activations 33 ms (and with float32
activations 411 ms); the 49152 x 576 tied LM head: float32 31-36 ms, bfloat16
`F.linear` 14.6 ms, int8pack 14.0 ms, int4pack 5.1 ms.

The prepared forms live in `w.prepared` (built on the first call, or at load
by `prepare`); off the CPU, this tier is the naive one.
"""

import torch
import torch.nn.functional as F

from stagewise.stages.dequantize import dequantize, dequantize_rows, unpack_codes
from stagewise.stages.packed_weight import PackedWeight

INNER_K_TILES = 2  # the int4pack layout's K tiling (the CPU kernel accepts 1, 2, 4, 8: same bytes)


def _int4pack(w: PackedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes in the CPU kernel's layout [N, K/2] uint8, scale_and_zero [K/G, N, 2] bf16)."""
    q = unpack_codes(w).flatten(1)  # [N, K/G, G] -> [N, K] int32 codes 0..15
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, INNER_K_TILES)
    d = w.scales.to(torch.float32)  # [N, K/G]
    zero = torch.zeros_like(d) if w.mins is None else w.mins.to(torch.float32) + 8 * d
    scale_zero = torch.stack([d, zero], dim=-1).transpose(0, 1)  # [N, K/G, 2] -> [K/G, N, 2]
    return packed, scale_zero.to(torch.bfloat16).contiguous()


def _bf16_rows(w: PackedWeight) -> torch.Tensor:
    """The 8-bit weight expanded once to bfloat16, [N, K] row-major (F.linear's weight)."""
    return dequantize_rows(w).to(torch.bfloat16).contiguous()


def supported(w: PackedWeight) -> bool:
    """The int4pack CPU kernel needs N in multiples of 16 (4-bit); the bf16 copy takes any shape."""
    return w.device.type == "cpu" and (w.bits == 8 or w.shape[1] % 16 == 0)


def prepare(w: PackedWeight) -> PackedWeight:
    """Build this tier's form of w once (kept in `w.prepared`); returns w."""
    if not supported(w) or "torch" in w.prepared:
        return w
    w.prepared["torch"] = _int4pack(w) if w.bits == 4 else _bf16_rows(w)
    return w


def gemm(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """x [M, K] @ packed w [K, N] -> [M, N] in x's dtype, by the stock CPU kernels."""
    if x.device.type != "cpu" or not supported(w):
        return x @ dequantize(w).to(x.dtype)  # the naive tier: dequantize, then x @ w
    form = prepare(w).prepared["torch"]
    xb = x.to(torch.bfloat16)  # [M, K]: the kernels' fast path takes bfloat16 activations
    if w.bits == 4:
        packed, scale_zero = form
        # [M, K] @ int4 [K, N] -> [M, N] bf16, float32 accumulation inside
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, w.group_size, scale_zero)
    else:
        out = F.linear(xb, form)  # [M, K] @ [N, K]^T -> [M, N] bf16
    return out.to(x.dtype)
