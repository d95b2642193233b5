"""K-quant blocks (Q4_K, Q5_K, Q6_K) for tests: random valid bytes, or a simple round-to-nearest.

`gguf` ships dequantizers for the K-quants but no quantizers, so tests make the bytes here:
`random_blocks` fills every byte at random and then writes finite float16 d / dmin (all code and
sub-scale bit patterns occur); `quantize_k` packs float rows by a plain round-to-nearest (not
llama.cpp's search for the best scales; any valid bytes do for tests that compare two ways of
reading the same file). `gguf.quants.dequantize` is the reference that reads them back.
"""

import gguf
import numpy as np

QK_K = 256
BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def random_blocks(num_rows: int, row_len: int, type_name: str, seed: int = 0) -> np.ndarray:
    """[num_rows, row_len / 256 * bytes] uint8: random bytes with finite float16 d (and dmin)."""
    gen = np.random.default_rng(seed)
    nb = row_len // QK_K
    blocks = gen.integers(0, 256, size=(num_rows, nb, BYTES[type_name]), dtype=np.uint8)
    d = (gen.standard_normal((num_rows, nb, 2)) * 0.01).astype(np.float16)  # finite, either sign
    at = 208 if type_name == "Q6_K" else 0
    count = 1 if type_name == "Q6_K" else 2
    blocks[..., at : at + 2 * count] = d[..., :count].view(np.uint8).reshape(num_rows, nb, -1)
    return blocks.reshape(num_rows, -1)


def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """[B, 8] six-bit sc, mn -> [B, 12] bytes (the layout `quant/gguf_kquants.py` reads)."""
    a = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    b = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    c = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return np.concatenate([a, b, c], axis=1).astype(np.uint8)


def _q45_k(x: np.ndarray, bits: int) -> np.ndarray:
    """x [B, 256] -> Q4_K / Q5_K blocks [B, 144 or 176]."""
    nmax = (1 << bits) - 1
    g = x.reshape(-1, 8, 32)
    lo = np.minimum(g.min(-1), 0)  # the format's minimum is <= 0 (stored as -dmin * mn)
    s = (g.max(-1) - lo) / nmax  # [B, 8]
    d = (s.max(-1) / 63).astype(np.float16)
    dmin = (-lo.min(-1) / 63).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(s, d32, out=np.zeros_like(s), where=d32 > 0)), 0, 63)
    mn = np.clip(np.round(np.divide(-lo, dmin32, out=np.zeros_like(s), where=dmin32 > 0)), 0, 63)
    scale, mins = d32 * sc, dmin32 * mn  # [B, 8]
    q = np.divide(g + mins[..., None], scale[..., None], out=np.zeros_like(g), where=scale[..., None] > 0)
    q = np.clip(np.round(q), 0, nmax).astype(np.uint8).reshape(-1, 4, 2, 32)  # pairs of groups
    qs = ((q[:, :, 0] & 15) | ((q[:, :, 1] & 15) << 4)).reshape(-1, 128)
    parts = [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2)]
    parts.append(_pack_scales(sc.astype(np.uint8), mn.astype(np.uint8)))
    if bits == 5:
        high = (q.reshape(-1, 8, 32) >> 4) & 1  # [B, group s, value j] -> bit s of byte j
        parts.append((high << np.arange(8, dtype=np.uint8)[:, None]).sum(1).astype(np.uint8))
    parts.append(qs)
    return np.concatenate(parts, axis=1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    """x [B, 256] -> Q6_K blocks [B, 210]."""
    g = x.reshape(-1, 16, 16)
    s = np.abs(g).max(-1) / 31  # [B, 16]
    d = (s.max(-1) / 127).astype(np.float16)
    d32 = d.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(s, d32, out=np.zeros_like(s), where=d32 > 0)), -128, 127)
    scale = (d32 * sc)[..., None]
    q = np.round(np.divide(g, scale, out=np.zeros_like(g), where=scale != 0))
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8)  # [B, 16, 16] codes 0..63
    v = q.reshape(-1, 2, 128)  # [B, half h, 128 values]
    low = v.reshape(-1, 2, 2, 64) & 15  # value h*128 + nib*64 + j
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    high = (v.reshape(-1, 2, 4, 32) >> 4) & 3  # value h*128 + s*32 + j
    qh = (high << (2 * np.arange(4, dtype=np.uint8))[:, None]).sum(2).astype(np.uint8).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), d.view(np.uint8).reshape(-1, 2)], axis=1)


def quantize_k(rows: np.ndarray, type_name: str) -> np.ndarray:
    """rows [N, K] float32 (K a multiple of 256) -> [N, K / 256 * bytes] uint8 blocks."""
    n, k = rows.shape
    x = np.ascontiguousarray(rows, dtype=np.float32).reshape(-1, QK_K)
    blocks = _q6_k(x) if type_name == "Q6_K" else _q45_k(x, 5 if type_name == "Q5_K" else 4)
    return blocks.reshape(n, -1)


def dequantize_reference(blocks: np.ndarray, type_name: str) -> np.ndarray:
    return np.asarray(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[type_name]))
