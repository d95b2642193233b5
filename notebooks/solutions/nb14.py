"""Solutions to the exercises of notebook 14 (quantized weights)."""

import torch


def my_bytes_per_weight(bits: int, group_size: int, has_min: bool) -> float:
    codes = group_size * bits / 8  # bytes of the group's codes
    scales = 2 + (2 if has_min else 0)  # float16 d, and float16 m for the "_1" formats
    return (codes + scales) / group_size


def my_dequant_q4_0(block: torch.Tensor) -> torch.Tensor:
    d = block[:2].view(torch.float16).to(torch.float32)  # [1]: the scale, bytes 0-1 (little-endian)
    packed = block[2:18]  # [16] bytes: value i in the low nibble, value i + 16 in the high one
    q = torch.cat([packed & 0x0F, packed >> 4]).to(torch.float32)  # [32] codes 0..15
    return d * (q - 8)  # [32]: codes 0..15 mean -8..7 steps of d


SOLUTIONS = {"14.bytes_per_weight": my_bytes_per_weight, "14.dequant_q4_0": my_dequant_q4_0}
