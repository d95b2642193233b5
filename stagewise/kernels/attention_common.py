"""What FlashAttention and paged attention share: the tile's rows, the key loop, the online softmax.

Both kernels run one program per (row tile, sequence, KV head x split). A
tile's BLOCK_M rows are (query, group head) pairs of one KV head, query-major
(row r -> query r // G, head kv_head * G + r % G), so the G query heads that
share a KV head read each K/V tile once. The program loads its Q tile once,
then walks its keys BLOCK_N at a time (`attend_keys`), keeping per row

    m    the largest scaled score seen so far   (base 2: c = scale * log2 e, m = max c * s)
    l    the sum of exp2(c s - m) over the keys seen
    acc  the sum of exp2(c s - m) * v           [d]

and folding each tile of raw scores s_j = q . k_j in (`attend_tile`; Milakov & Gimelshein 2018):

    m_new = max(m, c max_j s_j)   alpha = exp2(m - m_new)   p_j = exp2(c s_j - m_new)
    l = alpha * l + sum_j p_j     acc = alpha * acc + sum_j p_j v_j   ...   out = acc / l

c s_j - m_new is one fused multiply-add per score (the scale is never applied on its own), and
exp2 is the GPU's native exponential (exp(x) costs an extra multiply by log2 e).

Only one [BLOCK_M, BLOCK_N] tile of scores exists, in registers: O(N) extra
memory where the naive path holds O(N^2). `key_range` skips the keys no row
sees (causal, bottom-right aligned) and marks the tiles every row sees whole,
which run without masks. m starts at a large finite negative number, so a row
that sees no key keeps l = 0 without a NaN, and writes 0. The kernels differ
only in where a key lives: a row of k/v, or a slot through the block table.
`online_softmax_reference` is the same loop in PyTorch, for reading and tests.

Offsets: element offsets (row * stride) are 32-bit unless a tensor spans 2^31 elements or more
(`needs_int64_offsets`); 32-bit integer math is cheaper and leaves registers for the tiles.

Batch invariance (`batch_invariant=True` in both launchers, the stages' default): a row's output
must be the same bits whether it is a decode row, one of a prefill's or chunk's rows, in paged or
contiguous K/V, alone or among others. Three things would change them, and each is fixed:

- the tile: BLOCK_N sets the order of the key loop, and on a GPU BLOCK_M and the warps set how a
  row's sums spread over threads and which tensor-core instruction runs. Both kernels take one
  tile (`invariant_tile`) for every query length, decode and prefill alike;
- the split of a decode's keys over programs, chosen by occupancy (split_k.py): every row's keys
  are reduced in fixed chunks of KEY_CHUNK keys, each from an empty state, merged in order
  (`attend_chunks`, `merge_states`). A program may walk all the chunks or only one (split-K):
  the merges are the same, so the choice is the GPU's to make and changes no bit;
- the masks: a tile's rows see different keys, so a key tile runs masked for some rows and whole
  for others, and past a row's last key a tile is all masked for it. Masking keeps a visible
  score's value, and a fully masked tile or chunk leaves the state's bits unchanged.
"""

import math

import torch
import triton
import triton.language as tl

from stagewise.kernels.checks import (
    FLOAT_DTYPES,
    KernelInputError,
    check_dim,
    check_dtype,
    check_head_dim,
    check_last_dim_contiguous,
    check_shape,
)
from stagewise.kernels.targets import Target, fma_dots

LOG2E = 1.4426950408889634  # log2(e): exp(x) == exp2(x * LOG2E)
# the running max's start: finite, so a row with no visible key never computes -inf - -inf
M_INIT_VALUE = -1.0e30
M_INIT = tl.constexpr(M_INIT_VALUE)  # the same for kernels (jit code reads constexpr globals only)


def online_softmax_reference(
    scores: torch.Tensor, values: torch.Tensor, block_n: int
) -> torch.Tensor:
    """softmax(scores) @ values, walking the keys `block_n` at a time; never holds a full row of P.

    scores [M, N] (-inf = masked), values [N, d] -> [M, d]. Rows with no finite score give 0.
    """
    scores, values = scores.double(), values.double()
    rows, dim = scores.shape[0], values.shape[1]
    m = torch.full((rows,), M_INIT_VALUE, dtype=torch.float64)  # [M] running max
    row_sum = torch.zeros(rows, dtype=torch.float64)  # [M] running sum of exp(s - m)
    acc = torch.zeros(rows, dim, dtype=torch.float64)  # [M, d] running sum of exp(s - m) v
    for start in range(0, scores.shape[1], block_n):
        s = scores[:, start : start + block_n]  # [M, block_n]: one tile of scores
        m_new = torch.maximum(m, s.max(dim=1).values)  # [M]
        alpha = torch.exp(m - m_new)  # [M] rescale factor for everything summed so far
        p = torch.exp(s - m_new[:, None])  # [M, block_n]
        row_sum = alpha * row_sum + p.sum(dim=1)
        acc = alpha[:, None] * acc + p @ values[start : start + block_n]  # [M, bn] @ [bn, d]
        m = m_new
    return torch.where(row_sum[:, None] > 0, acc / row_sum.clamp_min(1e-300)[:, None], 0.0)


@triton.jit
def program_tile(
    cu_seqlens_q_ptr,  # [B+1] int32: query rows of each sequence
    BLOCK_M: tl.constexpr,  # (query, group head) rows per tile
    NUM_SPLITS: tl.constexpr,  # programs sharing one tile's keys (1 = no split-K)
):
    """Grid (row tile, sequence, KV head x split) -> (seq, kv_head, split, q_start, q_len, f0).

    f0 is the tile's first (query, group head) row within the sequence. Row tiles run in reverse:
    with a causal mask the last tile sees the most keys, and a GPU starts blocks roughly in order
    of their id, so the longest programs start first and the short ones fill the tail.
    """
    row_tile = tl.num_programs(0) - 1 - tl.program_id(0)  # heaviest (last) row tile first
    seq = tl.program_id(1)
    kv_head = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    return seq, kv_head, split, q_start, q_len, row_tile * BLOCK_M


@triton.jit
def load_query_tile(
    q_ptr,  # [T, H, d] queries, last dim contiguous
    q_start,  # the sequence's first query row
    q_len,  # the sequence's query rows
    f0,  # the tile's first (query, group head) row
    kv_head,  # the KV head whose group the tile holds
    stride_q_token,  # elements between consecutive query tokens
    stride_q_head,  # elements between consecutive query heads
    GROUP: tl.constexpr,  # query heads per KV head, H // Hkv
    HEAD_DIM: tl.constexpr,  # d (a power of two)
    BLOCK_M: tl.constexpr,  # rows per tile
    FP32_DOTS: tl.constexpr,  # convert the tile to fp32 after the load
    INT64_OFFSETS: tl.constexpr,  # row * stride may pass 2^31: 64-bit offsets
):
    """The tile's rows and its Q tile: (q [BLOCK_M, HEAD_DIM], query, head, row_ok, q_rows)."""
    flat = f0 + tl.arange(0, BLOCK_M)  # [BLOCK_M] packed rows
    query = flat // GROUP  # [BLOCK_M] query within the sequence
    head = kv_head * GROUP + flat % GROUP  # [BLOCK_M] query head: GQA by index map, no K/V copy
    row_ok = query < q_len
    q_rows = q_start + query
    if INT64_OFFSETS:
        q_rows = q_rows.to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)
    rows = q_rows[:, None] * stride_q_token + head[:, None] * stride_q_head  # [BLOCK_M, 1]
    q = tl.load(q_ptr + rows + dims[None, :], mask=row_ok[:, None], other=0.0)
    if FP32_DOTS:
        q = q.to(tl.float32)
    return q, query, head, row_ok, q_rows


@triton.jit
def key_range(
    f0,  # the tile's first (query, group head) row
    q_len,  # the sequence's query rows
    k_len,  # the sequence's keys
    split,  # this program's share of the keys (split-K)
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_M: tl.constexpr,  # rows per tile
    BLOCK_N: tl.constexpr,  # keys per tile
    NUM_SPLITS: tl.constexpr,  # programs sharing one tile's keys (1 = no split-K)
    KEY_CHUNK: tl.constexpr,  # > 0 (batch-invariant): split s takes keys [s, s + 1) * KEY_CHUNK
):
    """The keys this program visits: (lo, mid, hi), multiples of BLOCK_N from lo.

    Query i sees keys j <= i + k_len - q_len (causal, aligned bottom-right). The tile's rows span
    queries f0 // G to its last row's; so keys [lo, mid) are seen by every row (no mask work at
    all), [mid, hi) is the diagonal band (masked), and keys past hi are never loaded. Split-K
    shares [0, hi) out among NUM_SPLITS programs, or (KEY_CHUNK > 0) gives split s the s-th chunk
    of KEY_CHUNK keys: a fixed size, whatever the number of splits.
    """
    shift = k_len - q_len
    last_query = (tl.minimum(f0 + BLOCK_M, q_len * GROUP) - 1) // GROUP  # the tile's last query
    hi = tl.maximum(tl.minimum(k_len, last_query + shift + 1), 0)  # no row sees keys past hi
    full = tl.maximum(tl.minimum(k_len, f0 // GROUP + shift + 1), 0)  # all rows see keys < full
    full = (full // BLOCK_N) * BLOCK_N  # whole tiles only
    lo = hi * 0
    if NUM_SPLITS > 1:  # this program's share of [0, hi), in whole tiles
        if KEY_CHUNK > 0:
            per_split = KEY_CHUNK
        else:
            per_split = tl.cdiv(tl.cdiv(hi, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = tl.minimum(split * per_split, hi)
        hi = tl.minimum(lo + per_split, hi)
    mid = tl.maximum(lo, tl.minimum(full, hi))
    return lo, mid, hi


@triton.jit
def attend_keys(
    acc,  # [BLOCK_M, HEAD_DIM] fp32 running sum of p * v
    m_i,  # [BLOCK_M] fp32 running max of the scores (base-2 units)
    l_i,  # [BLOCK_M] fp32 running sum of p
    q,  # [BLOCK_M, HEAD_DIM] the query tile
    query,  # [BLOCK_M] each row's query within the sequence
    row_ok,  # [BLOCK_M] bool: the row exists
    k_base,  # [1, HEAD_DIM] pointers: key row (or slot) 0 of this KV head
    v_base,  # [1, HEAD_DIM] pointers: value row (or slot) 0 of this KV head
    stride_k_row,  # elements between consecutive key rows (or cache slots)
    stride_v_row,  # elements between consecutive value rows (or cache slots)
    key_start,  # contiguous K/V: the sequence's first key row (unused when PAGED)
    block_table_row_ptr,  # paged K/V: [max_blocks] int32 the sequence's blocks (read when PAGED)
    k_len,  # the sequence's keys
    shift,  # k_len - q_len: query i sees keys j <= i + shift
    n_lo,  # first key to visit
    n_hi,  # end of the keys to visit
    qk_scale,  # softmax scale * log2(e)
    BLOCK_N: tl.constexpr,  # keys per tile
    BLOCK_SIZE: tl.constexpr,  # paged: tokens per cache block
    PAGED: tl.constexpr,  # K/V through the block table
    MASKED: tl.constexpr,  # the causal and length masks (False: every row sees every key)
    FP32_DOTS: tl.constexpr,  # convert tiles to fp32 after the load
    INPUT_PRECISION: tl.constexpr,  # "ieee" or "tf32" for fp32 tiles (precision.py)
    INT64_OFFSETS: tl.constexpr,  # row * stride may pass 2^31: 64-bit offsets
):
    """Fold the keys [n_lo, n_hi) into (acc, m, l), one [BLOCK_N, HEAD_DIM] K/V tile at a time.

    Paged: key n of the sequence lives in slot block_table[n // BLOCK_SIZE] * BLOCK_SIZE
    + n % BLOCK_SIZE, so a tile may span several cache blocks, or part of one.
    """
    for n0 in range(n_lo, n_hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions within the sequence
        in_seq = pos < k_len
        if PAGED:
            blocks = block_table_row_ptr + pos // BLOCK_SIZE
            if MASKED:
                block_id = tl.load(blocks, mask=in_seq, other=0)
            else:
                block_id = tl.load(blocks)
            if INT64_OFFSETS:
                block_id = block_id.to(tl.int64)
            rows = block_id * BLOCK_SIZE + pos % BLOCK_SIZE
        else:
            rows = key_start + pos
            if INT64_OFFSETS:
                rows = rows.to(tl.int64)
        k_ptrs = k_base + rows[:, None] * stride_k_row  # [BLOCK_N, HEAD_DIM]
        v_ptrs = v_base + rows[:, None] * stride_v_row
        if MASKED:
            k = tl.load(k_ptrs, mask=in_seq[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=in_seq[:, None], other=0.0)
            visible = (pos[None, :] <= query[:, None] + shift) & in_seq[None, :]  # [BM, BN]
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
            visible = row_ok[:, None]  # unread
        if FP32_DOTS:
            k, v = k.to(tl.float32), v.to(tl.float32)
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, k, v, visible, qk_scale, MASKED, INPUT_PRECISION
        )
    return acc, m_i, l_i


@triton.jit
def attend_tile(
    acc,  # [BLOCK_M, HEAD_DIM] fp32 running sum of p * v
    m_i,  # [BLOCK_M] fp32 running max of the scaled scores (base-2 units)
    l_i,  # [BLOCK_M] fp32 running sum of p
    q,  # [BLOCK_M, HEAD_DIM] query tile (fp32 when FP32_DOTS, else the input dtype)
    k,  # [BLOCK_N, HEAD_DIM] key tile
    v,  # [BLOCK_N, HEAD_DIM] value tile
    visible,  # [BLOCK_M, BLOCK_N] bool: may this row see this key (read only when MASKED)
    qk_scale,  # softmax scale * log2(e)
    MASKED: tl.constexpr,  # False for tiles that every row sees whole: no mask work at all
    INPUT_PRECISION: tl.constexpr,  # "ieee" or "tf32" for fp32 tiles; 16-bit ignore it
):
    """One step of the online softmax: fold one K/V tile into (acc, m, l).

    q, k, v are all fp32 (fp32 dots) or all 16-bit (tensor-core dots, fp32 accumulation).
    """
    s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)  # [BLOCK_M, BLOCK_N] fp32, raw
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)  # [BLOCK_M]; qk_scale > 0 keeps the max
    alpha = tl.math.exp2(m_i - m_new)  # [BLOCK_M] rescales the old sums to the new max
    # one FMA per score: s * qk_scale - m_new; masked -> exp2(-inf) = 0
    p = tl.math.exp2(s * qk_scale - m_new[:, None])  # [BLOCK_M, BLOCK_N]
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    # 16-bit v: P rounded to 16 bits before P @ V, as in FlashAttention
    acc += tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def merge_states(acc_a, m_a, l_a, acc_b, m_b, l_b):
    """The online-softmax state of keys A then keys B, from the state of each alone:

        m = max(m_a, m_b)   l = l_a 2^(m_a - m) + l_b 2^(m_b - m)   acc likewise, per row.

    acc [BLOCK_M, HEAD_DIM], m and l [BLOCK_M], fp32. Written with explicit fused multiply-adds so
    every kernel that merges (attend_chunks, split_k.py's reduce) rounds alike. An empty state (m
    = M_INIT, l = 0, acc = 0) on either side leaves the other's bits unchanged: its weight is
    exp2(M_INIT - m) = 0, the other's exp2(0) = 1.
    """
    m = tl.maximum(m_a, m_b)
    w_a = tl.math.exp2(m_a - m)  # [BLOCK_M]
    w_b = tl.math.exp2(m_b - m)
    l_i = tl.fma(l_a, w_a, l_b * w_b)
    acc = tl.fma(acc_a, w_a[:, None], acc_b * w_b[:, None])  # [BLOCK_M, HEAD_DIM]
    return acc, m, l_i


@triton.jit
def attend_chunks(
    q,  # [BLOCK_M, HEAD_DIM] the query tile
    query,  # [BLOCK_M] each row's query within the sequence
    row_ok,  # [BLOCK_M] bool: the row exists
    k_base,  # [1, HEAD_DIM] pointers: key row (or slot) 0 of this KV head
    v_base,  # [1, HEAD_DIM] pointers: value row (or slot) 0 of this KV head
    stride_k_row,  # elements between consecutive key rows (or cache slots)
    stride_v_row,  # elements between consecutive value rows (or cache slots)
    key_start,  # contiguous K/V: the sequence's first key row (unused when PAGED)
    block_table_row_ptr,  # paged K/V: [max_blocks] int32 the sequence's blocks (read when PAGED)
    k_len,  # the sequence's keys
    shift,  # k_len - q_len: query i sees keys j <= i + shift
    lo,  # first key to visit (a multiple of KEY_CHUNK)
    mid,  # keys [lo, mid) are seen whole by every row
    hi,  # end of the keys to visit
    qk_scale,  # softmax scale * log2(e)
    BLOCK_M: tl.constexpr,  # rows per tile
    HEAD_DIM: tl.constexpr,  # d
    BLOCK_N: tl.constexpr,  # keys per tile
    KEY_CHUNK: tl.constexpr,  # keys per chunk: a multiple of BLOCK_N
    BLOCK_SIZE: tl.constexpr,  # paged: tokens per cache block
    PAGED: tl.constexpr,  # K/V through the block table
    FP32_DOTS: tl.constexpr,  # convert tiles to fp32 after the load
    INPUT_PRECISION: tl.constexpr,  # "ieee" or "tf32" for fp32 tiles (precision.py)
    INT64_OFFSETS: tl.constexpr,  # row * stride may pass 2^31: 64-bit offsets
):
    """The keys [lo, hi) in fixed chunks of KEY_CHUNK: each chunk's online softmax from an empty
    state, the chunks merged in order (`merge_states`) -> (acc, m, l).

    This is the batch-invariant reduction: a row's result depends on its own keys only, never on
    the other rows of its tile (which keys run masked, where the tile's last key lies) nor on
    whether a chunk ran here or in a split program of its own (split_k.py merges those partials
    with the same `merge_states`, in the same order).
    """
    acc_t = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # the chunks merged so far
    m_t = tl.full([BLOCK_M], M_INIT, dtype=tl.float32)
    l_t = tl.zeros([BLOCK_M], dtype=tl.float32)
    for c0 in range(lo, hi, KEY_CHUNK):
        c1 = tl.minimum(c0 + KEY_CHUNK, hi)
        whole = tl.maximum(c0, tl.minimum(mid, c1))  # [c0, whole): every row sees these keys
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # this chunk's state, from empty
        m_i = tl.full([BLOCK_M], M_INIT, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc, m_i, l_i = attend_keys(
            acc, m_i, l_i, q, query, row_ok, k_base, v_base, stride_k_row, stride_v_row,
            key_start, block_table_row_ptr, k_len, shift, c0, whole, qk_scale,
            BLOCK_N, BLOCK_SIZE, PAGED, False, FP32_DOTS, INPUT_PRECISION, INT64_OFFSETS,
        )  # fmt: skip
        acc, m_i, l_i = attend_keys(
            acc, m_i, l_i, q, query, row_ok, k_base, v_base, stride_k_row, stride_v_row,
            key_start, block_table_row_ptr, k_len, shift, whole, c1, qk_scale,
            BLOCK_N, BLOCK_SIZE, PAGED, True, FP32_DOTS, INPUT_PRECISION, INT64_OFFSETS,
        )  # fmt: skip
        acc_t, m_t, l_t = merge_states(acc_t, m_t, l_t, acc, m_i, l_i)
    return acc_t, m_t, l_t


@triton.jit
def store_rows(
    out_ptr,  # [T, H, d] output (NUM_SPLITS == 1) or [T, H, NUM_SPLITS, d] fp32 partial acc
    m_part_ptr,  # [T, H, NUM_SPLITS] fp32 partial running max (split-K only)
    l_part_ptr,  # [T, H, NUM_SPLITS] fp32 partial running sum (split-K only)
    acc,  # [BLOCK_M, HEAD_DIM] fp32 running sum of p * v
    m_i,  # [BLOCK_M] fp32 running max
    l_i,  # [BLOCK_M] fp32 running sum of p
    q_rows,  # [BLOCK_M] token rows of the tile (int64 when INT64_OFFSETS)
    head,  # [BLOCK_M] query heads of the tile
    row_ok,  # [BLOCK_M] bool: the row exists
    split,  # this program's split
    stride_o_token,  # elements between consecutive output tokens (of out or the partial acc)
    stride_o_head,  # elements between consecutive output heads (of out or the partial acc)
    stride_o_split,  # elements between consecutive splits of the partial acc
    stride_ml_token,  # elements between consecutive tokens of m_part / l_part
    stride_ml_head,  # elements between consecutive heads of m_part / l_part
    HEAD_DIM: tl.constexpr,  # d
    NUM_SPLITS: tl.constexpr,  # 1: write acc / l; more: the unnormalised partials
):
    """Write the tile: acc / l (0 for a row that saw no key), or split-K's partials (acc, m, l)."""
    dims = tl.arange(0, HEAD_DIM)
    o_rows = q_rows[:, None] * stride_o_token + head[:, None] * stride_o_head  # [BLOCK_M, 1]
    if NUM_SPLITS == 1:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # a row that saw no key has acc == 0, l == 0
        out = (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + o_rows + dims[None, :], out, mask=row_ok[:, None])
    else:  # split_k_reduce merges the NUM_SPLITS partials of each row (split_k.py)
        o_split = o_rows + split * stride_o_split + dims[None, :]
        tl.store(out_ptr + o_split, acc, mask=row_ok[:, None])
        ml_rows = q_rows * stride_ml_token + head * stride_ml_head + split  # [BLOCK_M]
        tl.store(m_part_ptr + ml_rows, m_i, mask=row_ok)
        tl.store(l_part_ptr + ml_rows, l_i, mask=row_ok)


def check_qkv(
    kernel: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_ndim: int,
    kv_names=("k", "v"),
) -> tuple[int, int, int]:
    """q [T, H, d], K/V [..., Hkv, d]: one dtype and head_dim, H a multiple of Hkv -> H, Hkv, d."""
    k_name, v_name = kv_names
    check_dim(kernel, "q", q, 3)
    check_dim(kernel, k_name, k, kv_ndim)
    check_dtype(kernel, "q", q, FLOAT_DTYPES)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise KernelInputError(
            f"{kernel}: q, {k_name}, {v_name} must share one dtype, "
            f"got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    check_shape(kernel, v_name, v, tuple(k.shape))
    for name, t in (("q", q), (k_name, k), (v_name, v)):
        check_last_dim_contiguous(kernel, name, t)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[-2]
    if k.shape[-1] != head_dim:
        raise KernelInputError(
            f"{kernel}: {k_name} has head_dim {k.shape[-1]}, but q has {head_dim}"
        )
    check_head_dim(kernel, head_dim)
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise KernelInputError(
            f"{kernel}: {num_heads} query heads cannot share {num_kv_heads} KV heads "
            "(GQA needs H % Hkv == 0)"
        )
    return num_heads, num_kv_heads, head_dim


def check_index(kernel: str, name: str, t: torch.Tensor, length: int | None) -> None:
    """A 1-D int32 index tensor (cu_seqlens, seq_lens) of the given length."""
    check_dtype(kernel, name, t, (torch.int32,))
    check_shape(kernel, name, t, (length,))


def check_cu_seqlens_q(kernel: str, cu_q: list[int], num_tokens: int) -> None:
    """cu_seqlens_q must start at 0, never decrease and end at the number of query rows."""
    if cu_q[0] != 0 or cu_q[-1] != num_tokens or any(b < a for a, b in zip(cu_q, cu_q[1:])):
        raise KernelInputError(
            f"{kernel}: cu_seqlens_q {cu_q} must rise from 0 to the {num_tokens} query rows, "
            "never decreasing"
        )


def qk_scale_log2(scale: float) -> float:
    """The softmax scale in base-2 units: exp(s * scale) == exp2(s * scale * log2(e))."""
    if not math.isfinite(scale) or scale <= 0:
        raise KernelInputError(f"attention: scale must be a positive finite number, got {scale}")
    return float(scale) * LOG2E


# Batch-invariant attention: every row's keys in chunks of this many (a multiple of every BLOCK_N
# below); a decode split-K gives each program one chunk. 256 keys = 4 tiles of 64 between merges.
KEY_CHUNK = 256
# (BLOCK_M, BLOCK_N, num_warps, num_stages): the one tile of both kernels for every query length.
# Tensor cores: the first that fits (`tile_fits` with the chunks' merged state: a second [BLOCK_M,
# d] fp32 accumulator). 8 warps for 64 rows: with 4, Llama-3-8B's d 128 spills 200-600 B/thread on
# sm_80/89/90 (the compile gate); with 8, none.
INVARIANT_TILES = [(64, 64, 8, 2), (64, 32, 8, 2), (32, 32, 4, 2), (16, 32, 4, 2), (16, 16, 4, 2)]
# FMA dots: fp32 from sm_80 (clean at d 64 and 128 on sm_80/89/90), and sm_75's fp16 (the smallest)
INVARIANT_FMA_TILE, SM75_INVARIANT_TILE = (32, 16, 8, 2), (16, 16, 4, 2)
INTERPRETER_INVARIANT_TILE = (64, 32, 4, 1)  # few programs: the interpreter pays per operation


def invariant_tile(head_dim: int, dtype, target: Target) -> tuple[dict, int, int]:
    """({"BLOCK_M", "BLOCK_N", "KEY_CHUNK"}, num_warps, num_stages): the tile and key chunk flash
    and paged attention both use, batch-invariant, for every query length on this target."""
    if target.interpreter:
        block_m, block_n, warps, stages = INTERPRETER_INVARIANT_TILE
    elif target.capability < 80:
        block_m, block_n, warps, stages = SM75_INVARIANT_TILE
    elif fma_dots(dtype, target):
        block_m, block_n, warps, stages = INVARIANT_FMA_TILE
    else:
        fits = [t for t in INVARIANT_TILES if tile_fits(*t, head_dim, dtype, target, True)]
        block_m, block_n, warps, stages = (fits or INVARIANT_TILES[-1:])[0]
    if KEY_CHUNK % block_n:
        raise KernelInputError(
            f"attention: KEY_CHUNK {KEY_CHUNK} is not a multiple of BLOCK_N {block_n}"
        )
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "KEY_CHUNK": KEY_CHUNK}, warps, stages


INT32_LIMIT = 2**31
MAX_TILE_ROWS = 256  # rows a masked tile may run past its tensor's end (BLOCK_M or BLOCK_N)


def needs_int64_offsets(*tensors: torch.Tensor) -> bool:
    """Whether a kernel's element offsets may pass 2^31, so they need 64-bit integers.

    Every offset a kernel forms into tensor t is at most the last element's, sum((size - 1) *
    stride), plus MAX_TILE_ROWS rows past the end (masked tail rows form an address they never
    load): below 2^31 for every tensor, 32-bit offsets cannot overflow.
    """
    for t in tensors:
        last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0)
        if last + MAX_TILE_ROWS * max(t.stride(), default=1) >= INT32_LIMIT:
            return True
    return False


def tile_fits(
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
    head_dim: int,
    dtype,
    target: Target,
    merged_state: bool = False,
):
    """Whether an attention tile fits a GPU: its shared memory, and registers without spilling.

    merged_state: the batch-invariant key loop (`attend_chunks`) also holds the merged chunks'
    [BLOCK_M, d] fp32 accumulator (tensor-core tiles only; FMA tiles are chosen apart).

    Shared memory (bytes): num_stages - 1 pairs of K and V tiles [BLOCK_N, d] in flight, the Q tile
    [BLOCK_M, d], the P tile [BLOCK_M, BLOCK_N] staged for the second dot, the row statistics; the
    compile gate checks this stays at or above what Triton allocates.

    Registers: on tensor cores each thread holds its share of the fp32 accumulator [BLOCK_M, d]
    and scores [BLOCK_M, BLOCK_N] (plus their 16-bit copies for the dots); past ~160 32-bit words
    of that ptxas spills (measured: 152 clean, 176 spills). Where the K/V tiles live depends on
    the dot instruction:

    - sm_80 / sm_89 `mma.sync` takes both operands from registers, so each thread also holds its
      share of the K and V tiles [BLOCK_N, d]: they count against the 160 words.
    - sm_90 `wgmma` reads its B operand (K^T for S = Q K^T, V for P V) straight from shared
      memory: the K/V tiles stay there and cost no registers. A 16-bit head_dim-128 tile of
      (128 rows, 64 keys, 8 warps) is 144 words on sm_90, but 176 counting K/V as on sm_80.

    FMA dots (fp32, pre-Ampere) keep whole operand rows per thread: they need BLOCK_M * BLOCK_N * d
    <= 512 per thread (256 on sm_90, sm_75).
    """
    if target.interpreter:
        return True
    size, threads = dtype.itemsize, 32 * num_warps
    kv = 2 * block_n * head_dim * size
    shared = (
        max(num_stages - 1, 1) * kv + (block_m * head_dim + block_m * block_n) * size + block_m * 4
    )
    if fma_dots(dtype, target):  # measured: sm_90 (ptxas 13) and sm_75 spill at half of sm_80/89
        per_thread = 512 if 80 <= target.capability < 90 else 256
        registers_ok = block_m * block_n * head_dim <= per_thread * threads
    else:
        kv_in_registers = 0 if kv_tiles_in_shared_memory(target) else kv
        words = block_m * head_dim * (4 + size) + block_m * block_n * (4 + size) + kv_in_registers
        words += block_m * head_dim * 4 if merged_state else 0
        registers_ok = words // (4 * threads) <= 160
    return shared <= target.shared_memory and registers_ok


def kv_tiles_in_shared_memory(target: Target) -> bool:
    """Whether tensor-core dots read K/V tiles from shared memory (wgmma, sm_90) or registers."""
    return not target.interpreter and target.capability == 90
