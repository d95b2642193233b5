"""A GGUF tensor's quantized blocks -> `PackedWeight`, without changing a bit.

A GGUF tensor of type Q4_0, Q4_1 or Q8_0 is a run of fixed-size blocks, one
per 32 consecutive weights of a row (llama.cpp's `block_q4_0` etc.):

    Q4_0   18 bytes: d (float16) | 16 bytes of codes (two per byte)
    Q4_1   20 bytes: d (float16) | m (float16) | 16 bytes of codes
    Q8_0   34 bytes: d (float16) | 32 signed codes (int8)

`packed_from_blocks` separates them: the codes of all blocks of a row side by
side in one tensor, d (and m) in another, so a kernel reads each with plain
strides (`quant/packed_weight.py` draws the layout). The K-quants Q4_K, Q5_K
and Q6_K (super-blocks of 256) are expanded exactly to groups with float32
scales (`quant/gguf_kquants.py`).

Before a bit is read, every tensor's bytes must match its shape: rows of
whole blocks, and exactly the blocks' bytes (a truncated or corrupt file is
refused in one line); so must the scales be finite.
"""

import numpy as np
import torch

from stagewise.errors import StagewiseError
from stagewise.quant.gguf_kquants import K_KEPT, SUPER_BLOCK, packed_from_k_blocks
from stagewise.quant.packed_weight import GROUP_SIZE, PackedWeight

# GGUF tensor type -> (packed kind, bytes per block): the types kept packed
KEPT = {
    "Q4_0": ("q4_0", 18),
    "Q4_1": ("q4_1", 20),
    "Q8_0": ("q8_0", 34),
    **K_KEPT,
}


def packed_from_blocks(
    data: np.ndarray, type_name: str, shape: tuple[int, int], name: str
) -> PackedWeight:
    """A GGUF tensor's raw blocks (uint8) of an [out, in] matrix -> PackedWeight [in, out].

    Refuses, with one line, data whose size does not match the shape (a truncated or corrupt file).
    """
    kind, block_bytes = KEPT[type_name]
    out_f, in_f = shape
    block = SUPER_BLOCK if type_name in K_KEPT else GROUP_SIZE
    if in_f % block:
        raise StagewiseError(
            f"{name}: {type_name} rows of {in_f} values are not whole blocks of {block}"
        )
    blocks_per_row = in_f // block
    raw = np.asarray(data).reshape(-1)
    if raw.dtype != np.uint8:
        raise StagewiseError(f"{name}: {type_name} data must be raw bytes, got {raw.dtype}")
    expected = out_f * blocks_per_row * block_bytes
    if raw.size != expected:
        raise StagewiseError(
            f"{name}: {type_name} data holds {raw.size} bytes, a [{out_f}, {in_f}] matrix needs "
            f"{expected} (truncated or corrupt?)"
        )
    blocks = raw.reshape(out_f, blocks_per_row, block_bytes)  # [N, K/block, bytes per block]
    if type_name in K_KEPT:
        w = packed_from_k_blocks(blocks, type_name)
        _check_finite(w, name, type_name)
        return w

    def f16(start: int) -> torch.Tensor:  # [N, K/32] float16 from two bytes of every block
        return torch.from_numpy(
            np.ascontiguousarray(blocks[:, :, start : start + 2]).view(np.float16)[..., 0]
        )

    start = 4 if kind == "q4_1" else 2  # where the codes begin in a block
    codes = np.ascontiguousarray(blocks[:, :, start:]).reshape(out_f, -1)  # [N, K/2] or [N, K]
    codes = torch.from_numpy(codes.view(np.int8) if kind == "q8_0" else codes)
    scales, mins = f16(0), f16(2) if kind == "q4_1" else None
    w = PackedWeight(kind, codes, scales, mins)
    _check_finite(w, name, type_name)
    return w


def _check_finite(w: PackedWeight, name: str, type_name: str) -> None:
    for part, t in (("scales", w.scales), ("mins", w.mins)):
        if t is not None and not torch.isfinite(t).all():
            raise StagewiseError(f"{name}: {type_name} {part} hold NaN or infinite values")
