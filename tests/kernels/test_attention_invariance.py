"""Triton attention is batch-invariant: a query row's bits do not depend on how it is batched.

`batch_invariant=True` (what the stages run by default): flash and paged attention share one tile
for every query length, and every row's keys are reduced in fixed chunks of KEY_CHUNK keys, each
from an empty online-softmax state, merged in order (kernels/attention_common.py). A row of one
probe sequence (150 keys, G = 3) must come out as the same bits decoded alone, as the last row of a
prefill of its prefix, inside a prefill chunk of 13 rows on its cached prefix, beside other
sequences at any slot, with the decode's keys split over one program per chunk, and from the paged
kernel and the contiguous one alike. KEY_CHUNK is 64 here (32-key tiles), so 150 keys make three
chunks, the last one partial. Under the interpreter with a fixed-order `tl.dot`
(tests/kernels/fixed_order_dot.py). The negative control: `batch_invariant=False` with the keys
split by count, a share of each row's keys per program, changes the row.
"""

import pytest
import torch

import stagewise.kernels.attention_common as attention_common
from stagewise.kernels.checks import KernelInputError
from stagewise.kernels.flash_attention import flash_attention
from stagewise.kernels.paged_attention import paged_attention
from stagewise.stages import attention
from stagewise.stages.attention_metadata import AttentionMetadata
from tests.kernels.fixed_order_dot import fixed_order_dot  # noqa: F401  (a fixture)

H, HKV, D, BLOCK = 6, 2, 16, 16  # G = 3, as the tiny model
PROBE_LEN = 150
POSITIONS = (0, 64, 149)  # the first key, a chunk's first (KEY_CHUNK 64), the last key


pytestmark = pytest.mark.usefixtures("fixed_order_dot")


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(attention_common, "KEY_CHUNK", 64)


def sequence(length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [L, H, d], k and v [L, Hkv, d]: one sequence's rows at every position."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(length, heads, D, generator=gen) for heads in (H, HKV, HKV))


PROBE = sequence(PROBE_LEN, seed=0)
i32 = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731


def run(parts, paged: bool, batch_invariant: bool = True, num_splits=None) -> list[torch.Tensor]:
    """parts: (q, k, v, keys, q_len) per sequence — its first `keys` keys in the cache, its query
    rows the last q_len of those positions. -> each sequence's output rows [q_len, H, d]."""
    q = torch.cat([p[0][p[3] - p[4] : p[3]] for p in parts])  # [T, H, d]
    q_lens, keys = [p[4] for p in parts], [p[3] for p in parts]
    cu_q = i32([0, *q_lens]).cumsum(0, dtype=torch.int32)
    if paged:  # every sequence's blocks, shuffled through the block table
        blocks = [-(-n // BLOCK) for n in keys]
        order = torch.randperm(sum(blocks), generator=torch.Generator().manual_seed(len(parts)))
        cache = torch.zeros(2, sum(blocks), BLOCK, HKV, D)
        table = torch.zeros(len(parts), max(blocks), dtype=torch.int32)
        start = 0
        for b, (part, n) in enumerate(zip(parts, keys)):
            table[b, : blocks[b]] = order[start : start + blocks[b]]
            start += blocks[b]
            for pos in range(n):
                cache[:, table[b, pos // BLOCK], pos % BLOCK] = torch.stack([part[1][pos], part[2][pos]])
        lengths = dict(max_q_len=max(q_lens), max_seq_len=max(keys))
        out = paged_attention(q, cache[0], cache[1], table, i32(keys), cu_q, D**-0.5, num_splits=num_splits,
                              batch_invariant=batch_invariant, **lengths)  # fmt: skip
    else:
        k = torch.cat([p[1][: p[3]] for p in parts])
        v = torch.cat([p[2][: p[3]] for p in parts])
        cu_k = i32([0, *keys]).cumsum(0, dtype=torch.int32)
        out = flash_attention(q, k, v, cu_q, cu_k, D**-0.5, max_q_len=max(q_lens), batch_invariant=batch_invariant)
    return list(out.split(q_lens))


def probe(keys: int, q_len: int):
    return (*PROBE, keys, q_len)


def test_decoded_prefilled_chunked_paged_or_contiguous_a_row_is_the_same_bits():
    (ref,) = run([probe(PROBE_LEN, PROBE_LEN)], paged=True)  # the whole prompt, one prefill
    meta = AttentionMetadata.build([PROBE_LEN], [PROBE_LEN], torch.device("cpu"), k_starts=[0, PROBE_LEN])
    naive = attention.naive(PROBE[0], PROBE[1], PROBE[2], meta, D**-0.5)
    torch.testing.assert_close(ref, naive, rtol=1e-5, atol=1e-5)  # and it is attention
    assert torch.equal(run([probe(PROBE_LEN, PROBE_LEN)], paged=False)[0], ref), "flash vs paged"
    for t in POSITIONS:
        for paged in (True, False):
            (row,) = run([probe(t + 1, 1)], paged)  # a decode step at position t
            assert torch.equal(row[0], ref[t]), f"decode at {t} ({'paged' if paged else 'flash'})"
    for t in (70, 149):  # a 13-row chunk ending at t, on the cached prefix
        (rows,) = run([probe(t + 1, 13)], paged=True)
        assert torch.equal(rows, ref[t - 12 : t + 1]), f"chunk ending at {t}"


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "flash"])
def test_a_sequence_at_any_slot_among_others_gives_the_same_bits(paged):
    """The probe's decode row at 149 and a 9-row chunk on a 100-key prefix, among 1 or 3 others
    (decodes and prefill chunks of other lengths), at the first, a middle and the last slot."""
    alone_decode = run([probe(PROBE_LEN, 1)], paged)[0]
    alone_chunk = run([probe(109, 9)], paged)[0]
    gen = torch.Generator().manual_seed(7)
    for others in (1, 3):
        parts = []
        for i in range(others):
            keys = int(torch.randint(1, 90, (1,), generator=gen))
            q_len = 1 if i % 2 else int(torch.randint(1, min(keys, 24) + 1, (1,), generator=gen))
            parts.append((*sequence(keys, seed=10 + i), keys, q_len))
        for slot in sorted({0, others // 2, others}):
            batch = parts[:slot] + [probe(PROBE_LEN, 1), probe(109, 9)] + parts[slot:]
            outs = run(batch, paged)
            assert torch.equal(outs[slot], alone_decode), f"decode row among {others} at slot {slot}"
            assert torch.equal(outs[slot + 1], alone_chunk), f"chunk among {others} at slot {slot}"


def test_a_decode_split_one_chunk_per_program_changes_no_bit():
    """Split-K gives each program one fixed chunk of keys; the reduce merges them in order, as one
    program walking every chunk does. Extra splits (past the last key) are empty states."""
    batch = [probe(PROBE_LEN, 1), (*sequence(40, seed=3), 40, 1)]
    unsplit = run(batch, paged=True, num_splits=1)
    for splits in (3, 5):  # cdiv(150, 64) = 3 chunks
        split = run(batch, paged=True, num_splits=splits)
        assert all(torch.equal(a, b) for a, b in zip(split, unsplit)), f"{splits} splits"
    with pytest.raises(KernelInputError, match="num_splits=2 cannot cover 150 keys"):
        run(batch, paged=True, num_splits=2)
    with pytest.raises(KernelInputError, match="runs unsplit"):
        flash_attention(*(t[:1] for t in PROBE), i32([0, 1]), i32([0, 1]), 0.25, num_splits=2, batch_invariant=True)


def test_without_batch_invariance_a_split_by_count_changes_the_row():
    """The negative control: keys shared out among 2 or 3 programs by count (what occupancy picks on
    a GPU) merge into other bits than one program's single pass."""
    batch = [probe(PROBE_LEN, 1)]
    unsplit = run(batch, paged=True, batch_invariant=False, num_splits=1)[0]
    changed = [s for s in (2, 3) if not torch.equal(run(batch, True, False, num_splits=s)[0], unsplit)]
    assert changed, "a split by count gave the unsplit bits: the control proves nothing"
