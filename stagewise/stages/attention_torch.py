"""The torch tier of attention (contiguous layout): the reference's arithmetic, fewer calls.

    q [Tq, H, d], k [Tk, Hkv, d], v [Tk, Hkv, d], metadata -> out [Tq, H, d]

`attention.naive` spells every regrouping out with `einops.rearrange`, so a
reader sees which axes move; each one is a Python parse and a few PyTorch
calls, five per sequence per layer. This tier runs the same products on the
same layouts, with the regroupings written as the views and permutes they
stand for, so the numbers are the reference's bit for bit (a fused
`scaled_dot_product_attention` would sum in another order: 1e-7 apart,
enough to flip a greedy token where two logits nearly tie, which it did on
one of `bench quant`'s prompts with the packed model).

A decode row (one query row that sees every key) is the exception: it runs
`chunked_decode.decode_rows`, attention over fixed-size chunks of keys, the
same function the paged tier's decode uses. Its sums run in another order
than the reference's (within float32 rounding of it, not bit for bit), and in
exchange a row gets the same bits in `mode="kv"` and `mode="paged"`, alone or
batched: with packed weights, whose bfloat16 activations turn a 1e-8
difference into a flipped rounding and sometimes a flipped greedy token, that
is what keeps the engine modes' tokens identical.

A prefill (several query rows) keeps the reference's bottom-right causal
mask; rows that may see no key (the padding rows of static batching) are
zeros, as there. One decode step of SmolLM2-135M in `mode="kv"` dispatches
about 1000 fewer PyTorch calls with this tier, the KV store's and the
norm's (2649 -> 1652, counted with a TorchDispatchMode).
"""

import torch
import torch.nn.functional as F

from stagewise.stages.attention_metadata import AttentionMetadata
from stagewise.stages.chunked_decode import decode_rows, padded_length


def decode_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query row that sees all its keys: q [1, H, d], k/v [Lk, Hkv, d] -> [1, H, d] float32.

    Over fixed-size chunks of keys (`chunked_decode`), as the paged tier decodes: the same bits.
    """
    len_k = k.shape[0]
    pad = padded_length(len_k) - len_k  # keys to whole chunks; the padding is masked
    kp = F.pad(k.float(), (0, 0, 0, 0, 0, pad)).unsqueeze(0)  # [1, S, Hkv, d]
    vp = F.pad(v.float(), (0, 0, 0, 0, 0, pad)).unsqueeze(0)
    real = (torch.arange(len_k + pad, device=k.device) < len_k).unsqueeze(0)  # [1, S]
    return decode_rows(q.float(), kp, vp, real, scale)  # [1, H, d]


def prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Lq, H, d] (the last Lq positions), k/v [Lk, Hkv, d] -> [Lq, H, d] float32.

    `attention.causal_attention_one_sequence` step for step, its einops regroupings written as
    the views and permutes they stand for: the same layouts into the same products, same bits.
    """
    len_q, num_heads, head_dim = q.shape
    len_k, num_kv_heads = k.shape[:2]
    group = num_heads // num_kv_heads
    qg = q.float().view(len_q, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    qg = qg.reshape(num_kv_heads, group * len_q, head_dim)  # [Hkv, g*Lq, d] (a copy)
    scores = torch.bmm(qg, k.float().permute(1, 2, 0)) * scale  # -> [Hkv, g*Lq, Lk]
    scores = scores.view(num_kv_heads, group, len_q, len_k)  # [Hkv, g, Lq, Lk]
    i = torch.arange(len_q, device=q.device).unsqueeze(1)  # [Lq, 1]
    allowed = torch.arange(len_k, device=q.device) <= i + (len_k - len_q)  # [Lq, Lk] causal
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    probs = torch.where(allowed.any(dim=-1, keepdim=True), probs, 0.0)  # no key seen -> 0
    probs = probs.view(num_kv_heads, group * len_q, len_k)  # [Hkv, g*Lq, Lk]
    out = torch.bmm(probs, v.float().permute(1, 0, 2))  # @ [Hkv, Lk, d] -> [Hkv, g*Lq, d]
    out = out.view(num_kv_heads, group, len_q, head_dim).permute(2, 0, 1, 3)  # [Lq, Hkv, g, d]
    return out.reshape(len_q, num_heads, head_dim)  # [Lq, H, d]


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
