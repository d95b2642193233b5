"""Dequantize: packed group codes back to float32 numbers, by the block formula.

    w[n, G g + j] = d[n, g] * (q[n, g, j] - offset) + m[n, g]

`packed_weight.py` has the formats (q4_0, q4_1, q8_0) and the layout. These
are the same float32 operations, in the same order, as llama.cpp's reference
(`gguf.quants.dequantize`), so the numbers are the same bits. The naive tier
of the dequantize-GEMM (`dequant_gemm.py`) and the embedding's row gather use
them; faster tiers build their own forms from `unpack_codes`. (Once the torch
tier has built its form, `w.codes` is rebuilt from it: the same bits.)
"""

import torch
from einops import rearrange

from stagewise.quant.packed_weight import PackedWeight


def unpack_codes(w: PackedWeight) -> torch.Tensor:
    """The integer codes as one number each: [N, K/G, G] int32 (before the offset)."""
    if w.bits == 8:
        return rearrange(w.codes, "n (g j) -> n g j", j=w.group_size).to(torch.int32)
    # 4-bit: each byte of a group holds value i (low nibble) and value i + G/2 (high nibble)
    packed = rearrange(w.codes, "n (g i) -> n g i", i=w.group_size // 2)  # [N, K/G, G/2] bytes
    low, high = packed & 0x0F, packed >> 4  # [N, K/G, G/2] each: values 0..G/2-1 and G/2..G-1
    codes = torch.stack([low, high], dim=2)  # [N, K/G, 2, G/2]
    return rearrange(codes, "n g half i -> n g (half i)").to(torch.int32)  # [N, K/G, G]


def dequantize_rows(w: PackedWeight, rows: torch.Tensor | slice | None = None) -> torch.Tensor:
    """Storage rows of w as float32 numbers: [N, K] (or [len(rows), K]), by the block formula."""
    part = w if rows is None else w.out_features(rows)
    q = unpack_codes(part) - part.offset  # [n, K/G, G] int32, q4_0: 0..15 -> -8..7
    d = part.scales.to(torch.float32)[:, :, None]  # [n, K/G, 1]: one scale per group
    values = d * q.to(torch.float32)  # [n, K/G, G]
    if part.mins is not None:
        values = values + part.mins.to(torch.float32)[:, :, None]  # q4_1: + m per group
    return rearrange(values, "n g j -> n (g j)")  # [n, K/G, G] -> [n, K]


def dequantize(w: PackedWeight) -> torch.Tensor:
    """The [K, N] matrix a packed weight stands for, float32 (a transposed view of [N, K])."""
    return dequantize_rows(w).t()  # [N, K] -> [K, N]


def gather_rows(w: PackedWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of a packed table [vocab, hidden] (the embedding) -> [T, hidden] in `dtype`."""
    return dequantize_rows(w, ids).to(dtype)  # only the T rows asked for are expanded
