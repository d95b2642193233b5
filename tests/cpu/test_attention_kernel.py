"""The compiled CPU attention (stagewise/cpu/attention.py): the formula on irregular paged shapes,
a row's bits the same in every call (decode alone, beside other sequences at any slot, as the last
row of a prefill of any length, 1 and 2 threads, the AVX2 build and the plain-C one), bad layouts
refused in one line, and the torch tier routing every row to it when the kernels are on."""

import math

import pytest
import torch

from stagewise.cpu import attention as cpu_attention
from stagewise.cpu import build
from stagewise.errors import StagewiseError
from stagewise.stages import attention_torch, paged_attention_torch
from stagewise.stages.attention_metadata import AttentionMetadata
from tests.stages.test_batch_invariance_ops import assert_invariant, distinct_results

pytestmark = [
    pytest.mark.skipif(build.compiler() is None, reason="no C++ compiler: the kernel is not built"),
    pytest.mark.usefixtures("int8_kernels"),  # the compiled CPU kernels are opt-in
]


def formula(q, k, v, scale):
    """q [Lq, H, d], k/v [Lk, Hkv, d] -> [Lq, H, d] float64: softmax(q k^T scale) v, causal
    bottom-right, a row that sees no key -> zeros (`paged_attention.naive`'s formula)."""
    len_q, heads, _ = q.shape
    len_k, kv_heads = k.shape[:2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i in range(len_q):
        limit = len_k - (len_q - 1 - i)
        for h in range(heads):
            if limit <= 0:
                continue
            g = h // (heads // kv_heads)
            p = torch.softmax(k[:limit, g].double() @ q[i, h].double() * scale, dim=0)
            out[i, h] = p @ v[:limit, g].double()
    return out


def paged_problem(q_lens, key_lens, heads, kv_heads, dim, block_size, seed=0):
    """Random q and a paged cache: each sequence's keys in shuffled blocks of a shared pool."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in key_lens]
    num_blocks = sum(per_seq) + 3  # and a few blocks nobody uses
    order = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    table = torch.full((len(key_lens), max(per_seq) + 1), -1, dtype=torch.int32)  # -1: unused
    used = 0
    for b, n in enumerate(per_seq):
        table[b, :n] = order[used : used + n]
        used += n
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    q = torch.randn(sum(q_lens), heads, dim, generator=gen)
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k_cache, v_cache, table, cu_q, torch.tensor(key_lens, dtype=torch.int32)


def keys_of(cache, table_row, n):
    """Sequence's first n keys [n, Hkv, d], gathered from its blocks."""
    blocks = cache[table_row[: -(-n // cache.shape[1])].long()]  # [n_blocks, block_size, Hkv, d]
    return blocks.flatten(0, 1)[:n]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block_size"), [(9, 3, 64, 16), (8, 2, 16, 5), (4, 4, 24, 7), (6, 1, 8, 3)]
)
def test_it_computes_the_formula_on_irregular_paged_shapes(heads, kv_heads, dim, block_size):
    q_lens, key_lens = [1, 5, 1, 13, 3], [1, 70, 33, 13, 2]  # decode, chunk, prefill, Lq > Lk
    q, kc, vc, table, cu_q, lens = paged_problem(q_lens, key_lens, heads, kv_heads, dim, block_size)
    scale = 1 / math.sqrt(dim)
    out = cpu_attention.paged(q, kc, vc, table, cu_q, lens, scale)
    for b in range(len(q_lens)):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        want = formula(q[rows], keys_of(kc, table[b], key_lens[b]), keys_of(vc, table[b], key_lens[b]), scale)
        assert (out[rows].double() - want).abs().max() < 1e-5, f"sequence {b}"
    assert torch.equal(out[int(cu_q[4]) + 0], torch.zeros(heads, dim))  # row 0 of 3 over 2 keys


SHAPE = dict(heads=9, kv_heads=3, dim=64, block_size=16)
PROBE_KEYS = 150


def probe_decode_row(m: int, slot: int, variant: str = "native") -> torch.Tensor:
    """The probe sequence's decode row in a step of m decoding sequences, the probe at `slot`."""
    key_lens = [37 + 29 * (i % 7) for i in range(m)]
    key_lens[slot] = PROBE_KEYS
    q, kc, vc, table, cu_q, lens = paged_problem([1] * m, key_lens, **SHAPE, seed=m)
    probe_q, probe_k, probe_v = probe_sequence()
    q[slot] = probe_q[-1]
    blocks = table[slot, : -(-PROBE_KEYS // 16)].long()
    kc[blocks] = probe_k.view(-1, 16, 3, 64)
    vc[blocks] = probe_v.view(-1, 16, 3, 64)
    return cpu_attention.paged(q, kc, vc, table, cu_q, lens, 0.125, variant)[slot]


def probe_sequence():
    gen = torch.Generator().manual_seed(99)
    keys = -(-PROBE_KEYS // 16) * 16  # whole blocks, the last partly unused
    q = torch.randn(PROBE_KEYS, 9, 64, generator=gen)
    return q, torch.randn(keys, 3, 64, generator=gen), torch.randn(keys, 3, 64, generator=gen)


def probe_prefill_row(m: int) -> torch.Tensor:
    """The probe's last position as the last row of a prefill of its last m positions."""
    q, k, v = probe_sequence()
    return cpu_attention.sequence(q[PROBE_KEYS - m :], k[:PROBE_KEYS], v[:PROBE_KEYS], 0.125)[-1]


def test_a_rows_bits_do_not_depend_on_its_batch_slot_threads_or_prefill_length():
    groups = distinct_results(lambda m, slot: probe_decode_row(m, slot), ms=(1, 2, 3, 5, 8, 33))
    assert_invariant(groups, "cpu attention, decode rows beside others")
    alone = probe_decode_row(1, 0)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m in (1, 2, 4, 7, 64, PROBE_KEYS):
                assert torch.equal(probe_prefill_row(m), alone), f"prefill of {m} rows, {threads} threads"
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("variant", ["avx2", "plain"])
def test_every_build_gives_the_same_bits(variant):
    if build.library(variant) is None:  # plain C builds wherever the native one does
        assert variant == "avx2", f"the {variant} build failed"
        pytest.skip("this machine's compiler cannot build for AVX2")
    for m, slot in ((1, 0), (5, 3)):
        assert torch.equal(probe_decode_row(m, slot, variant), probe_decode_row(m, slot)), (variant, m)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("block", "block ids that do not fit"),
        ("lens", "lengths or block ids"),
        ("tokens", "lengths or block ids"),
        ("dims", "disagree"),
        ("table", "for 2 sequences"),
    ],
)
def test_bad_layouts_are_one_line(change, message):
    q, kc, vc, table, cu_q, lens = paged_problem([1, 2], [5, 9], 4, 2, 16, 4)
    if change == "block":
        table[1, 2] = kc.shape[0]  # a block the cache does not have
    elif change == "lens":
        lens[0] = table.shape[1] * 4 + 1  # more keys than its table row holds
    elif change == "tokens":
        cu_q[-1] = 4
    elif change == "dims":
        q = q[..., :8].contiguous()
    else:
        table = table[:1]
    with pytest.raises(StagewiseError, match=message) as err:
        cpu_attention.paged(q, kc, vc, table, cu_q, lens, 0.25)
    assert "\n" not in str(err.value)


def test_the_torch_tier_sends_every_row_to_it_only_when_the_kernels_are_on(monkeypatch):
    q, kc, vc, table, cu_q, lens = paged_problem([1, 6], [40, 6], 6, 2, 16, 8)
    meta = AttentionMetadata.build([1, 6], [40, 6], torch.device("cpu"), block_table=table)
    compiled = cpu_attention.paged(q, kc, vc, table, cu_q, lens, 0.25)
    assert torch.equal(paged_attention_torch.paged_attention_torch(q, kc, vc, meta, 0.25), compiled)
    k6, v6 = keys_of(kc, table[1], 6), keys_of(vc, table[1], 6)
    assert torch.equal(attention_torch.sequence_attention(q[1:], k6, v6, 0.25), compiled[1:])
    monkeypatch.setenv(build.ENV_SWITCH, "0")
    meta.decode_plan = None
    chunked = paged_attention_torch.paged_attention_torch(q, kc, vc, meta, 0.25)
    assert not torch.equal(chunked, compiled) and (chunked - compiled).abs().max() < 1e-5
