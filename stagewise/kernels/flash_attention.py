"""FlashAttention for a packed, variable-length batch (prefill, decode on a contiguous cache, any causal varlen).

    q [Tq, H, d], k/v [Tk, Hkv, d], cu_seqlens_q/k [B+1], seqused_k [B] or None -> out [Tq, H, d]

Semantics are the `attention` stage's (stages/attention.py): sequence b owns
query rows cu_seqlens_q[b]:cu_seqlens_q[b+1] and keys from cu_seqlens_k[b],
seqused_k[b] of them (else up to cu_seqlens_k[b+1]); causal mask aligned
bottom-right (query i sees key j iff j <= i + Lk - Lq); rows that see no key
give 0; query head h reads KV head h // G, G = H // Hkv.

Tiles and GQA packing. One program owns one KV head of one sequence and a
tile of BLOCK_M rows; grid (row tile, sequence, KV head). The rows are
(query, group head) pairs, query-major, as in paged attention:

    row r of the sequence  ->  query r // G, query head kv_head * G + r % G

so the G query heads that share a KV head sit in one tile, and every K/V tile
the program loads serves all of them. The program loads its Q tile once, then
walks the sequence's keys BLOCK_N at a time, folding each K/V tile into the
running (acc, m, l) of the online softmax (attention_common.py).

What the packing saves. A decode step (one query per sequence: the static
runner over its contiguous cache) has G rows per KV head: one tile of
BLOCK_M = 16 rows (G <= 16), so each sequence's K/V are read once per KV head
— Hkv * Lk * d * 2 elements — where one program per query head read them G
times (SmolLM2: G = 3; Llama 3 8B: G = 4; 70B: G = 8). In prefill a KV head
has G * Lq rows, G * Lq / BLOCK_M tiles, as many as G heads of Lq / BLOCK_M
tiles had: about the same K/V traffic (a little less: a tile spans BLOCK_M / G
queries, so its causal bound sits closer to the diagonal); one kernel serves both.

Traffic and memory. K/V stream past every row tile: per KV head that is
G * Lq / BLOCK_M passes over the keys (about half of them each, under the
causal mask), Theta(N^2 d / BLOCK_M) elements — FlashAttention's
Theta(N^2 d^2 / M) for on-chip memory M. What becomes O(N) is the *extra
memory*: the [Lq, Lk] score matrix never exists, where the naive path writes
S and P, O(N^2) bytes, and reads them back.

Causal tiles. The tile's queries run from f0 // G to its last row's query; it
sees keys up to j = query + Lk - Lq:

    keys [0, full)        every row of the tile sees them: no mask work at all
    keys [full, hi)       the diagonal band: mask j <= query + Lk - Lq and j < Lk
    keys [hi, Lk)         no row sees them: never loaded

so a causal prefill loads about half of K/V, and only diagonal tiles pay
for the mask.

Split-K (flash decoding). Packing leaves a decode step B * Hkv programs —
too few to fill a GPU at small batch. As in paged attention, the keys of each
tile are then split across NUM_SPLITS programs whose partial (acc, m, l)
`split_k_reduce` merges exactly (split_k.py); `choose_num_splits` decides.

Tile shapes. Up to DECODE_ROWS rows (decode): BLOCK_M 16 and BLOCK_N keys of
about KV_TILE_BYTES per K (or V) tile, a fixed choice as in paged attention.
Longer runs: autotuned on a GPU; the key holds the row bucket, d, G and the dot
precision. The interpreter always uses INTERPRETER_BLOCKS.

Strides: q/k/v may be strided views (q is a view of the fused qkv output:
token stride (H + 2 Hkv) d, head stride d); only the last dimension must be
contiguous.

Dot precision (precision.py, one policy for every kernel): fp16/bf16 inputs
run 16-bit tensor-core dots with fp32 accumulation, P rounded to the input
dtype before P @ V; fp32 inputs run TF32 dots when
torch.backends.cuda.matmul.allow_tf32 is on, IEEE fp32 otherwise (PyTorch's
default). In the CPU interpreter fp16 keeps its 16-bit dots, bf16 tiles (whose
interpreter arithmetic is wrong) are converted to fp32 after the load, and fp32
is always full fp32.
"""

import torch
import triton
import triton.language as tl

from stagewise.kernels import INTERPRETER
from stagewise.kernels.attention_common import (
    M_INIT,
    attend_tile,
    check_cu_seqlens_q,
    check_index,
    check_qkv,
    fma_dots,
    qk_scale_log2,
    tile_fits,
)
from stagewise.kernels.checks import KernelInputError, check_same_device
from stagewise.kernels.precision import dot_policy
from stagewise.kernels.split_k import choose_num_splits, num_sms, split_k_reduce
from stagewise.kernels.targets import LaunchPlan, Target, checked_target, launch_target
from stagewise.runtime import debug_checks

NAME = "flash_attention"
INTERPRETER_BLOCKS = {
    "BLOCK_M": 16,
    "BLOCK_N": 32,
}  # the interpreter pays per op, not per FLOP: few, small tiles
DECODE_ROWS = 16  # a longest run of at most this many (query, group head) rows gets the decode tile
KV_TILE_BYTES = (
    8 * 1024
)  # decode: bytes of one K (or V) tile, sets BLOCK_N; 16 KB spills registers (ptxas)


# GPU tiles (BLOCK_M, BLOCK_N, num_warps, num_stages) the autotuner may try; `_fits` keeps those that fit the
# target, dtype and head_dim. fp32 dots run on FMA units and hold whole operand rows per thread: small tiles.
TILES_16BIT = [
    (128, 64, 4, 3),
    (128, 64, 8, 3),
    (128, 32, 4, 3),
    (128, 32, 8, 3),
    (64, 64, 4, 3),
    (128, 128, 8, 2),
]
TILES_16BIT += [(64, 32, 4, 2)]
TILES_FP32 = [(64, 32, 8, 2), (32, 32, 8, 2), (32, 16, 4, 2), (16, 32, 4, 2), (16, 16, 4, 2)]


def _gpu_configs() -> list:
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)
        for bm, bn, warps, stages in TILES_16BIT + TILES_FP32
    ]


def _fits(config, head_dim: int, dtype, target: Target) -> bool:
    tile = (config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages)
    if tile not in (TILES_FP32 if fma_dots(dtype, target) else TILES_16BIT):
        return False
    return tile_fits(*tile, head_dim, dtype, target)


def _flash_attention_kernel(
    q_ptr,  # [Tq, H, d] queries, last dim contiguous
    k_ptr,  # [Tk, Hkv, d] keys, last dim contiguous
    v_ptr,  # [Tk, Hkv, d] values, last dim contiguous
    out_ptr,  # [Tq, H, d] output (NUM_SPLITS == 1) or [Tq, H, NUM_SPLITS, d] fp32 partial acc
    m_part_ptr,  # [Tq, H, NUM_SPLITS] fp32 partial running max (written only when NUM_SPLITS > 1)
    l_part_ptr,  # [Tq, H, NUM_SPLITS] fp32 partial running sum (written only when NUM_SPLITS > 1)
    cu_seqlens_q_ptr,  # [B+1] int32: query rows of each sequence
    cu_seqlens_k_ptr,  # [B+1] int32: first key row of each sequence
    seqused_k_ptr,  # [B] int32: keys used per sequence (read only when HAS_SEQUSED_K)
    qk_scale,  # softmax scale * log2(e)
    q_len_bucket,  # next power of two >= the longest query run: only an autotune key (short and long tune apart)
    stride_q_token,  # elements between consecutive query tokens
    stride_q_head,  # elements between consecutive query heads
    stride_k_token,  # elements between consecutive key tokens
    stride_k_head,  # elements between consecutive KV heads of k
    stride_v_token,  # elements between consecutive value tokens
    stride_v_head,  # elements between consecutive KV heads of v
    stride_o_token,  # elements between consecutive output tokens (of out or the partial acc)
    stride_o_head,  # elements between consecutive output heads (of out or the partial acc)
    stride_o_split,  # elements between consecutive splits of the partial acc (unused without split-K)
    stride_ml_token,  # elements between consecutive tokens of m_part / l_part
    stride_ml_head,  # elements between consecutive heads of m_part / l_part
    GROUP: tl.constexpr,  # query heads per KV head, H // Hkv
    HEAD_DIM: tl.constexpr,  # d (a power of two)
    BLOCK_M: tl.constexpr,  # (query, group head) rows per tile
    BLOCK_N: tl.constexpr,  # keys per tile
    HAS_SEQUSED_K: tl.constexpr,  # key counts come from seqused_k, not from cu_seqlens_k
    FP32_DOTS: tl.constexpr,  # convert tiles to fp32 after the load (fp32 inputs; bf16 in the interpreter)
    INPUT_PRECISION: tl.constexpr,  # tl.dot input precision of fp32 tiles: "ieee" or "tf32" (precision.py)
    NUM_SPLITS: tl.constexpr,  # programs sharing one tile's keys (1 = no split-K)
):
    q_block = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    f0 = q_block * BLOCK_M  # first (query, group head) row of this tile, within the sequence
    if f0 >= q_len * GROUP:
        return  # this sequence has fewer row tiles than the longest one
    k_start = tl.load(cu_seqlens_k_ptr + seq)
    if HAS_SEQUSED_K:
        k_len = tl.load(seqused_k_ptr + seq)
    else:
        k_len = tl.load(cu_seqlens_k_ptr + seq + 1) - k_start
    shift = k_len - q_len  # bottom-right causal alignment: query i sees keys j <= i + shift

    flat = f0 + tl.arange(0, BLOCK_M)  # [BLOCK_M] packed rows
    query = flat // GROUP  # [BLOCK_M] query within the sequence
    head = kv_head * GROUP + flat % GROUP  # [BLOCK_M] query head: GQA by index map, no copy of K/V
    dims = tl.arange(0, HEAD_DIM)  # [HEAD_DIM]
    row_ok = query < q_len
    q_rows = (q_start + query).to(tl.int64)  # int64: row * stride may pass 2^31
    q_ptrs = (
        q_ptr + q_rows[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :]
    )
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)  # [BLOCK_M, HEAD_DIM]
    if FP32_DOTS:
        q = q.to(tl.float32)

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], M_INIT, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    last_query = (tl.minimum(f0 + BLOCK_M, q_len * GROUP) - 1) // GROUP  # the tile's last query
    hi = tl.maximum(
        tl.minimum(k_len, last_query + shift + 1), 0
    )  # keys past hi: no row of the tile sees them
    full = tl.maximum(
        tl.minimum(k_len, f0 // GROUP + shift + 1), 0
    )  # keys before full: every row sees them
    full = (full // BLOCK_N) * BLOCK_N  # whole tiles only
    lo = 0
    if NUM_SPLITS > 1:  # this program's share of [0, hi), in whole tiles
        per_split = tl.cdiv(tl.cdiv(hi, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = tl.minimum(split * per_split, hi)
        hi = tl.minimum(lo + per_split, hi)
    mid = tl.maximum(lo, tl.minimum(full, hi))  # [lo, mid) unmasked tiles, [mid, hi) masked tiles
    k_base = k_ptr + kv_head * stride_k_head + dims[None, :]
    v_base = v_ptr + kv_head * stride_v_head + dims[None, :]

    for n0 in range(lo, mid, BLOCK_N):  # tiles below the diagonal: no masks
        keys = (k_start + n0 + tl.arange(0, BLOCK_N)).to(tl.int64)  # [BLOCK_N]
        k = tl.load(k_base + keys[:, None] * stride_k_token)  # [BLOCK_N, HEAD_DIM]
        v = tl.load(v_base + keys[:, None] * stride_v_token)
        if FP32_DOTS:
            k, v = k.to(tl.float32), v.to(tl.float32)
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, k, v, row_ok[:, None], qk_scale, False, INPUT_PRECISION
        )

    for n0 in range(mid, hi, BLOCK_N):  # the diagonal band: causal and length masks
        cols = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions within the sequence
        col_ok = cols < k_len
        keys = (k_start + cols).to(tl.int64)
        k = tl.load(k_base + keys[:, None] * stride_k_token, mask=col_ok[:, None], other=0.0)
        v = tl.load(v_base + keys[:, None] * stride_v_token, mask=col_ok[:, None], other=0.0)
        if FP32_DOTS:
            k, v = k.to(tl.float32), v.to(tl.float32)
        visible = (cols[None, :] <= query[:, None] + shift) & col_ok[None, :]  # [BLOCK_M, BLOCK_N]
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, k, v, visible, qk_scale, True, INPUT_PRECISION
        )

    o_rows = q_rows[:, None] * stride_o_token + head[:, None] * stride_o_head  # [BLOCK_M, 1]
    if NUM_SPLITS == 1:
        l_safe = tl.where(
            l_i > 0.0, l_i, 1.0
        )  # a row that saw no key has acc == 0 and l == 0 -> writes 0
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


def _prune_configs(configs: list, named_args: dict, **kwargs) -> list:
    """The autotuner's early prune: only the tiles that fit this device (too big ones fail or spill)."""
    args = {**named_args, **kwargs}
    q = args["q_ptr"]
    keep = [c for c in configs if _fits(c, args["HEAD_DIM"], q.dtype, launch_target(q.device))]
    return keep or configs[-1:]


def _decode_blocks(head_dim: int, fp32_dots: bool) -> dict:
    """The decode tile: 16 rows (a GQA group), BLOCK_N keys of about KV_TILE_BYTES per K (or V) tile.

    16-bit: d 64 -> 64 keys, 128 -> 32, 256 -> 16; fp32 half that (at least 16, tl.dot's minimum).
    fp32 runs unpipelined: with 2 or 3 stages ptxas -v shows spills on sm_89 / sm_90 at some d and G.
    """
    element_bytes = 4 if fp32_dots else 2
    block_n = max(16, min(128, KV_TILE_BYTES // (head_dim * element_bytes)))
    return {"BLOCK_M": 16, "BLOCK_N": block_n, "num_warps": 4, "num_stages": 1 if fp32_dots else 2}


def flash_attention_plan(
    max_q_len: int, group: int, head_dim: int, dtype: torch.dtype, target: Target
) -> LaunchPlan:
    """Tiles: the interpreter's, the decode tile (a GQA group, fixed), or the autotuner's candidates that fit."""
    constexprs = {"GROUP": group, "HEAD_DIM": head_dim}
    if target.interpreter:
        return LaunchPlan(
            NAME, constexprs, (triton.Config(INTERPRETER_BLOCKS, num_warps=4, num_stages=1),)
        )
    if max_q_len * group <= DECODE_ROWS:
        blocks = _decode_blocks(head_dim, dtype == torch.float32)
        warps, stages = blocks.pop("num_warps"), blocks.pop("num_stages")
        while blocks["BLOCK_N"] > 16 and not tile_fits(
            *blocks.values(), warps, stages, head_dim, dtype, target
        ):
            blocks["BLOCK_N"] //= 2  # e.g. sm_75's FMA dots: fewer keys per tile
        return LaunchPlan(
            NAME, constexprs, (triton.Config(blocks, num_warps=warps, num_stages=stages),)
        )
    return LaunchPlan(
        NAME, constexprs, tuple(c for c in _gpu_configs() if _fits(c, head_dim, dtype, target))
    )


_flash_attention_kernel = triton.jit(_flash_attention_kernel)
_tuned_flash_attention_kernel = None
if not INTERPRETER:  # autotune needs a driver: on a GPU only
    _tuned_flash_attention_kernel = triton.autotune(
        configs=_gpu_configs(),
        # INPUT_PRECISION too: a tile shape tuned for TF32 dots is not the one for IEEE fp32 dots
        key=["q_len_bucket", "HEAD_DIM", "GROUP", "FP32_DOTS", "INPUT_PRECISION", "NUM_SPLITS"],
        prune_configs_by={"early_config_prune": _prune_configs},
    )(_flash_attention_kernel)


def _check_values(q, k, cu_seqlens_q, cu_seqlens_k, seqused_k, max_q_len: int | None) -> None:
    """Debug checks: read the offsets on the host and check every sequence's rows lie inside q and k."""
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    check_cu_seqlens_q(NAME, cu_q, q.shape[0])
    used = seqused_k.tolist() if seqused_k is not None else [b - a for a, b in zip(cu_k, cu_k[1:])]
    for b in range(len(cu_q) - 1):
        if used[b] < 0 or cu_k[b] < 0 or cu_k[b] + used[b] > k.shape[0]:
            raise KernelInputError(
                f"{NAME}: sequence {b} reads keys {cu_k[b]}..{cu_k[b] + used[b]} of k, which has {k.shape[0]} rows"
            )
    longest = max((b - a for a, b in zip(cu_q, cu_q[1:])), default=0)
    if max_q_len is not None and max_q_len < longest:
        raise KernelInputError(
            f"{NAME}: max_q_len {max_q_len} is below the longest sequence's {longest} query rows"
        )


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
    seqused_k: torch.Tensor | None = None,
    num_splits: int | None = None,
    max_q_len: int | None = None,
) -> torch.Tensor:
    """q [Tq, H, d], k/v [Tk, Hkv, d], cu_seqlens_q/k [B+1] int32, seqused_k [B] int32 or None -> [Tq, H, d].

    `num_splits` forces split-K (1 = off); None lets `choose_num_splits` decide for the decode tile,
    from the grid and Tk / B keys per sequence (a contiguous cache's capacity per row; no host read).

    `max_q_len` (the longest sequence's query rows, a host int from the scheduler) sizes the grid.
    The launcher never reads cu_seqlens or seqused_k on the host: that would wait for every kernel
    queued before it (a host sync), making the step host-bound and impossible to capture in a CUDA
    graph. Without `max_q_len` it falls back to reading cu_seqlens_q (one sync; the engine always
    passes it). With debug checks on (`stagewise.runtime.debug_checks`) it reads them all and checks
    that every sequence's rows lie inside q and k, and that `max_q_len` covers every sequence.
    """
    num_heads, num_kv_heads, head_dim = check_qkv(NAME, q, k, v, kv_ndim=3)
    check_index(NAME, "cu_seqlens_q", cu_seqlens_q, None)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if num_seqs < 0:
        raise KernelInputError(f"{NAME}: cu_seqlens_q is empty; it needs B+1 offsets")
    check_index(NAME, "cu_seqlens_k", cu_seqlens_k, num_seqs + 1)
    if seqused_k is not None:
        check_index(NAME, "seqused_k", seqused_k, num_seqs)
        check_same_device(
            NAME,
            q=q,
            k=k,
            v=v,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            seqused_k=seqused_k,
        )
    else:
        check_same_device(NAME, q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    qk_scale = qk_scale_log2(scale)
    if debug_checks():
        _check_values(q, k, cu_seqlens_q, cu_seqlens_k, seqused_k, max_q_len)
    if max_q_len is None:  # the fallback: one host read (the engine passes max_q_len)
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if num_seqs > 0 else 0

    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [Tq, H, d]; every row is written
    if max_q_len == 0:
        return out
    group = num_heads // num_kv_heads
    rows = max_q_len * group  # (query, group head) rows of the longest sequence
    policy = dot_policy(q.dtype)
    plan = flash_attention_plan(max_q_len, group, head_dim, q.dtype, checked_target(NAME, q))
    if INTERPRETER or rows <= DECODE_ROWS:  # fixed tiles: the interpreter's, or the decode tile
        kernel, (config,) = _flash_attention_kernel, plan.configs
        blocks = {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}
        if (
            num_splits is None
        ):  # a few long sequences leave SMs idle: split their keys (flash decoding)
            programs = triton.cdiv(rows, blocks["BLOCK_M"]) * num_seqs * num_kv_heads
            num_splits = choose_num_splits(programs, k.shape[0] // num_seqs, num_sms(q.device))
    else:  # autotune picks BLOCK_M / BLOCK_N; a prefill grid is large enough unsplit
        kernel, blocks = _tuned_flash_attention_kernel, {}
    num_splits = 1 if num_splits is None else num_splits
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
            *q.shape[:2], num_splits, head_dim, dtype=torch.float32, device=q.device
        )
        m_part = torch.empty(
            *q.shape[:2], num_splits, dtype=torch.float32, device=q.device
        )  # [Tq, H, S]
        l_part = torch.empty_like(m_part)
        stride_o_split, stride_ml = target.stride(2), m_part.stride()[:2]
    grid = lambda meta: (triton.cdiv(rows, meta["BLOCK_M"]), num_seqs, num_kv_heads * num_splits)
    kernel[grid](
        q_ptr=q,
        k_ptr=k,
        v_ptr=v,
        out_ptr=target,
        m_part_ptr=m_part,
        l_part_ptr=l_part,
        cu_seqlens_q_ptr=cu_seqlens_q,
        cu_seqlens_k_ptr=cu_seqlens_k,
        seqused_k_ptr=seqused_k
        if seqused_k is not None
        else cu_seqlens_k,  # unread without HAS_SEQUSED_K
        qk_scale=qk_scale,
        q_len_bucket=min(triton.next_power_of_2(max_q_len), 8192),
        stride_q_token=q.stride(0),
        stride_q_head=q.stride(1),
        stride_k_token=k.stride(0),
        stride_k_head=k.stride(1),
        stride_v_token=v.stride(0),
        stride_v_head=v.stride(1),
        stride_o_token=target.stride(0),
        stride_o_head=target.stride(1),
        stride_o_split=stride_o_split,
        stride_ml_token=stride_ml[0],
        stride_ml_head=stride_ml[1],
        GROUP=group,
        HEAD_DIM=head_dim,
        HAS_SEQUSED_K=seqused_k is not None,
        FP32_DOTS=policy.fp32_dots,
        INPUT_PRECISION=policy.input_precision,
        NUM_SPLITS=num_splits,
        **blocks,
    )
    if num_splits > 1:
        split_k_reduce(target, m_part, l_part, out)
    return out
