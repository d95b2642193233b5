"""The `torch` tier of paged attention: every decoding sequence of a step attended at once.

    q [T, H, d], k_cache / v_cache [num_blocks, block_size, Hkv, d], metadata -> out [T, H, d]
    (the decoding sequences' D query rows in a few batched ops; the others one by one)

The reference (`paged_attention.naive`) takes one sequence at a time:
gather its blocks into a contiguous copy, then the textbook attention. Every
sequence costs a dozen small PyTorch ops per layer, so with many short
sequences the step is Python and dispatch, not arithmetic. Here D decoding
sequences share the ops:

1. once per step (the same for every layer): the slot of every key,
   `slots [D, S] = block_id * block_size + offset`, padded to the longest
   sequence S, and a mask of the real keys. A padding position points at its
   own sequence's first slot: a real K/V, so the copy holds no garbage from
   an unused block tail (IEEE arithmetic would keep a NaN there a NaN through
   the mask: NaN - inf, 0 * NaN);
2. per layer: one `index_select` of K and one of V through `slots`, then
   `chunked_attention.decode_rows`: attention over fixed-size chunks of keys,
   so that a sequence's numbers are the same bits whoever shares its step
   (that module's docstring says why this matters with packed weights). The
   G query heads that share a KV head are the G query rows of one problem:
   GQA without copying K/V.

Long sequences make big padded copies that no longer stay in cache, so the
decoding sequences are cut into groups of at most `GROUP_KEYS` padded keys.
Measured on a 2-core Intel Xeon, float32, 2 threads, SmolLM2-135M's heads,
lengths drawn from L/2..L, fastest of 7 alternating rounds
(`python -m stagewise.bench.scripts.cpu_forms`; microseconds per layer; "loop" is
the reference's one-by-one form):

    D \ L       64            256            1024
         loop  batched   loop  batched   loop  batched
    1      92     80      156    139      278    259
    2     121    111      258    247      556    428
    4     305    149      550    304      965    840
    8     624    189     1148    994     2353   1785
    16   1276    300     2192   1386     4505   3811
    32   2818   1527     3708   3124     9844   6714

The batched form wins at every size, up to 4x for many short sequences (the
loop's cost there is a dozen ops per sequence); with long sequences both are
bound by copying K/V. Run-to-run noise on a shared machine is +-30 % for the
long rows: read the ordering, not the digits.

Sequences with more than one query row this step (a prefill, a prefill
chunk, a speculative verify) gather their blocks, then run the contiguous
torch tier's `sequence_attention`: every row over the same fixed 64-key
chunks as a decode row (`chunked_attention.py`), so a row verified among
k + 1, or computed inside a prefill chunk, has the bits it has decoded
alone. With `batch_invariant=False` they run the reference's single product
instead (`attention_torch.prefill`: faster, and the row's bits depend on the
call). The plan of step 1 depends only on the step's metadata, so this tier
builds it once per step, at the first layer, and keeps it in
`AttentionMetadata.decode_plan` for the later layers.

With the compiled CPU kernels on (STAGEWISE_CPU_KERNELS=1, float32 K/V), all of the above is one
call per layer instead: `cpu/attention.py` runs every query row of the step (decode, prefill,
chunk, verify) through the same loop over its keys, read in place through the block table.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stagewise.cpu import attention as cpu_attention
from stagewise.stages import attention_torch
from stagewise.stages.attention_metadata import AttentionMetadata
from stagewise.stages.chunked_attention import decode_rows, padded_length

GROUP_KEYS = 2048  # most padded keys (sequences x longest) in one batched call (docstring)


@dataclass
class DecodeGroup:
    """A run of consecutive decoding sequences, one query row each, attended in one call."""

    rows: slice  # their query rows (consecutive)
    # [D, S] int64: the cache slot of each key; padding -> the sequence's first slot
    slots: torch.Tensor
    # [D] int: the keys of each sequence (its real keys; S = whole chunks of CHUNK_KEYS)
    lens: torch.Tensor


def group_runs(decoding: list[int], seq_lens: list[int]) -> list[list[int]]:
    """Consecutive runs of decoding sequences whose padded keys (count x longest) fit GROUP_KEYS."""
    groups: list[list[int]] = []
    longest = 0
    for b in decoding:
        grown = max(longest, seq_lens[b])
        if groups and groups[-1][-1] == b - 1 and grown * (len(groups[-1]) + 1) <= GROUP_KEYS:
            groups[-1].append(b)
            longest = grown
        else:
            groups.append([b])
            longest = seq_lens[b]
    return groups


def plan_decode(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_q: list[int],
    lens: list[int],
    block_size: int,
) -> list[DecodeGroup]:
    """Step 1 of the module docstring, for every sequence with exactly one query row this step."""
    decoding = [b for b in range(len(lens)) if cu_q[b + 1] - cu_q[b] == 1]
    plan = []
    for run in group_runs(decoding, lens):
        first, last = run[0], run[-1] + 1
        longest = max(lens[first:last])
        padded = padded_length(longest)  # S: whole chunks of keys
        num_blocks = -(-longest // block_size)
        blocks = block_table[first:last, :num_blocks].to(torch.long)  # [D, n_blocks] block ids
        offsets = torch.arange(block_size, device=blocks.device)  # [block_size]
        slots = (blocks.unsqueeze(-1) * block_size + offsets).flatten(1)[:, :longest]  # [D, L]
        slots = F.pad(slots, (0, padded - longest))  # [D, S]
        keys = torch.arange(padded, device=blocks.device)  # [S]
        key_counts = seq_lens[first:last].to(blocks.device, torch.long)  # [D]
        real = keys < key_counts.unsqueeze(1)  # [D, S]
        slots = torch.where(real, slots, slots[:, :1])  # padding reads the sequence's first key
        plan.append(DecodeGroup(slice(cu_q[first], cu_q[last]), slots, key_counts))
    return plan


def attend_group(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup, scale: float
) -> torch.Tensor:
    """Step 2: q [D, H, d], caches [num_blocks, block_size, Hkv, d] -> [D, H, d]."""
    num_seqs, padded = group.slots.shape  # D, S
    num_kv_heads, head_dim = k_cache.shape[2:]
    index = group.slots.reshape(-1)  # [D * S]
    k = k_cache.view(-1, num_kv_heads, head_dim).index_select(0, index)  # [D * S, Hkv, d]: a copy
    v = v_cache.view(-1, num_kv_heads, head_dim).index_select(0, index)
    shape = (num_seqs, padded, num_kv_heads, head_dim)
    return decode_rows(q, k.view(shape), v.view(shape), group.lens, scale)  # [D, H, d]


def one_sequence(
    q: torch.Tensor,
    k_cache,
    v_cache,
    block_ids: torch.Tensor,
    seq_len: int,
    scale: float,
    batch_invariant: bool = True,
) -> torch.Tensor:
    """A prefill (chunk): q [Lq, H, d] over its first seq_len cached keys -> [Lq, H, d] float32."""
    num_blocks = -(-seq_len // k_cache.shape[1])  # ceil: the blocks that hold its tokens
    index = block_ids[:num_blocks].to(device=k_cache.device, dtype=torch.long)  # [n_blocks]
    k = k_cache.index_select(0, index).flatten(0, 1)[:seq_len]  # [seq_len, Hkv, d], a copy
    v = v_cache.index_select(0, index).flatten(0, 1)[:seq_len]
    return attention_torch.sequence_attention(q, k, v, scale, batch_invariant)  # [Lq, H, d]


def plan_of(metadata: AttentionMetadata, block_size: int) -> list[DecodeGroup]:
    """Step 1 for one step's metadata (what the tier keeps in `metadata.decode_plan`)."""
    m = metadata
    return plan_decode(m.block_table, m.seq_lens, m.cu_seqlens_q_host, m.seq_lens_host, block_size)


def _paged(q, k_cache, v_cache, metadata: AttentionMetadata, scale: float, batch_invariant: bool):
    m = metadata
    if batch_invariant and cpu_attention.serves(q, k_cache):  # compiled: every row, no K/V copy
        table, cu_q, lens = m.block_table, m.cu_seqlens_q, m.seq_lens
        return cpu_attention.paged(q, k_cache, v_cache, table, cu_q, lens, scale).to(q.dtype)
    if m.decode_plan is None:  # the first layer of the step: every later layer reuses the plan
        m.decode_plan = plan_of(m, k_cache.shape[1])
    plan = m.decode_plan
    if len(plan) == 1 and plan[0].rows == slice(0, q.shape[0]):  # a pure decode step, one group
        return attend_group(q, k_cache, v_cache, plan[0], scale)  # [T, H, d], no copy into `out`
    out = torch.empty_like(q)
    for group in plan:
        out[group.rows] = attend_group(q[group.rows], k_cache, v_cache, group, scale)  # [D, H, d]
    cu_q = m.cu_seqlens_q_host
    for b, seq_len in enumerate(m.seq_lens_host):
        q_start, q_end = cu_q[b], cu_q[b + 1]
        if q_end - q_start > 1:  # a prefill, a prefill chunk or a verify: one sequence
            rows = q[q_start:q_end]  # [Lq, H, d]
            table_row = m.block_table[b]
            out[q_start:q_end] = one_sequence(
                rows, k_cache, v_cache, table_row, seq_len, scale, batch_invariant
            )
    return out


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """The decoding sequences batched (the plan's groups), the others one by one -> [T, H, d].

    Same arguments and result as `paged_attention.naive`, the reference.
    """
    return _paged(q, k_cache, v_cache, metadata, scale, batch_invariant=True)


def paged_attention_torch_variant(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """`batch_invariant=False`: prefills and verifies in the reference's single product."""
    return _paged(q, k_cache, v_cache, metadata, scale, batch_invariant=False)
