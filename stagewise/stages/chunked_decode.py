"""Decode rows over fixed-size key chunks: a sequence's bits do not depend on its neighbours.

    q [D, H, d], k / v [D, S, Hkv, d] (S a multiple of CHUNK_KEYS), real [D, S] -> out [D, H, d]

One decode row per sequence, D sequences, each padded to S keys. The textbook
row `softmax(q k^T * scale) v` summed over the padded S keys in one call
(one `scaled_dot_product_attention`, or one matmul over S) adds its terms in an
order that depends on S, which is the *longest* sequence of the batch: the
same request then gives outputs ~1e-8 apart alone and batched. With float
weights that rarely matters; with packed weights the activations are rounded
to bfloat16 (8 bits) before every GEMM, so a 1e-8 change can move one
rounding, that 1/256 step grows through 30 layers, and a greedy token whose
two best logits nearly tie flips.

So the keys are cut at absolute positions 0, C, 2C, ... (C = CHUNK_KEYS) and
every product has the same shape, whatever the batch:

    scores [G, C] = q [G, d] @ k_c^T [d, C]        a batched matmul, batch = D x Hkv x chunks
    m   = max over all chunks                      (a max is exact in any order)
    p   = exp(scores - m)                          padding keys -> exactly 0
    l_c = sum over the C keys of p                 a fixed-length sum
    o_c = p [G, C] @ v_c [C, d]                    a fixed-shape product
    out = (o_0 + o_1 + ...) / (l_0 + l_1 + ...)    added in chunk order (a prefix sum)

A chunk wholly past a sequence's end adds exact zeros, so padding to a longer
neighbour changes no bit; the batched matmul computes each of its matrices
alone (its numbers do not depend on the batch count, which
tests/stages/test_paged_decode_batched.py checks along with alone == batched).
This is flash decoding's split-KV with a fixed split *size* instead of a fixed
number of splits: the rule batch-invariant kernels follow. The paged tier
(`paged_attention_torch.py`) and the contiguous tier (`attention_torch.py`)
both call it, so `mode="kv"` and `mode="paged"` decode the same bits.
"""

import torch

CHUNK_KEYS = 64  # keys per chunk: fixed, so a row's sums never depend on its neighbours


def padded_length(num_keys: int) -> int:
    """The keys rounded up to whole chunks: 21 -> 64, 64 -> 64, 65 -> 128."""
    return -(-num_keys // CHUNK_KEYS) * CHUNK_KEYS


def decode_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, real: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [D, H, d], k / v [D, S, Hkv, d], real [D, S] bool (True: a key) -> [D, H, d], q.dtype."""
    num_seqs, num_heads, head_dim = q.shape
    padded, num_kv_heads = k.shape[1:3]
    chunks = padded // CHUNK_KEYS
    shape = (num_seqs, chunks, CHUNK_KEYS, num_kv_heads, head_dim)
    kc = k.reshape(shape).permute(0, 3, 1, 4, 2).float().contiguous()  # -> [D, Hkv, chunks, d, C]
    vc = v.reshape(shape).permute(0, 3, 1, 2, 4).float().contiguous()  # -> [D, Hkv, chunks, C, d]
    qg = q.float().view(num_seqs, num_kv_heads, 1, num_heads // num_kv_heads, head_dim)
    scores = torch.matmul(qg, kc) * scale  # [D,Hkv,1,G,d] @ [D,Hkv,n,d,C] -> [D,Hkv,n,G,C]
    mask = real.to(scores.device).view(num_seqs, 1, chunks, 1, CHUNK_KEYS)  # over heads and rows
    scores = scores.masked_fill(~mask, float("-inf"))
    top = scores.amax(dim=(2, 4), keepdim=True)  # [D, Hkv, 1, G, 1]: the row's max
    probs = torch.exp(scores - top)  # [D, Hkv, n, G, C]; padding -> exactly 0
    sums = probs.sum(dim=-1, keepdim=True)  # [D, Hkv, n, G, 1]: C terms each
    parts = torch.matmul(probs, vc)  # [D, Hkv, n, G, C] @ [D, Hkv, n, C, d] -> [D, Hkv, n, G, d]
    # the chunks' shares added in chunk order (a prefix sum runs in order): zeros past the end
    out = parts.cumsum(dim=2)[:, :, -1] / sums.cumsum(dim=2)[:, :, -1]  # [D, Hkv, G, d]
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)  # [D, H, d]
