"""The torch tier of attention (contiguous layout): a decode row in one fused PyTorch call.

    q [Tq, H, d], k [Tk, Hkv, d], v [Tk, Hkv, d], metadata -> out [Tq, H, d]

`attention.naive` takes every sequence through the textbook formula: a
regrouping of q, two batched matrix products, a scale, a softmax, and the
einops rearranges between them, about a dozen PyTorch calls (and as many
einops parses) per sequence per layer. In a decode step a sequence has one
query row, and that row sees every key, so there is no mask to build: the
G query heads that share a KV head are G rows of one [G, Lk] problem, and
PyTorch's fused `scaled_dot_product_attention` does it in one call, reading
the sequence's keys where the cache holds them (a strided view, no copy):

    q [1, H, d] -> [Hkv, G, d];  k [Lk, Hkv, d] -> [Hkv, Lk, d] (view)
    softmax(q k^T * scale) v -> [Hkv, G, d] -> [1, H, d]

A sequence with several query rows (a prefill) is one fused call too, with
the heads grouped by the call itself (`enable_gqa`: query head h reads KV
head h // G, the reference's index map) and the bottom-right causal rule of
`attention.py` as a [Lq, Lk] mask (none when Lq == Lk: the square's causal
triangle). Rows that may see no key (Lq > Lk, the padding rows of static
batching) are zeros, as in the reference.

The fused kernel sums in another order than the reference's two matrix
products, so the two agree to float32 rounding (about 1e-7), not bit for bit.
Measured on a 2-core AMD EPYC, SmolLM2-135M's heads, one decode row over 100
keys, one thread, while other jobs loaded the machine (load average ~7, so
the absolute times are inflated): see the commit that introduced this tier.
"""

import torch
import torch.nn.functional as F

from stagewise.stages.attention_metadata import AttentionMetadata


def decode_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query row that sees all its keys: q [1, H, d], k/v [Lk, Hkv, d] -> [1, H, d]."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k.shape[1]
    qg = q.view(num_kv_heads, num_heads // num_kv_heads, head_dim)  # [Hkv, G, d]
    out = F.scaled_dot_product_attention(
        qg.float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(), scale=scale
    )  # [Hkv, G, d] @ [Hkv, d, Lk] -> [Hkv, G, Lk] -> softmax @ [Hkv, Lk, d] -> [Hkv, G, d]
    return out.view(1, num_heads, head_dim)  # [1, H, d], float32


def prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Lq, H, d] (the last Lq positions), k/v [Lk, Hkv, d] -> [Lq, H, d] float32."""
    len_q, len_k = q.shape[0], k.shape[0]
    out = q.new_zeros(q.shape, dtype=torch.float32)  # rows that see no key stay zero
    first = max(0, len_q - len_k)  # query i sees key j iff j <= i + (Lk - Lq): rows < first none
    if first == len_q:
        return out
    qs = q[first:].transpose(0, 1).float()  # [H, Lq', d] with Lq' = Lq - first <= Lk
    mask = None
    if len_q - first != len_k:  # a chunk on a cached prefix: the bottom-right causal rule
        i = torch.arange(first, len_q, device=q.device).unsqueeze(1)  # [Lq', 1]
        mask = torch.arange(len_k, device=q.device) <= i + (len_k - len_q)  # [Lq', Lk] bool
    out[first:] = F.scaled_dot_product_attention(
        qs,
        k.transpose(0, 1).float(),  # [Hkv, Lk, d]
        v.transpose(0, 1).float(),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    ).transpose(0, 1)  # [H, Lq', d] -> [Lq', H, d]
    return out


def attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Same arguments and result as `attention.naive`: each sequence in one fused call."""
    m = metadata
    cu_q, cu_k, lens = m.cu_seqlens_q_host, m.cu_seqlens_k_host, m.seq_lens_host
    if m.num_seqs == 1 and cu_q[1] == 1 and lens[0] >= 1:  # one sequence, one decode row
        kb = k[cu_k[0] : cu_k[0] + lens[0]]  # [Lk, Hkv, d], a view
        return decode_row(q, kb, v[cu_k[0] : cu_k[0] + lens[0]], scale).to(q.dtype)
    out = torch.empty_like(q)
    for b in range(m.num_seqs):
        q_start, q_end, k_start = cu_q[b], cu_q[b + 1], cu_k[b]
        if q_end == q_start:
            continue
        kb = k[k_start : k_start + lens[b]]  # [Lk, Hkv, d], a view
        vb = v[k_start : k_start + lens[b]]
        if q_end - q_start == 1 and lens[b] >= 1:
            out[q_start:q_end] = decode_row(q[q_start:q_end], kb, vb, scale)
        else:
            out[q_start:q_end] = prefill(q[q_start:q_end], kb, vb, scale)
    return out
