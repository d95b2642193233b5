"""The torch tier of paged attention (`stages/paged_attention_torch.py`: decoding sequences batched, one
padded gather + one fused call per group) against the textbook (`paged_attention.naive`, one sequence at a
time): many decoding sequences of irregular lengths, mixed with prefill chunks on cached prefixes and fresh
prefills, blocks shuffled, stale values (even NaN) in the padding slots that the mask must hide."""

import pytest
import torch

from stagewise.stages import chunked_attention
from stagewise.stages import paged_attention as pa
from stagewise.stages import paged_attention_torch as batched
from stagewise.stages.attention_metadata import AttentionMetadata
from tests.helpers import assert_close


def paged_inputs(q_lens: list[int], prefixes: list[int], heads=6, kv_heads=2, head_dim=16, block_size=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + n for p, n in zip(prefixes, q_lens)]
    blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 5
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    start = 0
    for b, n in enumerate(blocks):
        table[b, :n] = perm[start : start + n]
        start += n
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    for b, n in enumerate(seq_lens):  # slots past each sequence's end hold garbage, as a reused block would
        last = int(table[b, blocks[b] - 1])
        k_cache[last, n - (blocks[b] - 1) * block_size :] = float("nan")
        v_cache[last, n - (blocks[b] - 1) * block_size :] = float("nan")
    return {
        "q": torch.randn(sum(q_lens), heads, head_dim, generator=gen),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "metadata": AttentionMetadata.build(q_lens, seq_lens, "cpu", block_table=table),
        "scale": head_dim**-0.5,
    }


@pytest.mark.parametrize(
    ("q_lens", "prefixes"),
    [
        ([1], [0]),  # the very first decode step of a one-token prompt
        ([1] * 7, [0, 3, 4, 5, 17, 30, 2]),  # seven decodes, lengths 1..31
        ([1, 1, 5, 1, 3], [9, 2, 0, 40, 6]),  # decodes around prefill chunks: three decode groups
        ([6, 1, 1], [0, 12, 1]),  # a fresh prefill first, then two decodes
        ([3, 5], [7, 0]),  # no decode at all: a chunk on a cached prefix and a fresh prefill
    ],
)
def test_the_torch_tier_equals_the_textbook(q_lens, prefixes):
    inputs = paged_inputs(q_lens, prefixes)
    out = batched.paged_attention_torch(**inputs)
    assert not out.isnan().any(), "a padding slot leaked into an output"
    assert_close(out, pa.naive(**inputs), 1e-6, 1e-6, "torch tier (batched decode) vs naive")
    assert pa.STAGE.tier("torch") is batched.paged_attention_torch  # what `backend="torch"` runs


def test_decode_groups_respect_the_padded_key_budget(monkeypatch):
    monkeypatch.setattr(batched, "GROUP_KEYS", 40)
    # sequences 0-3 decode (lengths 10, 10, 30, 5), 4 prefills, 5-6 decode
    assert batched.group_runs([0, 1, 2, 3, 5, 6], [10, 10, 30, 5, 99, 8, 8]) == [[0, 1], [2], [3], [5, 6]]
    inputs = paged_inputs([1, 1, 1, 1, 4, 1, 1], [9, 9, 29, 4, 95, 7, 7])
    torch_tier = batched.paged_attention_torch(**inputs)
    assert_close(torch_tier, pa.naive(**inputs), 1e-6, 1e-6, "small groups vs naive")


def test_the_plan_points_padding_at_a_real_key_and_masks_it():
    inputs = paged_inputs([1, 1, 3], [4, 20, 0], block_size=4)
    (group,) = batched.plan_of(inputs["metadata"], 4)
    chunk = chunked_attention.CHUNK_KEYS
    assert group.rows == slice(0, 2) and group.slots.shape == (2, chunk)  # 21 keys -> one whole chunk
    table = inputs["metadata"].block_table
    for b, n in enumerate([5, 21]):
        expected = [int(table[b, p // 4]) * 4 + p % 4 for p in range(n)]
        assert group.slots[b, :n].tolist() == expected  # slot = block_id * block_size + offset
        assert (group.slots[b, n:] == expected[0]).all()  # padding reads the sequence's own first key
        assert group.lens[b] == n  # the keys past it are masked


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sequence_gets_the_same_bits_alone_and_batched(dtype):
    """Fixed-size key chunks: padding to a longer neighbour (here up to 3 chunks) changes no bit."""
    lens = [1, 1, 1, 1, 1]
    prefixes = [20, 150, 3, 64, 130]  # 21, 151, 4, 65, 131 keys: 1 to 3 chunks of 64
    inputs = paged_inputs(lens, prefixes, block_size=16)
    inputs = {k: v.to(dtype) if k in ("q", "k_cache", "v_cache") else v for k, v in inputs.items()}
    together = batched.paged_attention_torch(**inputs)
    table, meta = inputs["metadata"].block_table, inputs["metadata"]
    for b, prefix in enumerate(prefixes):
        one = dict(inputs, q=inputs["q"][b : b + 1])
        one["metadata"] = AttentionMetadata.build([1], [prefix + 1], "cpu", block_table=table[b : b + 1])
        alone = batched.paged_attention_torch(**one)
        assert torch.equal(alone[0], together[b]), f"sequence {b} ({prefix + 1} keys) alone != batched"
    assert_close(together.float(), pa.naive(**inputs).float(), 2e-2, 2e-2, "chunked vs naive")
    assert meta.num_seqs == 5


def test_the_engine_builds_the_plan_once_per_step_for_the_torch_tier_only(tiny, monkeypatch):
    from stagewise import LLM, SamplingParams

    calls = []
    real = batched.plan_of
    monkeypatch.setattr(batched, "plan_of", lambda *a: calls.append(1) or real(*a))
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    llm = LLM(tiny, backend="torch", mode="paged")
    assert llm.ops.tier(pa) == "torch"
    llm.generate(["a b", "c d e"], params)
    assert len(calls) == llm.last_stats.steps  # not once per layer
    calls.clear()
    LLM(tiny, backend="naive", mode="paged").generate(["a b"], params)
    assert calls == []  # the textbook needs no plan


def test_kv_and_paged_decode_rows_are_the_same_bits():
    """mode="kv" (contiguous keys, `attention_torch`) and mode="paged" decode one row identically."""
    from stagewise.stages import attention_torch

    inputs = paged_inputs([1, 1], [70, 8], block_size=16)
    paged_out = batched.paged_attention_torch(**inputs)
    table = inputs["metadata"].block_table
    for b, n in enumerate([71, 9]):
        keys = [int(table[b, p // 16]) * 16 + p % 16 for p in range(n)]
        k = inputs["k_cache"].flatten(0, 1)[keys]  # [n, Hkv, d]: this sequence's keys, in order
        v = inputs["v_cache"].flatten(0, 1)[keys]
        row = attention_torch.sequence_attention(inputs["q"][b : b + 1], k, v, inputs["scale"])
        assert torch.equal(row[0], paged_out[b]), f"sequence {b}: kv tier != paged tier"


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_a_prefill_in_chunks_and_a_decode_give_every_row_the_same_bits(chunk):
    """The paged torch tier: a prompt prefilled whole, in chunks on its cached prefix, and each
    position decoded alone beside a longer neighbour: every row the same bits (G = 3)."""
    length = 23
    whole = paged_inputs([length], [0], block_size=4, seed=3)
    full = batched.paged_attention_torch(**whole)
    table = whole["metadata"].block_table
    for start in range(0, length, chunk):
        end = min(start + chunk, length)
        part = dict(whole, q=whole["q"][start:end])
        part["metadata"] = AttentionMetadata.build([end - start], [end], "cpu", block_table=table)
        out = batched.paged_attention_torch(**part)
        assert torch.equal(out, full[start:end]), f"rows {start}..{end} in a chunk != whole prefill"
    for p in range(length):  # each position as a decode row, beside a neighbour of 23 keys
        both = dict(whole, q=torch.stack([whole["q"][p], whole["q"][0]]))
        both["metadata"] = AttentionMetadata.build(
            [1, 1], [p + 1, length], "cpu", block_table=torch.cat([table, table])
        )
        out = batched.paged_attention_torch(**both)
        assert torch.equal(out[0], full[p]), f"position {p} decoded != its prefill row"


def test_the_variant_prefill_is_the_references_product_and_differs_from_the_chunked_rows():
    """`batch_invariant=False` (Stage.torch_variant) runs the reference's one product per prefill."""
    inputs = paged_inputs([40], [30], block_size=16, seed=4)
    variant = batched.paged_attention_torch_variant(**inputs)
    assert torch.equal(variant, pa.naive(**inputs))  # the reference's bits
    chunked = batched.paged_attention_torch(**inputs)
    assert_close(chunked, variant, 1e-6, 1e-6, "chunked vs one product")
    assert not torch.equal(chunked, variant)  # another order of the same sums
    assert pa.STAGE.tier("torch", batch_invariant=False) is batched.paged_attention_torch_variant
