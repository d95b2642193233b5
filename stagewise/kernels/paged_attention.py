"""Paged attention: causal attention whose K/V are read through a block table.

    q [T, H, d], k_cache / v_cache [num_blocks, block_size, Hkv, d],
    block_table [B, max_blocks] int32, seq_lens [B] int32, cu_seqlens_q [B+1] int32 -> out [T, H, d]

Semantics are the `paged_attention` stage's: sequence b has seq_lens[b]
tokens in the cache and its q_len queries are its last q_len positions
(causal mask aligned bottom-right), so one call serves decode (q_len 1) and
chunked prefill (a chunk against the cached prefix plus itself) side by side.

Paged addressing. The key at position n of sequence b lives at

    block_id = block_table[b, n // block_size]
    slot     = block_id * block_size + n % block_size      (row of the cache seen as [num_slots, Hkv, d])

A tile of BLOCK_N keys spans one or more cache blocks (or part of one); every
key of the tile looks up its block id, so the block size is free (16, 32, ...)
and the physical blocks may lie anywhere, in any order. The tile then runs the
same online softmax as FlashAttention (attention_common.py).

GQA packing. One program serves one KV head of one sequence; the rows of its
query tile are (query, head-of-the-group) pairs, row r -> query r // G, head
kv_head * G + r % G. In decode (q_len 1) the G query heads that share a KV
head are the tile, so K/V are read once per group instead of once per query
head: the bandwidth saving GQA was designed for, delivered by an index map.

Split-K (flash decoding). A decode step of a few long sequences gives only
B * Hkv programs — too few to fill a GPU. `paged_attention` then splits each
sequence's keys across NUM_SPLITS programs; each writes an unnormalised
partial (acc, m, l), and `split_k_reduce` merges them exactly (split_k.py
shows why). `choose_num_splits` decides, from the grid size and the length.

Dot precision (precision.py, the policy of every kernel with dots): fp16/bf16
run 16-bit tensor-core dots with fp32 accumulation; fp32 runs TF32 dots when
torch.backends.cuda.matmul.allow_tf32 is on, IEEE fp32 otherwise. In the CPU
interpreter fp16 keeps its 16-bit dots, bf16 is upcast after the load, fp32 is
full fp32.
"""

import torch
import triton
import triton.language as tl

from stagewise.kernels.attention_common import (
    M_INIT,
    attend_tile,
    check_cu_seqlens_q,
    check_index,
    check_qkv,
    qk_scale_log2,
    tile_fits,
)
from stagewise.kernels.checks import (
    KernelInputError,
    check_contiguous,
    check_dim,
    check_dtype,
    check_same_device,
)
from stagewise.kernels.precision import dot_policy
from stagewise.kernels.split_k import choose_num_splits, num_sms, split_k_reduce
from stagewise.kernels.targets import LaunchPlan, Target, checked_target
from stagewise.runtime import debug_checks

NAME = "paged_attention"


@triton.jit
def _load_kv_tile(
    cache_ptr,  # [num_blocks * block_size, Hkv, d] one cache (K or V), contiguous
    block_table_row_ptr,  # [max_blocks] int32: the sequence's physical block ids
    positions,  # [BLOCK_N] key positions within the sequence
    in_seq,  # [BLOCK_N] bool: position < seq_len (read only when MASKED)
    kv_head,  # which KV head
    dims,  # [HEAD_DIM] 0 .. d-1
    stride_slot,  # elements between consecutive slots (Hkv * d)
    stride_head,  # elements between consecutive KV heads (d)
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    MASKED: tl.constexpr,  # some positions may lie past the sequence's end
):
    """slot = block_table[n // block_size] * block_size + n % block_size, then load [BLOCK_N, HEAD_DIM]."""
    if MASKED:
        block_id = tl.load(block_table_row_ptr + positions // BLOCK_SIZE, mask=in_seq, other=0)
    else:
        block_id = tl.load(block_table_row_ptr + positions // BLOCK_SIZE)
    slot = (
        block_id.to(tl.int64) * BLOCK_SIZE + positions % BLOCK_SIZE
    )  # int64: slots * Hkv * d may pass 2^31
    ptrs = cache_ptr + slot[:, None] * stride_slot + kv_head * stride_head + dims[None, :]
    if MASKED:
        tile = tl.load(ptrs, mask=in_seq[:, None], other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


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
    stride_o_split,  # elements between consecutive splits of the partial acc (unused without split-K)
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
    FP32_DOTS: tl.constexpr,  # convert tiles to fp32 after the load (fp32 inputs; bf16 in the interpreter)
    INPUT_PRECISION: tl.constexpr,  # tl.dot input precision of fp32 tiles: "ieee" or "tf32" (precision.py)
):
    q_block = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    f0 = q_block * BLOCK_M  # first (query, group head) row of this tile
    if f0 >= q_len * GROUP:
        return  # this sequence has fewer query tiles than the longest one
    seq_len = tl.load(seq_lens_ptr + seq)
    shift = seq_len - q_len  # bottom-right causal alignment: query i sees positions n <= i + shift

    flat = f0 + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    query = flat // GROUP  # [BLOCK_M] query within the sequence
    head = kv_head * GROUP + flat % GROUP  # [BLOCK_M] query head: the GQA group of kv_head
    row_ok = query < q_len
    dims = tl.arange(0, HEAD_DIM)
    q_rows = (q_start + query).to(tl.int64)
    q_ptrs = (
        q_ptr + q_rows[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :]
    )
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)  # [BLOCK_M, HEAD_DIM]
    if FP32_DOTS:
        q = q.to(tl.float32)

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], M_INIT, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    last_query = (tl.minimum(f0 + BLOCK_M, q_len * GROUP) - 1) // GROUP
    hi = tl.maximum(
        tl.minimum(seq_len, last_query + shift + 1), 0
    )  # no row of the tile sees keys past hi
    full = tl.maximum(
        tl.minimum(seq_len, f0 // GROUP + shift + 1), 0
    )  # every row sees the keys before full
    full = (full // BLOCK_N) * BLOCK_N
    lo = 0
    if NUM_SPLITS > 1:  # this program's share of [0, hi), in whole tiles
        per_split = tl.cdiv(tl.cdiv(hi, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = tl.minimum(split * per_split, hi)
        hi = tl.minimum(lo + per_split, hi)
    mid = tl.maximum(lo, tl.minimum(full, hi))  # [lo, mid) unmasked tiles, [mid, hi) masked tiles
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt_row

    for n0 in range(lo, mid, BLOCK_N):  # keys every row sees, all inside the sequence: no masks
        pos = n0 + tl.arange(0, BLOCK_N)
        k = _load_kv_tile(
            k_cache_ptr,
            bt_row,
            pos,
            pos,
            kv_head,
            dims,
            stride_slot,
            stride_kv_head,
            BLOCK_SIZE,
            False,
        )
        v = _load_kv_tile(
            v_cache_ptr,
            bt_row,
            pos,
            pos,
            kv_head,
            dims,
            stride_slot,
            stride_kv_head,
            BLOCK_SIZE,
            False,
        )
        if FP32_DOTS:
            k, v = k.to(tl.float32), v.to(tl.float32)
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, k, v, row_ok[:, None], qk_scale, False, INPUT_PRECISION
        )

    for n0 in range(mid, hi, BLOCK_N):  # the causal diagonal and the sequence's last, partial tile
        pos = n0 + tl.arange(0, BLOCK_N)
        in_seq = pos < seq_len
        k = _load_kv_tile(
            k_cache_ptr,
            bt_row,
            pos,
            in_seq,
            kv_head,
            dims,
            stride_slot,
            stride_kv_head,
            BLOCK_SIZE,
            True,
        )
        v = _load_kv_tile(
            v_cache_ptr,
            bt_row,
            pos,
            in_seq,
            kv_head,
            dims,
            stride_slot,
            stride_kv_head,
            BLOCK_SIZE,
            True,
        )
        if FP32_DOTS:
            k, v = k.to(tl.float32), v.to(tl.float32)
        visible = (pos[None, :] <= query[:, None] + shift) & in_seq[None, :]  # [BLOCK_M, BLOCK_N]
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, k, v, visible, qk_scale, True, INPUT_PRECISION
        )

    o_rows = q_rows[:, None] * stride_o_token + head[:, None] * stride_o_head  # [BLOCK_M, 1]
    if NUM_SPLITS == 1:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # a row that saw no key has acc == 0 -> writes 0
        out = acc / l_safe[:, None]
        tl.store(
            out_ptr + o_rows + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None]
        )
    else:  # unnormalised partials; split_k_reduce merges the NUM_SPLITS of each row
        tl.store(
            out_ptr + o_rows + split * stride_o_split + dims[None, :], acc, mask=row_ok[:, None]
        )
        ml_rows = q_rows * stride_ml_token + head * stride_ml_head + split  # [BLOCK_M]
        tl.store(m_part_ptr + ml_rows, m_i, mask=row_ok)
        tl.store(l_part_ptr + ml_rows, l_i, mask=row_ok)


# GPU tiles (BLOCK_M, BLOCK_N, num_warps, num_stages), by preference: the first that fits the target is used.
DECODE_TILES = [(16, 64, 4, 3), (16, 32, 4, 3), (16, 32, 4, 2), (16, 16, 4, 2)]
# fp32 (FMA dots) gets (32, 16) or (16, 16): (32, 32, 8 warps) spills 8-48 B/thread on sm_80 (ptxas of triton 3.6/3.9)
PREFILL_TILES = [(64, 64, 4, 2), (64, 32, 4, 2), (32, 16, 4, 2), (16, 32, 4, 2), (16, 16, 4, 2)]


def paged_attention_plan(
    max_q_len: int, group: int, head_dim: int, dtype: torch.dtype, target: Target
) -> LaunchPlan:
    """Tile shape and launch options: a decode tile is one GQA group; a prefill chunk gets taller tiles.

    On a GPU the tile is the first of DECODE_TILES / PREFILL_TILES that fits the target's shared memory
    and registers (`tile_fits`): fp32 and head_dim 128+ take smaller tiles, and an RTX 4090 (99 KB)
    smaller ones than an H100 (227 KB).
    """
    rows = max(16, triton.next_power_of_2(max_q_len * group))
    constexprs = {
        "GROUP": group,
        "HEAD_DIM": head_dim,
    }  # + FP32_DOTS, INPUT_PRECISION: precision.dot_policy
    if target.interpreter:  # cost is per op, not per FLOP: few tiles
        meta, warps, stages = {"BLOCK_M": min(rows, 64), "BLOCK_N": 32}, 4, 1
    else:
        tiles = (
            DECODE_TILES if rows <= 16 else PREFILL_TILES
        )  # decode: one group per program, K/V stream through
        fitting = [t for t in tiles if tile_fits(*t, head_dim, dtype, target)]
        block_m, block_n, warps, stages = (fitting or tiles[-1:])[0]
        meta = {"BLOCK_M": block_m, "BLOCK_N": block_n}
    return LaunchPlan(NAME, constexprs, (triton.Config(meta, num_warps=warps, num_stages=stages),))


def _check_values(
    num_tokens: int, block_table, seq_lens, cu_seqlens_q, block_size: int, max_q_len, max_seq_len
):
    """Debug checks: read the lengths on the host; check them against q, the block table and the host maxima."""
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
) -> torch.Tensor:
    """q [T, H, d], caches [num_blocks, block_size, Hkv, d], block_table [B, max_blocks] int32,
    seq_lens [B] int32, cu_seqlens_q [B+1] int32 -> [T, H, d].

    `num_splits` forces split-K (1 = off); None lets `choose_num_splits` decide.
    `max_q_len` (longest query rows) sizes the grid and picks the tile; `max_seq_len` (longest
    sequence, for the split-K choice) defaults to the block table's capacity. Both are host ints
    from the scheduler: the launcher never reads cu_seqlens_q or seq_lens on the host, since that
    waits for every kernel queued before it (a host sync), which makes the step host-bound and
    cannot be captured in a CUDA graph. Without `max_q_len` it falls back to reading cu_seqlens_q
    (one sync; the engine always passes it). With debug checks on (`stagewise.runtime.debug_checks`)
    it reads both and checks them against q, the block table and the maxima.
    """
    num_heads, num_kv_heads, head_dim = check_qkv(
        NAME, q, k_cache, v_cache, kv_ndim=4, kv_names=("k_cache", "v_cache")
    )
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
    blocks = paged_attention_plan(
        max_q_len, group, head_dim, q.dtype, checked_target(NAME, q)
    ).launch_options()
    num_q_blocks = triton.cdiv(max_q_len * group, blocks["BLOCK_M"])
    if num_splits is None:
        num_splits = choose_num_splits(
            num_q_blocks * num_seqs * num_kv_heads, max_seq_len, num_sms(q.device)
        )
    if num_splits < 1:
        raise KernelInputError(f"{NAME}: num_splits must be >= 1, got {num_splits}")

    if num_splits == 1:
        target, m_part, l_part = (
            out,
            out,
            out,
        )  # the partial buffers are not touched without split-K
        stride_o_split, stride_ml = 0, (0, 0)
    else:
        target = torch.empty(
            num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
        )
        m_part = torch.empty(
            num_tokens, num_heads, num_splits, dtype=torch.float32, device=q.device
        )
        l_part = torch.empty_like(m_part)
        stride_o_split, stride_ml = target.stride(2), m_part.stride()[:2]
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
        **blocks,
    )
    if num_splits > 1:
        split_k_reduce(target, m_part, l_part, out)
    return out
