"""Every query row over fixed-size key chunks: a row's bits do not depend on who shares its call.

    qg [B, Hkv, R, d], k / v [B, S, Hkv, d] (S a multiple of CHUNK_KEYS), limit [B, R]
        -> out [B, Hkv, R, d]          row r of problem b sees keys 0 .. limit[b, r] - 1

A query row is one (query position, query head) pair; the G query heads that
share a KV head are G rows of one problem (GQA without copying K/V). A decode
step is R = G rows per sequence; a prefill of Lq positions is R = G * Lq rows
of one sequence; a speculative verify is G * (k + 1). The textbook
`softmax(q k^T * scale) v` over all keys in one call adds its terms in an
order the library picks from the call's shape, so the same row gets other
bits alone and batched, as a decode row and as row 5 of a prefill chunk
(measured: 2-3e-7 apart). With packed weights the activations are rounded to
bfloat16 before every GEMM, so 1e-7 can move one rounding, that 1/256 step
grows through 30 layers, and a greedy token whose two best logits nearly tie
flips. So every row, whatever its call, runs the same arithmetic:

    scores [R, S] = q [R, d] @ k^T [d, S] * scale        one dot of d terms per (row, key)
    masked: key j > the row's last position -> -inf
    m   = max over the row's keys                       (a max is exact in any order)
    p   = exp(scores - m)                               masked keys -> exactly 0
    l_c = sum over the C keys of chunk c of p           a fixed-length sum, C = CHUNK_KEYS
    o_c = p_c [R, C] @ v_c [C, d]                       a fixed-shape product per chunk
    out = (o_0 + o_1 + ...) / (l_0 + l_1 + ...)         added in chunk order (a prefix sum)

The keys are cut at absolute positions 0, C, 2C, ...: a chunk's sums never
change with the call. A chunk wholly past a row's last key adds exact zeros,
so a decode row padded to a longer neighbour, or a prefill row beside later
rows, changes no bit. This is flash decoding's split-KV with a fixed split
*size* (never a fixed count), the rule batch-invariant kernels follow.

Why the products give a row the same bits in every call: each output of the
two matrix products is one dot product (d terms, or C terms), and the CPU
BLAS (MKL) computes it as the same chain whatever the number of rows M, the
number of columns, the batch count and the threads, as long as M >= 4 and a
multiple of 4. Below (M = 1, M = 2-3) it takes other kernels, which add in
another order; with 2 threads an M of 5-7 or 9-11 hands its last rows to one
(measured, and checked by tests/stages/test_batch_invariance_ops.py). So the
rows of every call are padded to a multiple of ROW_MULTIPLE: a decode of
SmolLM2's G = 3 heads runs 4 rows, one of them padding.

A prefill runs its rows in blocks of ROWS_PER_BLOCK, each over the chunks up
to its own last key (the causal triangle, not the square), which bounds the
memory of the [R, S] scores and of the per-chunk parts.
"""

import torch
import torch.nn.functional as F

CHUNK_KEYS = 64  # keys per chunk: fixed, so a row's sums never depend on its neighbours
ROW_MULTIPLE = 4  # rows per call rounded up to this: the BLAS's M >= 4 kernels (docstring)
ROWS_PER_BLOCK = 256  # query rows per call in a prefill (a multiple of ROW_MULTIPLE)


def padded_length(num_keys: int) -> int:
    """The keys rounded up to whole chunks: 21 -> 64, 64 -> 64, 65 -> 128."""
    return -(-num_keys // CHUNK_KEYS) * CHUNK_KEYS


def padded_rows(num_rows: int) -> int:
    """Rows rounded up to a multiple of ROW_MULTIPLE: 1 -> 4, 3 -> 4, 9 -> 12."""
    return max(1, -(-num_rows // ROW_MULTIPLE)) * ROW_MULTIPLE


def attend(
    qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, limit: torch.Tensor, scale: float
) -> torch.Tensor:
    """The module's formula: qg [B, Hkv, R, d] (R a multiple of 4), k/v [B, S, Hkv, d] (S whole
    chunks), limit [B, R] int64 (row r sees keys < limit) -> [B, Hkv, R, d] float32.

    A row with limit 0 sees no key and gets zeros (the padding rows of static batching).
    """
    num_seqs, num_kv_heads, rows, head_dim = qg.shape
    padded = k.shape[1]  # S
    chunks = padded // CHUNK_KEYS
    kt = k.float().permute(0, 2, 3, 1)  # [B, S, Hkv, d] -> [B, Hkv, d, S]
    scores = torch.matmul(qg.float(), kt) * scale  # [B,Hkv,R,d] @ [B,Hkv,d,S] -> [B,Hkv,R,S]
    keys = torch.arange(padded, device=qg.device)  # [S]
    allowed = keys < limit.to(qg.device).view(num_seqs, 1, rows, 1)  # [B, 1, R, S]
    scores = scores.masked_fill(~allowed, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)  # [B, Hkv, R, 1]: the row's max
    top = top.masked_fill(top == float("-inf"), 0.0)  # a row that sees no key: all p = 0
    probs = torch.exp(scores - top).view(num_seqs, num_kv_heads, rows, chunks, CHUNK_KEYS)
    sums = probs.sum(dim=-1)  # [B, Hkv, R, n]: C terms each
    pc = probs.permute(0, 1, 3, 2, 4)  # -> [B, Hkv, n, R, C]
    vc = v.float().view(num_seqs, chunks, CHUNK_KEYS, num_kv_heads, head_dim)
    vc = vc.permute(0, 3, 1, 2, 4)  # [B, n, C, Hkv, d] -> [B, Hkv, n, C, d]
    parts = torch.matmul(pc, vc)  # [B,Hkv,n,R,C] @ [B,Hkv,n,C,d] -> [B,Hkv,n,R,d]
    # the chunks' shares added in chunk order (a prefix sum runs in order): zeros past a row's end
    num = parts.cumsum(dim=2)[:, :, -1]  # [B, Hkv, R, d]
    den = sums.cumsum(dim=-1)[..., -1:]  # [B, Hkv, R, 1]
    return torch.where(den > 0, num / den, 0.0)  # [B, Hkv, R, d]


def decode_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """D sequences, one query row each: q [D, H, d], k/v [D, S, Hkv, d] (each padded to S keys),
    seq_lens [D] (its real keys) -> [D, H, d] in q's dtype."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    rows = padded_rows(group)  # G rows per sequence, padded to the BLAS's M >= 4 kernels
    qg = q.float().view(num_seqs, num_kv_heads, group, head_dim)  # [D, Hkv, G, d]
    qg = F.pad(qg, (0, 0, 0, rows - group))  # [D, Hkv, R, d]: zero rows, dropped below
    limit = seq_lens.to(torch.long).view(num_seqs, 1).expand(num_seqs, rows)  # [D, R]
    out = attend(qg, k, v, limit, scale)[:, :, :group]  # [D, Hkv, G, d]
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)  # [D, H, d]


def sequence_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence: q [Lq, H, d] (its last Lq positions), k/v [Lk, Hkv, d] -> [Lq, H, d] float32.

    The causal mask is aligned bottom-right: query i sees key j iff j <= i + (Lk - Lq); a row
    that may see no key (Lq > Lk: static batching's padding rows) gets zeros.
    """
    len_q, num_heads, head_dim = q.shape
    len_k, num_kv_heads = k.shape[:2]
    group = num_heads // num_kv_heads
    total = len_q * group  # R: one row per (query position, query head)
    if len_k == 0:  # no key at all: every row sees none
        return q.new_zeros(q.shape, dtype=torch.float32)
    qg = q.float().view(len_q, num_kv_heads, group, head_dim).permute(1, 0, 2, 3)
    qg = qg.reshape(num_kv_heads, total, head_dim)  # [Hkv, Lq*G, d]: rows (position, head)
    position = torch.arange(total, device=q.device) // group  # [R]: each row's query index
    limit = (position + 1 + len_k - len_q).clamp(min=0)  # [R]: keys each row may see
    pad = padded_length(len_k) - len_k
    kp = F.pad(k.float(), (0, 0, 0, 0, 0, pad)).unsqueeze(0)  # [1, S, Hkv, d]: zero keys, masked
    vp = F.pad(v.float(), (0, 0, 0, 0, 0, pad)).unsqueeze(0)
    out = torch.empty(num_kv_heads, total, head_dim, device=q.device)  # [Hkv, R, d]
    for start in range(0, total, ROWS_PER_BLOCK):
        end = min(start + ROWS_PER_BLOCK, total)
        rows = padded_rows(end - start)
        block_limit = F.pad(limit[start:end], (0, rows - (end - start)))  # pad rows see nothing
        last_key = (end - 1) // group + 1 + len_k - len_q  # host ints: the block's last row's keys
        keys = padded_length(max(last_key, 1))  # the block's chunks (at least one)
        block_q = F.pad(qg[:, start:end], (0, 0, 0, rows - (end - start))).unsqueeze(0)
        part = attend(block_q, kp[:, :keys], vp[:, :keys], block_limit.unsqueeze(0), scale)
        out[:, start:end] = part[0, :, : end - start]  # [Hkv, rows, d] -> the block's real rows
    out = out.view(num_kv_heads, len_q, group, head_dim).permute(1, 0, 2, 3)  # [Lq, Hkv, G, d]
    return out.reshape(len_q, num_heads, head_dim)  # [Lq, H, d]
