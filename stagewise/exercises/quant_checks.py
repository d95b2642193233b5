"""Checks for the exercises of notebook 14 (quantized weights), against llama.cpp's own tables and code.

The reference here is outside the package: the `gguf` package that ships with llama.cpp holds its
block sizes (`GGML_QUANT_SIZES`) and a NumPy port of its reference quantizer and dequantizer
(`gguf.quants`), so a student's answer is compared with what llama.cpp itself computes.
"""

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from stagewise.exercises.core import Mismatch, call, close, near

# (bits, group size, has a minimum) -> the llama.cpp type with that layout (float16 scales)
LAYOUTS = {
    (4, 32, False): "Q4_0",
    (4, 32, True): "Q4_1",
    (5, 32, False): "Q5_0",
    (5, 32, True): "Q5_1",
    (8, 32, False): "Q8_0",
}


def check_bytes_per_weight(fn) -> str:
    """my_bytes_per_weight(bits, group_size, has_min) -> float: codes, float16 d (and m), per weight."""
    for (bits, group, has_min), name in LAYOUTS.items():
        values, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
        got = call(fn, bits, group, has_min)
        near(got, block_bytes / values, f"{name} ({bits}-bit codes, groups of {group}, min: {has_min})")
    return f"{', '.join(LAYOUTS.values())}: bytes per weight as in llama.cpp's block table"


def _blocks() -> np.ndarray:
    """Q4_0 blocks [n, 18] uint8: seeded weights quantized by llama.cpp's reference, plus edge cases."""
    rng = np.random.default_rng(14)
    rows = [rng.standard_normal(32) * scale for scale in (0.02, 1.0, 40.0)]
    rows.append(np.linspace(-1.0, 1.0, 32))  # every code from the extremes in between
    rows.append(-np.abs(rng.standard_normal(32)))  # all negative: the largest magnitude gets code 0
    blocks = quantize(np.stack(rows).astype(np.float32), GGMLQuantizationType.Q4_0)  # [n, 18]
    zero = np.zeros((1, 18), dtype=np.uint8)  # d = 0: every weight is 0
    return np.concatenate([blocks, zero])


def check_dequant_q4_0(fn) -> str:
    """my_dequant_q4_0(block [18] uint8) -> [32] float32: w_j = d * (q_j - 8), exactly as llama.cpp."""
    blocks = _blocks()
    want = dequantize(blocks, GGMLQuantizationType.Q4_0)  # [n, 32] float32, llama.cpp's reference
    for i, block in enumerate(blocks):
        got = call(fn, torch.from_numpy(block.copy()))
        if isinstance(got, torch.Tensor) and got.dtype != torch.float32:
            raise Mismatch(f"block {i}: return float32 values, got {got.dtype}")
        close(got, torch.from_numpy(want[i]), f"block {i} (d = {float(block[:2].view(np.float16)[0]):.4g})", 0, 0)
    return f"{len(blocks)} Q4_0 blocks equal gguf.quants.dequantize bit for bit"


CHECKS = {"14.bytes_per_weight": check_bytes_per_weight, "14.dequant_q4_0": check_dequant_q4_0}
