"""The torch tier of attention (contiguous layout): every row over fixed-size key chunks.

    q [Tq, H, d], k [Tk, Hkv, d], v [Tk, Hkv, d], metadata -> out [Tq, H, d]

`attention.naive` multiplies each sequence's queries by all its keys in one
product. The CPU BLAS picks its kernel by that product's shape, so a query
row gets other bits as a decode row (1 query), as row 5 of a 64-row prefill
chunk, or beside a longer prompt: 2-3e-7 apart, which with packed weights
(bfloat16 activations) flips a greedy token where two logits nearly tie. A
330-token prompt prefilled whole and in 64-row chunks differed on 155 rows.

This tier runs every sequence's rows, decode and prefill alike, through
`chunked_attention.sequence_rows`: each row over the same fixed 64-key chunks,
summed in chunk order, in products whose row count is padded to the BLAS's
M >= 4 kernels. A row's bits are then the same whatever the call: decode or
prefill, the chunking of its prompt, a speculative verify, `mode="kv"` or
`mode="paged"` (whose tier calls the same function), alone or batched. They
are within float32 rounding of the reference, not its bits (the reference's
single product adds in another order).

The cost (notebook 17 times both forms; `stagewise bench invariance` the
engine): a prefill of 64-128 rows takes about 2x the reference's products
(the per-chunk sums and parts are extra passes, and a decode row pads its G
query heads to 4 rows); the gap narrows as the products grow. With
`LLM(batch_invariant=False)` the prefill rows run `prefill` below instead:
the reference's products on the same layouts, its bits, without einops'
per-call parsing (64 rows over 128 keys 0.62 -> 0.44 ms against the
reference) — faster, and the row's bits then depend on its call.

One decode step of SmolLM2-135M in `mode="kv"` dispatches about 1000 fewer
PyTorch calls with this tier than with the reference (the KV store's and the
norm's; counted with a TorchDispatchMode).
"""

import torch

from stagewise.cpu import attention as cpu_attention
from stagewise.stages.attention_metadata import AttentionMetadata
from stagewise.stages.chunked_attention import sequence_rows


def prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Lq, H, d] (the last Lq positions), k/v [Lk, Hkv, d] -> [Lq, H, d] float32.

    `attention.causal_attention_one_sequence` step for step, its einops regroupings written as
    the views and permutes they stand for: the same layouts into the same products, same bits.
    The batch-variant path (`batch_invariant=False`): a row's bits depend on Lq and Lk.
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


def sequence_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, batch_invariant: bool = True
) -> torch.Tensor:
    """One sequence: q [Lq, H, d] (its last Lq positions), k/v [Lk, Hkv, d] -> [Lq, H, d] f32.

    Every row over fixed key chunks; with `batch_invariant=False` a prefill (Lq > 1) runs the
    reference's single product instead (faster, and its rows' bits depend on the call).
    """
    if batch_invariant and cpu_attention.serves(q, k):  # the compiled CPU loop (cpu/attention.py)
        return cpu_attention.sequence(q, k, v, scale)  # [Lq, H, d]
    if batch_invariant or q.shape[0] == 1 and k.shape[0] >= 1:
        return sequence_rows(q, k, v, scale)  # [Lq, H, d]
    return prefill(q, k, v, scale)  # [Lq, H, d]


def _attention(q, k, v, metadata: AttentionMetadata, scale: float, batch_invariant: bool):
    m = metadata
    cu_q, cu_k, lens = m.cu_seqlens_q_host, m.cu_seqlens_k_host, m.seq_lens_host
    if m.num_seqs == 1 and cu_q[1] == q.shape[0]:  # one sequence: no copy into `out`
        kb, vb = k[cu_k[0] : cu_k[0] + lens[0]], v[cu_k[0] : cu_k[0] + lens[0]]  # [Lk, Hkv, d]
        return sequence_attention(q, kb, vb, scale, batch_invariant).to(q.dtype)
    out = torch.empty_like(q)
    for b in range(m.num_seqs):
        q_start, q_end, k_start = cu_q[b], cu_q[b + 1], cu_k[b]
        if q_end == q_start:
            continue
        kb = k[k_start : k_start + lens[b]]  # [Lk, Hkv, d], a view
        vb = v[k_start : k_start + lens[b]]
        out[q_start:q_end] = sequence_attention(q[q_start:q_end], kb, vb, scale, batch_invariant)
    return out


def attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Same arguments and result as `attention.naive`: every row over fixed key chunks."""
    return _attention(q, k, v, metadata, scale, batch_invariant=True)


def attention_torch_variant(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """`batch_invariant=False`: decode rows over fixed key chunks, prefills in one product."""
    return _attention(q, k, v, metadata, scale, batch_invariant=False)
