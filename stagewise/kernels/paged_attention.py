"""Paged attention: causal attention whose K/V are read through a block table.

    q [T, H, d], k_cache / v_cache [num_blocks, block_size, Hkv, d],
    block_table [B, max_blocks] int32, seq_lens [B] int32, cu_seqlens_q [B+1] int32 -> out [T, H, d]

Semantics are the `paged_attention` stage's: sequence b has seq_lens[b]
tokens in the cache and its q_len queries are its last q_len positions
(causal mask aligned bottom-right), so one call serves decode (q_len 1) and
chunked prefill (a chunk against the cached prefix plus itself) side by side.

Paged addressing. The key at position n of sequence b lives at

    block_id = block_table[b, n // block_size]
    slot     = block_id * block_size + n % block_size    (a row of the cache as [slots, Hkv, d])

Every key of a BLOCK_N tile looks up its own block id, so the block size is
free (16, 32, ...) and the physical blocks may lie anywhere, in any order. The
rest is FlashAttention's loop (attention_common.py): one program per (row
tile, sequence, KV head x split), the rows (query, group head) pairs, so in
decode the G query heads sharing a KV head are one tile and K/V are read once
per group. A decode step of a few long sequences splits each sequence's keys
over NUM_SPLITS programs whose partials `split_k_reduce` merges (split_k.py).
Dots follow precision.py, as in flash_attention.py. Batch-invariant
(`batch_invariant=True`), one tile for every call and every row's keys in fixed
chunks merged in order (attention_common.py): the split of a decode step gives
each program one chunk, a fixed *size* of keys, never a share of them.
"""

import torch
import triton
import triton.language as tl

from stagewise.kernels.attention_common import (
    M_INIT,
    attend_chunks,
    attend_keys,
    check_cu_seqlens_q,
    check_index,
    check_qkv,
    invariant_tile,
    key_range,
    load_query_tile,
    needs_int64_offsets,
    program_tile,
    qk_scale_log2,
    store_rows,
    tile_fits,
)
from stagewise.kernels.checks import (
    KernelInputError,
    check_contiguous,
    check_dim,
    check_dtype,
    check_same_device,
)
from stagewise.kernels.plan_cache import cdiv, plan_cache
from stagewise.kernels.precision import dot_policy
from stagewise.kernels.split_k import (
    choose_num_splits,
    chunk_splits,
    num_sms,
    partial_buffers,
    split_k_reduce,
)
from stagewise.kernels.targets import LaunchPlan, Target, checked_target
from stagewise.runtime import debug_checks

NAME = "paged_attention"


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [T, H, d] queries, last dim contiguous
    k_cache_ptr,  # [num_blocks, block_size, Hkv, d] key cache, contiguous
    v_cache_ptr,  # [num_blocks, block_size, Hkv, d] value cache, contiguous
    out_ptr,  # [T, H, d] output (NUM_SPLITS == 1) or [T, H, NUM_SPLITS, d] fp32 partial acc
    m_part_ptr,  # [T, H, NUM_SPLITS] fp32 partial running max (written only when NUM_SPLITS > 1)
    l_part_ptr,  # [T, H, NUM_SPLITS] fp32 partial running sum (written only when NUM_SPLITS > 1)
    block_table_ptr,  # [B, max_blocks] int32 physical block ids, last dim contiguous
    seq_lens_ptr,  # [B] int32: tokens in the cache per sequence
    cu_seqlens_q_ptr,  # [B+1] int32: query rows of each sequence
    qk_scale,  # softmax scale * log2(e)
    stride_q_token,  # elements between consecutive query tokens
    stride_q_head,  # elements between consecutive query heads
    stride_o_token,  # elements between consecutive output tokens (of out or the partial acc)
    stride_o_head,  # elements between consecutive output heads (of out or the partial acc)
    stride_o_split,  # elements between consecutive splits of the partial acc (0 without split-K)
    stride_ml_token,  # elements between consecutive tokens of m_part / l_part
    stride_ml_head,  # elements between consecutive heads of m_part / l_part
    stride_bt_row,  # elements between consecutive block-table rows
    stride_slot,  # elements between consecutive cache slots (Hkv * d)
    stride_kv_head,  # elements between consecutive KV heads in the cache (d)
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    GROUP: tl.constexpr,  # query heads per KV head, H // Hkv
    HEAD_DIM: tl.constexpr,  # d (a power of two)
    BLOCK_M: tl.constexpr,  # (query, group head) rows per tile
    BLOCK_N: tl.constexpr,  # keys per tile
    NUM_SPLITS: tl.constexpr,  # programs sharing one tile's keys (1 = no split-K)
    FP32_DOTS: tl.constexpr,  # convert tiles to fp32 after the load (fp32; bf16 in the interpreter)
    INPUT_PRECISION: tl.constexpr,  # tl.dot precision of fp32 tiles: "ieee" or "tf32"
    INT64_OFFSETS: tl.constexpr,  # a tensor spans >= 2^31 elements: 64-bit offsets
    KEY_CHUNK: tl.constexpr,  # > 0: batch-invariant, keys in fixed chunks merged in order
):
    seq, kv_head, split, q_start, q_len, f0 = program_tile(cu_seqlens_q_ptr, BLOCK_M, NUM_SPLITS)
    if f0 >= q_len * GROUP:
        return  # this sequence has fewer row tiles than the longest one
    seq_len = tl.load(seq_lens_ptr + seq)
    q, query, head, row_ok, q_rows = load_query_tile(
        q_ptr, q_start, q_len, f0, kv_head, stride_q_token, stride_q_head,
        GROUP, HEAD_DIM, BLOCK_M, FP32_DOTS, INT64_OFFSETS,
    )  # fmt: skip
    lo, mid, hi = key_range(
        f0, q_len, seq_len, split, GROUP, BLOCK_M, BLOCK_N, NUM_SPLITS, KEY_CHUNK
    )

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # the online softmax's running state
    m_i = tl.full([BLOCK_M], M_INIT, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    dims = tl.arange(0, HEAD_DIM)[None, :]  # [1, HEAD_DIM]
    k_base = k_cache_ptr + kv_head * stride_kv_head + dims  # slot 0 of this KV head
    v_base = v_cache_ptr + kv_head * stride_kv_head + dims
    if INT64_OFFSETS:
        seq = seq.to(tl.int64)
    bt_row = block_table_ptr + seq * stride_bt_row  # the sequence's block ids
    shift = seq_len - q_len  # query i sees positions n <= i + shift
    if KEY_CHUNK > 0:  # batch-invariant: fixed chunks of keys, merged in order
        acc, m_i, l_i = attend_chunks(
            q, query, row_ok, k_base, v_base, stride_slot, stride_slot, 0, bt_row, seq_len, shift,
            lo, mid, hi, qk_scale, BLOCK_M, HEAD_DIM, BLOCK_N, KEY_CHUNK, BLOCK_SIZE, True,
            FP32_DOTS, INPUT_PRECISION, INT64_OFFSETS,
        )  # fmt: skip
    else:  # one online softmax over the keys: the whole tiles, then the masked band
        acc, m_i, l_i = attend_keys(  # keys every row sees, all inside the sequence: no masks
            acc, m_i, l_i, q, query, row_ok, k_base, v_base, stride_slot, stride_slot,
            0, bt_row, seq_len, shift, lo, mid, qk_scale,
            BLOCK_N, BLOCK_SIZE=BLOCK_SIZE, PAGED=True, MASKED=False,
            FP32_DOTS=FP32_DOTS, INPUT_PRECISION=INPUT_PRECISION, INT64_OFFSETS=INT64_OFFSETS,
        )  # fmt: skip
        acc, m_i, l_i = attend_keys(  # the causal diagonal and the sequence's last, partial tile
            acc, m_i, l_i, q, query, row_ok, k_base, v_base, stride_slot, stride_slot,
            0, bt_row, seq_len, shift, mid, hi, qk_scale,
            BLOCK_N, BLOCK_SIZE=BLOCK_SIZE, PAGED=True, MASKED=True,
            FP32_DOTS=FP32_DOTS, INPUT_PRECISION=INPUT_PRECISION, INT64_OFFSETS=INT64_OFFSETS,
        )  # fmt: skip
    store_rows(
        out_ptr, m_part_ptr, l_part_ptr, acc, m_i, l_i, q_rows, head, row_ok, split,
        stride_o_token, stride_o_head, stride_o_split, stride_ml_token, stride_ml_head,
        HEAD_DIM, NUM_SPLITS,
    )  # fmt: skip


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    max_q_len: int | None = None,
    max_seq_len: int | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """q [T, H, d], caches [num_blocks, block_size, Hkv, d], block_table [B, max_blocks] int32,
    seq_lens [B] int32, cu_seqlens_q [B+1] int32 -> [T, H, d].

    `num_splits` forces split-K (1 = off); None lets `choose_num_splits` decide.
    `batch_invariant`: one tile for every query length and every row's keys in fixed chunks of
    KEY_CHUNK merged in order (attention_common.py), so a row's bits are the same alone, batched,
    decoded or prefilled; split-K then gives each program one chunk (`chunk_splits`), and
    `num_splits` is 1 or at least the number of chunks.
    `max_q_len` (longest query rows) sizes the grid and picks the tile; `max_seq_len` (longest
    sequence, for the split-K choice) defaults to the block table's capacity. Both are host ints
    from the scheduler: the launcher never reads cu_seqlens_q or seq_lens on the host, since that
    waits for every kernel queued before it (a host sync), which makes the step host-bound and
    cannot be captured in a CUDA graph. Without `max_q_len` it falls back to reading cu_seqlens_q
    (one sync; the engine always passes it). With debug checks on (`stagewise.runtime.debug_checks`)
    it reads both and checks them against q, the block table and the maxima.
    """
    num_heads, num_kv_heads, head_dim = _check_inputs(
        q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q
    )
    num_seqs = block_table.shape[0]
    qk_scale = qk_scale_log2(scale)
    num_tokens, block_size = q.shape[0], k_cache.shape[1]
    if debug_checks():
        _check_values(
            num_tokens, block_table, seq_lens, cu_seqlens_q, block_size, max_q_len, max_seq_len
        )
    if max_q_len is None:  # the fallback: one host read (the engine passes max_q_len)
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if num_seqs > 0 else 0
    if max_seq_len is None:  # no read needed: no sequence is longer than its block-table row
        max_seq_len = block_table.shape[1] * block_size

    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, H, d]; every row is written
    if max_q_len == 0:
        return out
    group = num_heads // num_kv_heads
    policy = dot_policy(q.dtype)
    blocks = paged_attention_options(
        max_q_len, group, head_dim, q.dtype, checked_target(NAME, q), batch_invariant
    )
    num_q_blocks = cdiv(max_q_len * group, blocks["BLOCK_M"])
    programs = num_q_blocks * num_seqs * num_kv_heads
    if batch_invariant:
        chunk = blocks["KEY_CHUNK"]
        num_splits = chunk_splits(programs, max_seq_len, num_sms(q.device), chunk, num_splits)
    elif num_splits is None:
        num_splits = choose_num_splits(programs, max_seq_len, num_sms(q.device))
    if num_splits < 1:
        raise KernelInputError(f"{NAME}: num_splits must be >= 1, got {num_splits}")

    target, m_part, l_part, stride_o_split, stride_ml = partial_buffers(out, num_splits)
    _paged_attention_kernel[(num_q_blocks, num_seqs, num_kv_heads * num_splits)](
        q_ptr=q,
        k_cache_ptr=k_cache,
        v_cache_ptr=v_cache,
        out_ptr=target,
        m_part_ptr=m_part,
        l_part_ptr=l_part,
        block_table_ptr=block_table,
        seq_lens_ptr=seq_lens,
        cu_seqlens_q_ptr=cu_seqlens_q,
        qk_scale=qk_scale,
        stride_q_token=q.stride(0),
        stride_q_head=q.stride(1),
        stride_o_token=target.stride(0),
        stride_o_head=target.stride(1),
        stride_o_split=stride_o_split,
        stride_ml_token=stride_ml[0],
        stride_ml_head=stride_ml[1],
        stride_bt_row=block_table.stride(0),
        stride_slot=k_cache.stride(1),
        stride_kv_head=k_cache.stride(2),
        BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits,
        FP32_DOTS=policy.fp32_dots,
        INPUT_PRECISION=policy.input_precision,
        INT64_OFFSETS=int64_offsets(blocks["BLOCK_M"], q, k_cache, v_cache, block_table, target),
        **blocks,
    )
    if num_splits > 1:
        split_k_reduce(target, m_part, l_part, out)
    return out


def _check_inputs(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q) -> tuple[int, int, int]:
    """Shapes, dtypes, layouts and devices (no host read) -> (H, Hkv, d)."""
    heads = check_qkv(NAME, q, k_cache, v_cache, kv_ndim=4, kv_names=("k_cache", "v_cache"))
    check_contiguous(NAME, "k_cache", k_cache)
    check_contiguous(NAME, "v_cache", v_cache)
    check_dim(NAME, "block_table", block_table, 2)
    check_dtype(NAME, "block_table", block_table, (torch.int32,))
    if block_table.stride(1) != 1:
        raise KernelInputError(
            f"{NAME}: block_table rows must be contiguous (strides {list(block_table.stride())})"
        )
    num_seqs = block_table.shape[0]
    check_index(NAME, "seq_lens", seq_lens, num_seqs)
    check_index(NAME, "cu_seqlens_q", cu_seqlens_q, num_seqs + 1)
    check_same_device(
        NAME,
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=block_table,
        seq_lens=seq_lens,
        cu_seqlens_q=cu_seqlens_q,
    )
    return heads


def _check_values(
    num_tokens: int, block_table, seq_lens, cu_seqlens_q, block_size: int, max_q_len, max_seq_len
):
    """Debug checks: read the lengths on the host, check them against q, the block table, maxima."""
    cu_q, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    check_cu_seqlens_q(NAME, cu_q, num_tokens)
    capacity = block_table.shape[1] * block_size
    for b, n in enumerate(lens):
        if n < 0 or n > capacity:
            raise KernelInputError(
                f"{NAME}: seq_lens[{b}] = {n} does not fit a block-table row ({capacity} tokens)"
            )
    longest_q = max((b - a for a, b in zip(cu_q, cu_q[1:])), default=0)
    if max_q_len is not None and max_q_len < longest_q:
        raise KernelInputError(
            f"{NAME}: max_q_len {max_q_len} is below the longest sequence's {longest_q} query rows"
        )
    if max_seq_len is not None and max_seq_len < max(lens, default=0):
        raise KernelInputError(
            f"{NAME}: max_seq_len {max_seq_len} is below the longest seq_lens {max(lens)}"
        )


def int64_offsets(block_m: int, *tensors: torch.Tensor) -> bool:
    """64-bit offsets: when a tensor reaches 2^31 elements, and for decode tiles (BLOCK_M 16).

    A decode step is memory bound, so its integer math is free, and with 32-bit offsets ptxas
    spills the decode tile (sm_80, bf16, head_dim 128: 96 registers and 8 B of spills; 64-bit:
    128 registers, none). Prefill tiles compute: they take 32-bit offsets where those fit.
    """
    return block_m <= 16 or needs_int64_offsets(*tensors)


# ---- tiles ----

# GPU tiles (BLOCK_M, BLOCK_N, num_warps, num_stages) by preference: the first that fits is used.
DECODE_TILES = [(16, 64, 4, 3), (16, 32, 4, 3), (16, 32, 4, 2), (16, 16, 4, 2)]
# fp32 (FMA dots) gets (32, 16) or (16, 16): (32, 32, 8 warps) spills 8-48 B/thread on sm_80
# (ptxas of triton 3.6 and 3.9)
PREFILL_TILES = [(64, 64, 4, 2), (64, 32, 4, 2), (32, 16, 4, 2), (16, 32, 4, 2), (16, 16, 4, 2)]


@plan_cache
def paged_attention_options(
    max_q_len: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    target: Target,
    batch_invariant: bool = False,
) -> dict:
    """`paged_attention_plan`'s launch kwargs, kept per (query rows, GQA group, d, dtype, target).

    The split count is not in it: it follows max_seq_len, which grows every decode step.
    """
    plan = paged_attention_plan(max_q_len, group, head_dim, dtype, target, batch_invariant)
    return plan.launch_options()


def paged_attention_plan(
    max_q_len: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    target: Target,
    batch_invariant: bool = False,
) -> LaunchPlan:
    """Tile shape and launch options: a decode tile is one GQA group, a prefill chunk taller tiles.

    On a GPU the tile is the first of DECODE_TILES / PREFILL_TILES that fits the target's shared
    memory and registers (`tile_fits`): fp32 and head_dim 128+ take smaller tiles, and an RTX 4090
    (99 KB) smaller ones than an H100 (227 KB). Batch-invariant: one tile for every query length,
    flash attention's too (`invariant_tile`), and KEY_CHUNK > 0.
    """
    rows = max(16, triton.next_power_of_2(max_q_len * group))
    # + FP32_DOTS, INPUT_PRECISION at launch; KEY_CHUNK 0: one online softmax over all the keys
    constexprs = {"GROUP": group, "HEAD_DIM": head_dim, "KEY_CHUNK": 0}

    if batch_invariant:
        meta, warps, stages = invariant_tile(head_dim, dtype, target)
        constexprs["KEY_CHUNK"] = meta.pop("KEY_CHUNK")
    elif target.interpreter:  # cost is per op, not per FLOP: few tiles
        meta, warps, stages = {"BLOCK_M": min(rows, 64), "BLOCK_N": 32}, 4, 1
    else:
        # decode: one group per program, K/V stream through
        tiles = DECODE_TILES if rows <= 16 else PREFILL_TILES
        fitting = [t for t in tiles if tile_fits(*t, head_dim, dtype, target)]
        block_m, block_n, warps, stages = (fitting or tiles[-1:])[0]
        meta = {"BLOCK_M": block_m, "BLOCK_N": block_n}
    return LaunchPlan(NAME, constexprs, (triton.Config(meta, num_warps=warps, num_stages=stages),))
