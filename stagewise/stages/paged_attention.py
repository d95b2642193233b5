"""Attention over a paged KV cache: keys and values are read through a block table.

    q [T, H, d], k_cache / v_cache [num_blocks, block_size, Hkv, d],
    block_table [B, max_blocks_per_seq], seq_lens [B], cu_seqlens_q [B+1] -> out [T, H, d]

The cache is a pool of fixed-size blocks (`block_size` tokens each, 16 by
default). Sequence b's token at position p lives in physical block
`block_table[b, p // block_size]`, at offset `p % block_size` — so a sequence
needs no contiguous memory, only a row of block ids (the seeds' "address array").

Sequence b has `seq_lens[b]` tokens in the cache (this step's new tokens
already stored) and `q_len = cu_seqlens_q[b+1] - cu_seqlens_q[b]` queries:
its *last* q_len positions. The causal mask is aligned bottom-right, as in the
contiguous `attention` stage, so one function serves decode (q_len 1), a
whole prefill (q_len == seq_len) and a chunk of a prefill on top of a cached
prefix (chunked prefill, prefix-cache hits). The engine also passes the
lengths as host ints (`max_q_len`, `max_seq_len`, the `*_host` lists), so
neither path reads a device tensor back to size its work.

GQA by index map: query head h reads KV head h // (H // Hkv), no copy.

The reference (`one_by_one`) gathers each sequence's K/V blocks into a
contiguous copy (one `index_select` over its block ids) and runs the
contiguous `attention` reference's per-sequence function on it. The PyTorch
backend (`naive`) runs prefills that way too, but attends all decoding
sequences together, a few batched ops per layer instead of a dozen per
sequence (`stages/paged_decode_batched.py`, with its measurements); the two
agree to float32 rounding, tested.

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

import itertools

import torch

from stagewise.config import ModelConfig
from stagewise.stages import attention
from stagewise.stages.base import Stage
from stagewise.stages.paged_decode_batched import DecodeGroup, attend_group, plan_decode


def gather_kv(cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """cache [num_blocks, block_size, Hkv, d], one sequence's block ids -> its [seq_len, Hkv, d] (a copy).

    Position p comes from slot block_ids[p // block_size] * block_size + p % block_size.
    """
    num_blocks = -(-seq_len // cache.shape[1])  # ceil: the blocks that hold its tokens
    index = block_ids[:num_blocks].to(
        device=cache.device, dtype=torch.long
    )  # [n_blocks] physical block ids
    blocks = cache.index_select(0, index)  # [n_blocks, block_size, Hkv, d], in logical order
    return blocks.flatten(0, 1)[:seq_len]  # [seq_len, Hkv, d]


def one_sequence(
    q: torch.Tensor, k_cache, v_cache, block_ids: torch.Tensor, seq_len: int, scale: float
):
    """One sequence's query rows q [Lq, H, d] over its first seq_len cached keys -> [Lq, H, d] (float32)."""
    k = gather_kv(k_cache, block_ids, seq_len)  # [seq_len, Hkv, d]
    v = gather_kv(v_cache, block_ids, seq_len)
    return attention.causal_attention_one_sequence(q, k, v, scale)


def one_by_one(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    max_q_len: int | None = None,
    max_seq_len: int | None = None,
    cu_seqlens_q_host: list[int] | None = None,
    seq_lens_host: list[int] | None = None,
) -> torch.Tensor:
    """One sequence at a time: gather its blocks into contiguous K/V, then the contiguous reference.

    Gathering sequence by sequence keeps each copy small enough to stay in cache for the attention
    that reads it right after (2-3x faster on a CPU than one gather of every sequence's blocks).
    The `*_host` lists are the lengths as Python ints (the scheduler has them): no read back from
    the device. Without them the tensors are read (a host sync).
    """
    out = torch.empty_like(q)
    cu_q = cu_seqlens_q_host if cu_seqlens_q_host is not None else cu_seqlens_q.tolist()
    lens = seq_lens_host if seq_lens_host is not None else seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        q_start, q_end = cu_q[b], cu_q[b + 1]
        if q_end > q_start:
            out[q_start:q_end] = one_sequence(
                q[q_start:q_end], k_cache, v_cache, block_table[b], seq_len, scale
            )
    return out


def naive(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    max_q_len: int | None = None,
    max_seq_len: int | None = None,
    cu_seqlens_q_host: list[int] | None = None,
    seq_lens_host: list[int] | None = None,
    decode_plan: list[DecodeGroup] | None = None,
) -> torch.Tensor:
    """The PyTorch path: decoding sequences batched (`paged_decode_batched`), the others as `one_by_one`.

    Same arguments and result as `one_by_one`, the reference. `decode_plan`: the decode groups' key slots,
    built once per step by the engine (the same for every layer); None builds them here.
    """
    cu_q = cu_seqlens_q_host if cu_seqlens_q_host is not None else cu_seqlens_q.tolist()
    lens = seq_lens_host if seq_lens_host is not None else seq_lens.tolist()
    if decode_plan is None:
        decode_plan = plan_decode(block_table, seq_lens, cu_q, lens, k_cache.shape[1])
    if not decode_plan:
        return one_by_one(
            q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale, None, None, cu_q, lens
        )
    if len(decode_plan) == 1 and decode_plan[0].rows == slice(
        0, q.shape[0]
    ):  # a pure decode step, one group
        return attend_group(
            q, k_cache, v_cache, decode_plan[0], scale
        )  # [T, H, d], no copy into an `out`
    out = torch.empty_like(q)
    for group in decode_plan:
        out[group.rows] = attend_group(q[group.rows], k_cache, v_cache, group, scale)  # [D, H, d]
    for b in range(len(lens)):
        q_start, q_end = cu_q[b], cu_q[b + 1]
        if q_end - q_start > 1:  # a prefill or a prefill chunk: the reference, one sequence
            out[q_start:q_end] = one_sequence(
                q[q_start:q_end], k_cache, v_cache, block_table[b], lens[b], scale
            )
    return out


def optimized(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    max_q_len: int | None = None,
    max_seq_len: int | None = None,
    cu_seqlens_q_host: list[int] | None = None,
    seq_lens_host: list[int] | None = None,
    decode_plan: list[DecodeGroup] | None = None,
) -> torch.Tensor:
    """Triton paged attention: K/V tiles read in place through the block table, online softmax.

    Only `max_q_len` and `max_seq_len` (host ints) are needed, to size the grid and choose split-K;
    `decode_plan` (the PyTorch path's gather slots) is not used.
    """
    from stagewise.kernels.paged_attention import (
        paged_attention,
    )  # lazily: importing kernels picks GPU or interpreter

    if max_q_len is None and cu_seqlens_q_host is not None:
        max_q_len = max(
            (b - a for a, b in zip(cu_seqlens_q_host, cu_seqlens_q_host[1:])), default=0
        )
    if max_seq_len is None and seq_lens_host is not None:
        max_seq_len = max(seq_lens_host, default=0)
    return paged_attention(
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        cu_seqlens_q,
        scale,
        max_q_len=max_q_len,
        max_seq_len=max_seq_len,
    )  # -> [T, H, d]


def example_inputs(
    config: ModelConfig, num_tokens: int, device, dtype, block_size: int = 16
) -> dict:
    """Three sequences: a decode, a prefill chunk on a cached prefix, a fresh prefill; blocks shuffled."""
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
    return {
        "q": q.to(device, dtype),
        "k_cache": torch.randn(shape, generator=gen).to(device, dtype),
        "v_cache": torch.randn(shape, generator=gen).to(device, dtype),
        "block_table": block_table.to(device),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=device),
        "cu_seqlens_q": torch.tensor([0, *q_lens], device=device).cumsum(0).to(torch.int32),
        "scale": config.head_dim**-0.5,
        "max_q_len": max(
            q_lens, default=0
        ),  # the same lengths on the host, as the engine passes them
        "max_seq_len": max(seq_lens, default=0),
        "cu_seqlens_q_host": list(itertools.accumulate(q_lens, initial=0)),
        "seq_lens_host": seq_lens,
    }


STAGE = Stage(
    name="paged_attention",
    summary="causal attention reading K/V blocks through each sequence's block table",
    shapes="q [T, H, d], cache [num_blocks, block_size, Hkv, d] -> [T, H, d]",
    naive=naive,
    triton=optimized,
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
