"""GGUF's K-quant super-blocks (Q4_K, Q5_K, Q6_K) -> plain groups with float32 scales, exactly.

A K-quant block covers 256 consecutive weights of a row (llama.cpp's QK_K):

    Q4_K  144 bytes: d, dmin (float16) | 12 bytes: 8 six-bit scales sc, 8 six-bit mins mn
                     | 128 bytes: 256 four-bit codes
    Q5_K  176 bytes: as Q4_K, plus 32 bytes holding the fifth bit of every code
    Q6_K  210 bytes: 128 bytes of low 4 bits | 64 bytes of high 2 bits
                     | 16 int8 scales sc | d (float16)

Inside the block, group g (32 values for Q4_K/Q5_K, 16 for Q6_K) is

    Q4_K, Q5_K:  w = (d * sc[g]) * q - (dmin * mn[g])
    Q6_K:        w = (d * sc[g]) * (q - 32)

llama.cpp's reference (`gguf.quants.dequantize`) forms the products d * sc
and dmin * mn in float32; an 11-bit float16 mantissa times an integer of at
most 8 bits fits float32's 24 bits, so those products are exact and can be
stored as one float32 scale (and minimum, negated) per group. The weights
then follow by the plain group formula of `quant/dequantize.py`, the same
float32 operations as the reference: the same bits.

The codes are unpacked to one per value, then stored in the PackedWeight
layouts (`quant/packed_weight.py`): q4_k repacks them two per byte in the
group order q4_1 uses, q5_k keeps a byte per code (int8, 0..31), q6_k a signed byte q - 32.
"""

import numpy as np
import torch

from stagewise.quant.packed_weight import PackedWeight

SUPER_BLOCK = 256  # values per K-quant block (QK_K)
K_KEPT = {"Q4_K": ("q4_k", 144), "Q5_K": ("q5_k", 176), "Q6_K": ("q6_k", 210)}


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """[N, B] float32 from the two bytes at `start` of every block (a float16 in the file)."""
    return (
        np.ascontiguousarray(blocks[..., start : start + 2])
        .view(np.float16)[..., 0]
        .astype(np.float32)
    )


def _scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 bytes of Q4_K / Q5_K sub-scales [N, B, 12] -> (sc, mn) [N, B, 8] each, 0..63.

    Bytes 0-3 hold sc[0..3] in their low 6 bits, bytes 4-7 mn[0..3]; groups 4-7 take their low
    4 bits from bytes 8-11 (sc low nibble, mn high nibble) and their top 2 bits from the top 2
    bits of bytes 0-3 (sc) and 4-7 (mn).
    """
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]  # [N, B, 4] each
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=-1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc, mn


def _low_nibbles(qs: np.ndarray) -> np.ndarray:
    """128 bytes per block [N, B, 128] -> 256 four-bit codes [N, B, 256].

    Each run of 32 bytes serves two groups: the low nibbles are group 2c, the high ones 2c + 1.
    """
    qs = qs.reshape(*qs.shape[:-1], 4, 1, 32)  # [N, B, 4 pairs of groups, 1, 32]
    nibbles = (qs >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 0x0F  # [N, B, 4, 2, 32]
    return nibbles.reshape(*qs.shape[:-3], SUPER_BLOCK)


def _codes_q4_k_q5_k(blocks: np.ndarray, five_bits: bool) -> np.ndarray:
    """[N, B, bytes] -> codes [N, B, 256] uint8 (0..15, or 0..31 with the fifth bit)."""
    if not five_bits:
        return _low_nibbles(blocks[..., 16:144])
    low = _low_nibbles(blocks[..., 48:176])
    qh = blocks[..., 16:48][..., None, :]  # [N, B, 1, 32]: bit s of byte j is group s, value j
    high = (qh >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1  # [N, B, 8, 32]
    return low | (high.reshape(low.shape) << 4)


def _codes_q6_k(blocks: np.ndarray) -> np.ndarray:
    """[N, B, 210] -> q - 32 as int8 [N, B, 256] (q = 4 low bits | 2 high bits << 4, 0..63)."""
    lead = blocks.shape[:-1]
    ql = blocks[..., 0:128].reshape(*lead, 2, 1, 64)  # two halves of 128 values
    low = (ql >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 0x0F  # [N, B, 2, 2, 64]
    qh = blocks[..., 128:192].reshape(*lead, 2, 1, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 0x03  # [N, B, 2, 4, 32]
    q = low.reshape(*lead, SUPER_BLOCK) | (high.reshape(*lead, SUPER_BLOCK) << 4)
    return (q.astype(np.int16) - 32).astype(np.int8)


def _pack_nibbles(codes: np.ndarray, group: int = 32) -> np.ndarray:
    """[N, K] codes 0..15 -> [N, K/2] bytes, q4_1's order: byte i of a group = value i | i + G/2."""
    g = codes.reshape(codes.shape[0], -1, group)
    return (g[..., : group // 2] | (g[..., group // 2 :] << 4)).reshape(codes.shape[0], -1)


def packed_from_k_blocks(blocks: np.ndarray, type_name: str) -> PackedWeight:
    """K-quant blocks [N, K/256, bytes] (uint8) of an [N, K] = [out, in] matrix -> PackedWeight.

    Returns the weight unchecked for finiteness: the caller refuses NaN / infinite scales (a
    corrupt file's inf * 0 is NaN, quietly: the refusal is the one line the user sees).
    """
    with np.errstate(all="ignore"):
        return _packed_from_k_blocks(blocks, type_name)


def _packed_from_k_blocks(blocks: np.ndarray, type_name: str) -> PackedWeight:
    kind, _ = K_KEPT[type_name]
    n = blocks.shape[0]
    if kind == "q6_k":
        sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)
        scales = (_f16(blocks, 208)[..., None] * sc).reshape(n, -1)  # [N, K/16], exact
        codes = _codes_q6_k(blocks).reshape(n, -1)  # [N, K] int8, -32..31
        return PackedWeight(kind, torch.from_numpy(codes), torch.from_numpy(scales))
    sc, mn = _scales_and_mins(blocks[..., 4:16])  # [N, B, 8] each
    scales = (_f16(blocks, 0)[..., None] * sc.astype(np.float32)).reshape(n, -1)  # [N, K/32]
    mins = -(_f16(blocks, 2)[..., None] * mn.astype(np.float32)).reshape(n, -1)  # exact, negated
    codes = _codes_q4_k_q5_k(blocks, five_bits=kind == "q5_k").reshape(n, -1)  # [N, K] uint8
    # q4_k: [N, K/2], two codes per byte; q5_k: [N, K] one code 0..31 per (signed) byte
    codes = _pack_nibbles(codes) if kind == "q4_k" else codes.view(np.int8)
    return PackedWeight(
        kind,
        torch.from_numpy(np.ascontiguousarray(codes)),
        torch.from_numpy(np.ascontiguousarray(scales)),
        torch.from_numpy(np.ascontiguousarray(mins)),
    )
