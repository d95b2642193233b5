"""Attention on the CPU in one compiled loop per query row: decode, prefill, chunk and verify alike.

    q [T, H, d], k_cache / v_cache [num_blocks, block_size, Hkv, d], block table, lengths
        -> out [T, H, d] float32

The torch tier's attention (`stages/chunked_attention.py`) makes a row's bits independent of its
batch by running every row through the same fixed-shape products: keys padded to whole chunks of
64, rows padded to 4, the chunks' parts added in order. That costs a dozen PyTorch calls per
layer, a copy of the sequence's K and V out of the paged cache, and the padding. Compiled code
needs none of it: the order of a sum is simply the order of the loop. For every query row (query
position i of a sequence, query head h, KV head g = h // G) that sees keys j < limit (the causal
mask, aligned bottom-right: limit = keys - (Lq - 1 - i)):

    1. s_j = dot(q, k_j) * scale      the d products in 8 lanes (lane l takes c = l, l + 8, ...,
                                      each a fused multiply-add, in order), then the lanes added
                                      as ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7))
    2. m   = max_j s_j
    3. p_j = exp(s_j - m)             the kernel's own exp, 8 at a time: n = round(x / ln 2),
                                      a degree-6 polynomial of x - n ln 2, times 2^n (within 2
                                      ulp of exp; the same operations in every build)
       den = sum of p_j               in 8 lanes (lane l: j = l, l + 8, ... in order), then the
                                      lanes' tree as in step 1
       num = sum of p_j v_j           for j = 0, 1, 2, ... in order, fused multiply-adds
    4. out = num / den                (a row that sees no key: zeros)

Every row runs exactly that, whatever else is in the call, so its bits are the same as a decode
row, inside a prefill chunk of any size, at any slot and any thread count (the tests sweep it,
and compare the AVX2 build with the plain-C one, where `fmaf` does the fused multiply-add in
software with the same rounding). The speed comes from what does not change any order: the query
rows that share a KV head (a tile of up to 16 rows) read each key and value once for all of them,
straight from the cache through the block table (no copy); eight keys' dot products run at once
and their lane sums are added in transposed registers (the same tree per key); the tiles run on
OpenMP's threads, each tile on one thread. Measured on a 2-core AMD EPYC (AVX2), 2 threads,
SmolLM2's heads (9 query, 3 KV, d = 64), one sequence of 2048 positions prefilled: 3.6 ns per
(row, key) pair against 9.2 for the torch tier's chunked products; one decode row over 109 keys:
50 us against 430 (that one mostly the calls' overhead).

It is not the torch tier's bits (MKL adds a dot product's terms in another order), so when it
runs, it runs for every row of every mode (paged, and the contiguous layout of `mode="kv"`), and a
model's logits stay the same across modes and batches. It is part of the compiled CPU kernels
(`build.py`: STAGEWISE_CPU_KERNELS=1, a C++ compiler), float32 and d a multiple of 8; otherwise
the torch tier's chunked form runs. The float formula it computes is `paged_attention.naive`'s;
the tests compare against it in float64.
"""

import torch

from stagewise.cpu import build
from stagewise.errors import StagewiseError


def serves(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the compiled loop takes this call: the kernels on and built, CPU float32 tensors,
    d a multiple of 8, H a multiple of Hkv with at most 16 query heads per KV head."""
    heads, dim, kv_heads = q.shape[-2], q.shape[-1], k_cache.shape[-2]
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float32
        and k_cache.dtype == torch.float32
        and dim % 8 == 0
        and heads % kv_heads == 0
        and heads // kv_heads <= 16
        and build.library() is not None
    )


def paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    variant: str = "native",
) -> torch.Tensor:
    """q [T, H, d] f32; caches [num_blocks, block_size, Hkv, d] f32; block_table [B, max_blocks]
    int32; cu_seqlens_q [B + 1] int32 (sequence b's rows); seq_lens [B] int32 (its keys, this
    step's included) -> [T, H, d] float32. `variant`: the build (`build.VARIANTS`; tests)."""
    lib = build.library(variant)
    if lib is None:
        raise StagewiseError(f"the CPU attention kernel is not built here ({build.describe()})")
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise StagewiseError(
            f"cpu attention: q must be [T, H, d] and the caches [num_blocks, block_size, Hkv, d], "
            f"got q {list(q.shape)}, k {list(k_cache.shape)}, v {list(v_cache.shape)}"
        )
    num_seqs = seq_lens.shape[0]
    tokens, heads, dim = q.shape
    num_blocks, block_size, kv_heads, kdim = k_cache.shape
    if kdim != dim or heads % kv_heads:
        raise StagewiseError(
            f"cpu attention: q {list(q.shape)} and caches {list(k_cache.shape)} disagree"
        )
    table, cu_q, lens = (_plain(t, torch.int32) for t in (block_table, cu_seqlens_q, seq_lens))
    if table.dim() != 2 or table.shape[0] != num_seqs or cu_q.shape[0] != num_seqs + 1:
        raise StagewiseError(
            f"cpu attention: block table {list(table.shape)}, cu_seqlens_q {list(cu_q.shape)} for "
            f"{num_seqs} sequences"
        )
    q, k_cache, v_cache = (_plain(t, torch.float32) for t in (q, k_cache, v_cache))
    out = torch.empty(tokens, heads, dim, dtype=torch.float32)  # [T, H, d]
    status = lib.sw_paged_attention(
        q.data_ptr(),  # [T, H, d]
        k_cache.data_ptr(),  # [num_blocks, block_size, Hkv, d]
        v_cache.data_ptr(),
        table.data_ptr(),  # [B, max_blocks]
        table.shape[1],
        num_blocks,
        cu_q.data_ptr(),  # [B + 1]
        lens.data_ptr(),  # [B]
        num_seqs,
        tokens,
        heads,
        kv_heads,
        dim,
        block_size,
        float(scale),
        out.data_ptr(),  # [T, H, d]
        torch.get_num_threads(),
    )
    if status == 2:  # checked in the kernel: no host sync here
        raise StagewiseError(
            "cpu attention: lengths or block ids that do not fit the query rows, the block table "
            "or the cache"
        )
    if status:
        raise StagewiseError(f"cpu attention: not served: H {heads}, Hkv {kv_heads}, d {dim}")
    return out


def _plain(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t as a contiguous CPU tensor of dtype (itself when it already is one: no call made)."""
    if t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu":
        return t
    return t.to("cpu", dtype).contiguous()


def sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence in the contiguous layout: q [Lq, H, d] (its last Lq positions), k/v
    [Lk, Hkv, d] -> [Lq, H, d] float32: the same loop, the keys seen as one block."""
    len_q, len_k = q.shape[0], k.shape[0]
    if len_k == 0:
        return q.new_zeros(q.shape, dtype=torch.float32)
    k_cache = k.to(torch.float32).contiguous().unsqueeze(0)  # [1, Lk, Hkv, d]: one block
    v_cache = v.to(torch.float32).contiguous().unsqueeze(0)
    table = torch.zeros(1, 1, dtype=torch.int32)  # [1, 1]: block 0
    cu_q = torch.tensor([0, len_q], dtype=torch.int32)
    lens = torch.tensor([len_k], dtype=torch.int32)
    return paged(q, k_cache, v_cache, table, cu_q, lens, scale)  # [Lq, H, d]
