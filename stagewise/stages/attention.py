"""Stage 6: causal self-attention over a flattened, variable-length batch.

    q [Tq, H, d], k [Tk, Hkv, d], v [Tk, Hkv, d] -> out [Tq, H, d]

    out = softmax(q k^T * scale + causal_mask) v        per sequence, per head

Variable length: sequences are packed end to end, no padding. The step's
`AttentionMetadata` (`stages/attention_metadata.py`, built once per step) says
where: sequence b owns query rows `cu_seqlens_q[b] : cu_seqlens_q[b+1]` and
`seq_lens[b]` key/value rows starting at `cu_seqlens_k[b]` (so a cache with
spare capacity per sequence needs no copy). It holds these lengths as host
ints too, so neither tier reads a device tensor back to size its work.

Causal mask, aligned bottom-right: when a sequence has Lq queries and Lk keys,
its queries are the *last* Lq positions, so query i may see key j iff
`j <= i + (Lk - Lq)`. The same rule covers prefill (Lq == Lk), decode with a
KV cache (Lq == 1) and a prefill chunk on top of a cached prefix. A query
row that may see no key at all (possible only when Lq > Lk, e.g. the padding
rows of static batching) gets zeros, not NaN.

GQA by index map, never by copying K/V: query head h reads KV head
`h // (H // Hkv)`. The naive reference expresses that map by regrouping q as
[Hkv, group * Lq, d] (`einops.rearrange`, so the reader sees which axes move):
the query rows of the `group` heads that share a KV head become the rows of
one matrix product with that head's K (a strided view).

The naive reference materialises the full [Lq, Lk] score matrix per head, one
sequence at a time; the Triton FlashAttention kernel never does (tiles +
online softmax).

What the kernel (`kernels/flash_attention.py`) does differently: one program
holds a tile of BLOCK_M query rows of one KV head's GQA group in registers
(rows are (query, group head) pairs, so the heads that share K/V share the
tile) and streams the sequence's K/V past it BLOCK_N keys at a time. It cannot
take a softmax over a row it never holds whole, so it keeps a running max m, a
running sum l and an accumulator acc per row; each new tile raises m if
needed, rescales l and acc by exp(m_old - m_new) and adds its own
exp(s - m_new) terms (the online softmax, `kernels/attention_common.py`). At
the end out = acc / l. The naive path writes S and P, O(N^2) extra memory per
head, and reads them back; the kernel needs O(N) extra memory (m and l per
row). Its HBM traffic is not O(N): K/V are re-read once per query tile,
Theta(N^2 d / BLOCK_M) elements per head, which with BLOCK_M ~ M / d for an
on-chip memory of M is Dao et al.'s Theta(N^2 d^2 / M) — quadratic, but far
below the naive path's N^2 score round trips (notebook 05 counts both). In
decode a tile is one query's whole GQA group, so K/V are read once per KV head,
not once per query head. Causal tiles stop at the diagonal, so keys no query of
the tile may see are never loaded.

The torch tier (`stages/attention_torch.py`) reduces every query row over
fixed 64-key chunks, in products padded to the same BLAS kernel
(`stages/chunked_attention.py`): a row's bits are the same in a decode, a
prefill, a prefill chunk or a speculative verify, alone or batched — the
house rule of batch invariance. This reference is left the textbook's one
product per sequence, on purpose: it is the formula a student reads first, and
its rows' bits depend on the call (the CPU BLAS picks its kernel by the
product's shape: one query row, 2-3 rows, 4 and more). Measured on
SmolLM2-135M in float32 with `backend="naive"` (whose GEMMs, `x @ w`, add
their own M-dependence): three prompts, 6 greedy tokens each, alone and
batched together — the same tokens, log-probabilities up to 3e-5 apart; a
greedy token parts from the run alone where two logits tie that closely.
`tests/stages/test_batch_invariance_ops.py` keeps this path as a case the
per-op sweep must see fail.
"""

import torch
from einops import rearrange

from stagewise.config import ModelConfig
from stagewise.stages import attention_torch
from stagewise.stages.attention_metadata import AttentionMetadata
from stagewise.stages.base import Stage


def causal_attention_one_sequence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """One sequence: q [Lq, H, d] (its last Lq positions), k/v [Lk, Hkv, d] -> [Lq, H, d] fp32."""
    len_q, len_k = q.shape[0], k.shape[0]
    num_kv_heads = k.shape[1]
    # the query heads that share KV head j are heads j*g .. j*g + g-1: one matrix per KV head
    qg = rearrange(q.float(), "lq (hkv g) d -> hkv (g lq) d", hkv=num_kv_heads)  # [Hkv, g*Lq, d]
    kt = rearrange(k.float(), "lk hkv d -> hkv d lk")  # [Hkv, d, Lk], a strided view: no copy
    scores = torch.bmm(qg, kt) * scale  # [Hkv, g*Lq, d] @ [Hkv, d, Lk] -> [Hkv, g*Lq, Lk]
    scores = rearrange(scores, "hkv (g lq) lk -> hkv g lq lk", lq=len_q)  # [Hkv, g, Lq, Lk]
    if len_q > 1 or len_q > len_k:  # one query at the end sees every key: no mask needed
        i = torch.arange(len_q, device=q.device).unsqueeze(1)  # [Lq, 1]
        j = torch.arange(len_k, device=q.device).unsqueeze(0)  # [1, Lk]
        allowed = j <= i + (len_k - len_q)  # [Lq, Lk] causal, bottom-right aligned
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # [Hkv, g, Lq, Lk]
        # rows that may see no key -> 0, not NaN
        probs = torch.where(allowed.any(dim=-1, keepdim=True), probs, 0.0)
    else:
        probs = torch.softmax(scores, dim=-1)  # [Hkv, g, 1, Lk]
    probs = rearrange(probs, "hkv g lq lk -> hkv (g lq) lk")  # [Hkv, g*Lq, Lk]
    vt = rearrange(v.float(), "lk hkv d -> hkv lk d")  # [Hkv, Lk, d], a strided view
    out = torch.bmm(probs, vt)  # [Hkv, g*Lq, Lk] @ [Hkv, Lk, d] -> [Hkv, g*Lq, d]
    return rearrange(out, "hkv (g lq) d -> lq (hkv g) d", lq=len_q)  # [Lq, H, d]


def naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q [Tq, H, d], k/v [Tk, Hkv, d] in the contiguous layout of `metadata` -> [Tq, H, d].

    One sequence at a time, each with its own exact shapes: a request's numbers never depend on
    which other requests share the batch (so continuous batching gives the tokens of a run alone).
    The offsets come from the metadata's host ints: slicing with them reads nothing back.
    """
    m = metadata
    out = torch.empty_like(q)
    cu_q, cu_k, lens = m.cu_seqlens_q_host, m.cu_seqlens_k_host, m.seq_lens_host
    for b in range(m.num_seqs):
        q_start, q_end, k_start = cu_q[b], cu_q[b + 1], cu_k[b]
        if q_end == q_start:
            continue
        kb = k[k_start : k_start + lens[b]]  # [Lk, Hkv, d], a view
        vb = v[k_start : k_start + lens[b]]
        out[q_start:q_end] = causal_attention_one_sequence(q[q_start:q_end], kb, vb, scale)
    return out


def triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    batch_invariant: bool = True,
) -> torch.Tensor:
    """Triton FlashAttention: K/V tiles stream past a query tile, online softmax, no [Lq, Lk].

    The kernel reads the offsets on the device; only `max_q_len` (a host int) sizes the grid.
    batch_invariant: one tile for every query length and each row's keys in fixed chunks
    (kernels/attention_common.py): a row's bits are the same decoded or prefilled, and the same
    as the paged kernel's.
    """
    # lazily: importing kernels picks GPU or interpreter
    from stagewise.kernels.flash_attention import flash_attention

    m = metadata
    return flash_attention(
        q, k, v, m.cu_seqlens_q, m.cu_seqlens_k, scale, m.seq_lens, max_q_len=m.max_q_len,
        batch_invariant=batch_invariant,
    )  # fmt: skip


def triton_variant(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """`batch_invariant=False`: decode and prefill tiles of their own, decode keys split by
    occupancy on a GPU."""
    return triton(q, k, v, metadata, scale, batch_invariant=False)  # [Tq, H, d]


def example_inputs(config: ModelConfig, num_tokens: int, device, dtype) -> dict:
    """Up to three sequences; the later ones sit on a cached prefix (more keys than queries)."""
    gen = torch.Generator().manual_seed(0)
    cuts = sorted({0, num_tokens, max(1, num_tokens // 3), max(1, (2 * num_tokens) // 3)})
    q_lens = [b - a for a, b in zip(cuts, cuts[1:])]
    prefixes = [0, 5, 17][: len(q_lens)]
    k_lens = [lq + p for lq, p in zip(q_lens, prefixes)]
    cu_k = torch.tensor([0] + k_lens).cumsum(0)
    q = torch.randn(num_tokens, config.num_heads, config.head_dim, generator=gen)
    k = torch.randn(int(cu_k[-1]), config.num_kv_heads, config.head_dim, generator=gen)
    v = torch.randn(int(cu_k[-1]), config.num_kv_heads, config.head_dim, generator=gen)
    metadata = AttentionMetadata.build(q_lens, k_lens, device, k_starts=cu_k.tolist())
    return {
        "q": q.to(device, dtype),
        "k": k.to(device, dtype),
        "v": v.to(device, dtype),
        "metadata": metadata,  # the lengths on the device and the host, as the engine passes them
        "scale": config.head_dim**-0.5,
    }


STAGE = Stage(
    name="attention",
    summary="causal softmax(q k^T / sqrt(d)) v per sequence; GQA by head index map",
    shapes="q [T, H, d], k/v [T_kv, Hkv, d] -> [T, H, d]",
    naive=naive,
    triton=triton,
    triton_variant=triton_variant,
    triton_kind="triton: FlashAttention, tiles + online softmax",
    torch=attention_torch.attention_torch,
    torch_kind="torch: every row over fixed 64-key chunks (the same bits in any batch)",
    torch_variant=attention_torch.attention_torch_variant,
    example_inputs=example_inputs,
    outputs=("out",),
    axes={
        "q": "num_tokens heads head_dim",
        "k": "num_kv_tokens kv_heads head_dim",
        "v": "num_kv_tokens kv_heads head_dim",
        "cu_seqlens_q": "num_seqs+1",
        "cu_seqlens_k": "num_seqs+1",
        "seq_lens": "num_seqs",
        "out": "num_tokens heads head_dim",
    },
)
