"""Round-to-nearest quantization: a float [K, N] weight -> a `PackedWeight`, group by group.

    q8_0   d = max|x| / 127                 q = round(x / d)                  in -127..127
    q4_0   d = x_maxabs / -8 (signed)       q = clamp(trunc(x / d + 8.5), 0, 15)
    q4_1   d = (max - min) / 15, m = min    q = clamp(trunc((x - m) / d + 0.5), 0, 15)

These are llama.cpp's reference quantizers (the ones `gguf.quants.quantize`
runs), so a Hugging Face checkpoint quantized at load gets the same codes a
GGUF converter would write. Weight-only: activations stay floating point.
Each group of G values along K gets its own float16 scale, so one outlier
costs precision only within its own 32 numbers.
"""

import torch
from einops import rearrange

from stagewise.quant.packed_weight import GROUP_SIZE, KINDS, PackedWeight, PackedWeightError


def quantize(w: torch.Tensor, kind: str, group_size: int = GROUP_SIZE) -> PackedWeight:
    """w [K, N] float (in, out) -> packed, out-major; K must be a multiple of `group_size`."""
    if kind not in KINDS:
        raise PackedWeightError(f"unknown packed kind '{kind}'; known: {', '.join(KINDS)}")
    k, n = w.shape
    if k % group_size:
        raise PackedWeightError(f"K = {k} is not a whole number of groups of {group_size}")
    # [K, N] -> [N, K] -> [N, K/G, G]: one row per output feature, cut into groups along K
    x = rearrange(w.detach().to(torch.float32).t(), "n (g j) -> n g j", j=group_size)
    if kind == "q8_0":
        d = x.abs().amax(dim=-1, keepdim=True) / 127  # [N, K/G, 1]
        inv = torch.where(d == 0, 0.0, 1.0 / d)
        q = torch.round(x * inv).to(torch.int8)  # [N, K/G, G] in -127..127
        codes, mins = rearrange(q, "n g j -> n (g j)"), None
    else:
        if kind == "q4_0":
            imax = x.abs().argmax(dim=-1, keepdim=True)
            d = torch.gather(x, -1, imax) / -8  # signed: the largest magnitude maps to code 0
            inv = torch.where(d == 0, 0.0, 1.0 / d)
            q = torch.trunc(x * inv + 8.5).clamp(0, 15)
            mins = None
        else:
            lo, hi = x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)
            d = (hi - lo) / 15
            inv = torch.where(d == 0, 0.0, 1.0 / d)
            q = torch.trunc((x - lo) * inv + 0.5).clamp(0, 15)
            mins = lo[..., 0].to(torch.float16)
        q = q.to(torch.uint8)  # [N, K/G, G] codes 0..15
        half = group_size // 2  # byte i of a group: value i (low nibble), value i + G/2 (high)
        packed = q[..., :half] | (q[..., half:] << 4)  # [N, K/G, G/2]
        codes = rearrange(packed, "n g i -> n (g i)")
    scales = d[..., 0].to(torch.float16)  # [N, K/G]
    return PackedWeight(kind, codes.contiguous(), scales.contiguous(), mins, group_size)
