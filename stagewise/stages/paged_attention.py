"""Attention over a paged KV cache: keys and values are read through a block table.

    q [T, H, d], k_cache / v_cache [num_blocks, block_size, Hkv, d], metadata -> out [T, H, d]

The cache is a pool of fixed-size blocks (`block_size` tokens each, 16 by
default). Sequence b's token at position p lives in physical block
`block_table[b, p // block_size]`, at offset `p % block_size` — so a sequence
needs no contiguous memory, only a row of block ids (the seeds' "address array").

The step's `AttentionMetadata` (`stages/attention_metadata.py`) holds the
block table and the lengths: sequence b has `seq_lens[b]` tokens in the cache
(this step's new tokens already stored) and
`q_len = cu_seqlens_q[b+1] - cu_seqlens_q[b]` queries, its *last* q_len
positions. The causal mask is aligned bottom-right, as in the contiguous
`attention` stage, so one function serves decode (q_len 1), a whole prefill
(q_len == seq_len) and a chunk of a prefill on top of a cached prefix
(chunked prefill, prefix-cache hits). The lengths are host ints too, so no
tier reads a device tensor back to size its work.

GQA by index map: query head h reads KV head h // (H // Hkv), no copy.

The reference (`naive`) is the textbook, one sequence at a time: gather its
K/V blocks through its block-table row into a contiguous copy, then the
contiguous `attention` reference's formula. The `torch` tier
(`stages/paged_attention_torch.py`) attends all decoding sequences together, a
few batched ops per layer instead of a dozen per sequence (its docstring has
the measurements); the two agree to float32 rounding, tested.

What the kernel (`kernels/paged_attention.py`) does differently: no gather
copy and no score matrix. A tile of BLOCK_N keys finds each key's physical
block through the block table (slot = block_id * block_size + offset) and is
folded into a running max, sum and accumulator per query row — the online
softmax of FlashAttention — so K/V are read once, straight from the cache
blocks, wherever they lie. The rows of a tile are the G query heads that share
one KV head (times the queries of a prefill chunk), so in decode each KV block
is read once per GQA group, not once per query head. For a few long sequences
(too few programs to fill a GPU) the keys are split across programs and the
partial (max, sum, acc) states merged by a second small kernel (split-K,
"flash decoding").
"""

import torch
from einops import rearrange

from stagewise.config import ModelConfig
from stagewise.stages import attention
from stagewise.stages.attention_metadata import AttentionMetadata
from stagewise.stages.base import Stage
from stagewise.stages.paged_attention_torch import (
    paged_attention_torch,
    paged_attention_torch_variant,
)


def gather_kv(cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """cache [num_blocks, block_size, Hkv, d], one block-table row -> [seq_len, Hkv, d] (a copy).

    Position p comes from block block_ids[p // block_size], offset p % block_size.
    """
    num_blocks = -(-seq_len // cache.shape[1])  # ceil: the blocks that hold its tokens
    index = block_ids[:num_blocks].to(device=cache.device, dtype=torch.long)  # [n_blocks]
    blocks = cache[index]  # [n_blocks, block_size, Hkv, d], in the sequence's order
    return rearrange(blocks, "n s hkv d -> (n s) hkv d")[:seq_len]  # [seq_len, Hkv, d]


def naive(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """One sequence at a time: gather its blocks into contiguous K/V, then the attention formula.

    q [T, H, d], caches [num_blocks, block_size, Hkv, d] -> [T, H, d]. The offsets come from the
    metadata's host ints: slicing with them reads nothing back from the device.
    """
    m = metadata
    out = torch.empty_like(q)
    cu_q = m.cu_seqlens_q_host
    for b, seq_len in enumerate(m.seq_lens_host):
        q_start, q_end = cu_q[b], cu_q[b + 1]
        if q_end == q_start:
            continue
        k = gather_kv(k_cache, m.block_table[b], seq_len)  # [seq_len, Hkv, d]
        v = gather_kv(v_cache, m.block_table[b], seq_len)
        out[q_start:q_end] = attention.causal_attention_one_sequence(q[q_start:q_end], k, v, scale)
    return out


def triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    batch_invariant: bool = True,
) -> torch.Tensor:
    """Triton paged attention: K/V tiles read in place through the block table, online softmax.

    `max_q_len` and `max_seq_len` (host ints) size the grid and choose split-K; the kernel reads
    the rest on the device (the torch tier's `decode_plan` is not used). batch_invariant: one tile
    for every query length, each row's keys in fixed chunks, a decode split one chunk per program
    (kernels/attention_common.py).
    """
    # lazily: importing kernels picks GPU or interpreter
    from stagewise.kernels.paged_attention import paged_attention

    m = metadata
    return paged_attention(
        q,
        k_cache,
        v_cache,
        m.block_table,
        m.seq_lens,
        m.cu_seqlens_q,
        scale,
        max_q_len=m.max_q_len,
        max_seq_len=m.max_seq_len,
        batch_invariant=batch_invariant,
    )  # -> [T, H, d]


def triton_variant(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """`batch_invariant=False`: decode and prefill tiles of their own, a decode's keys split over
    as many programs as occupancy asks (split-K by count, on a GPU)."""
    return triton(q, k_cache, v_cache, metadata, scale, batch_invariant=False)  # [T, H, d]


def example_inputs(
    config: ModelConfig, num_tokens: int, device, dtype, block_size: int = 16
) -> dict:
    """A decode, a prefill chunk on a cached prefix and a fresh prefill; blocks shuffled."""
    gen = torch.Generator().manual_seed(0)
    q_lens = [1, max(1, num_tokens // 2), 0]
    q_lens[2] = max(0, num_tokens - q_lens[0] - q_lens[1])
    q_lens = [n for n in q_lens if n > 0]
    prefixes = [37, 5, 0][: len(q_lens)]
    seq_lens = [p + n for p, n in zip(prefixes, q_lens)]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(blocks_per_seq)
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    block_table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    start = 0
    for b, n in enumerate(blocks_per_seq):
        block_table[b, :n] = perm[start : start + n]
        start += n
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    q = torch.randn(sum(q_lens), config.num_heads, config.head_dim, generator=gen)
    metadata = AttentionMetadata.build(q_lens, seq_lens, device, block_table=block_table.to(device))
    return {
        "q": q.to(device, dtype),
        "k_cache": torch.randn(shape, generator=gen).to(device, dtype),
        "v_cache": torch.randn(shape, generator=gen).to(device, dtype),
        "metadata": metadata,  # the lengths on the device and the host, as the engine passes them
        "scale": config.head_dim**-0.5,
    }


STAGE = Stage(
    name="paged_attention",
    summary="causal attention reading K/V blocks through each sequence's block table",
    shapes="q [T, H, d], cache [num_blocks, block_size, Hkv, d] -> [T, H, d]",
    naive=naive,
    torch=paged_attention_torch,
    torch_kind="torch: every row over fixed 64-key chunks; decoding sequences batched per group",
    torch_variant=paged_attention_torch_variant,
    triton=triton,
    triton_variant=triton_variant,
    triton_kind="triton: paged attention through block_table",
    example_inputs=example_inputs,
    outputs=("out",),
    axes={
        "q": "num_tokens heads head_dim",
        "k_cache": "num_blocks block_size kv_heads head_dim",
        "v_cache": "num_blocks block_size kv_heads head_dim",
        "block_table": "num_seqs max_blocks_per_seq",
        "seq_lens": "num_seqs",
        "cu_seqlens_q": "num_seqs+1",
        "out": "num_tokens heads head_dim",
    },
)
