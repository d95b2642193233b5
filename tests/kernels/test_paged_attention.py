"""Triton paged attention (decode + chunked prefill through a block table) vs the naive reference.

Chain: a hand-checkable example -> mixed batches (decode and prefill chunks,
lengths crossing block boundaries, shuffled blocks, block sizes 16/32/64, GQA
1/3/4) in fp32, bf16 and fp16 -> split-K against the plain kernel, and its
heuristic -> fp16 rounds P before P @ V (the 16-bit branch runs) -> a decode step
loads each cached K/V element once -> a strided q view -> the registry stage ->
the launcher's errors.
"""

import pytest
import torch

from stagewise.config import PRESETS
from stagewise.kernels import INTERPRETER
from stagewise.kernels.attention_common import LOG2E
from stagewise.kernels.checks import KernelInputError
from stagewise.kernels.paged_attention import paged_attention
from stagewise.kernels.split_k import choose_num_splits
from stagewise.stages import STAGES
from stagewise.stages.attention_metadata import AttentionMetadata
from stagewise.stages.paged_attention import naive
from tests.helpers import assert_close
from tests.kernels.interpreter_loads import count_loaded_bytes

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Same reasoning as test_flash_attention.py: the reference runs in IEEE fp32 on the same 16-bit-rounded
# inputs, so fp32 (IEEE dots: the interpreter always, on a GPU conftest.py keeps TF32 off) differs only in
# the order of additions (~1e-6); bf16 only by the output rounding (< 2^-7 relative: the interpreter
# truncates) plus, on a GPU, P rounded to bf16 before P @ V (<= 2^-8 per weight), |out| <~ 3, so 1e-2
# absolute + 1e-2 relative; fp16 (16-bit dots in the interpreter too) by P rounded to fp16 (<= 2^-11 per
# weight, <= 2^-11 * max|v| ~ 2e-3 at the very worst) and the output rounding (<= 2^-11 relative).
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1e-2), torch.float16: (2e-3, 2**-10)}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]


def paged_batch(seq_lens, q_lens, block_size, num_heads, num_kv_heads, head_dim, dtype, seed=0):
    """A cache whose blocks are shuffled; every slot no sequence owns holds NaN (a read would show)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2  # spare blocks, never referenced
    perm = torch.randperm(num_blocks, generator=gen)
    block_table = torch.full((len(seq_lens), max(blocks_per_seq, default=0) + 1), -1, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    start = 0
    for b, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        block_table[b, :nb] = perm[start : start + nb]
        start += nb
        for pos in range(n):  # fill exactly the owned slots
            block, offset = int(block_table[b, pos // block_size]), pos % block_size
            k_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=gen)
            v_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=gen)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen)
    return {
        "q": q.to(DEVICE, dtype),
        "k_cache": k_cache.to(DEVICE, dtype),
        "v_cache": v_cache.to(DEVICE, dtype),
        "block_table": block_table.to(DEVICE),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        "cu_seqlens_q": torch.tensor([0, *q_lens]).cumsum(0).to(DEVICE, torch.int32),
        "scale": head_dim**-0.5,
    }


def reference(inputs: dict) -> torch.Tensor:
    """The naive stage in fp32 on the same (possibly bf16-rounded) inputs, lengths as metadata."""
    cu_q = inputs["cu_seqlens_q"].tolist()
    q_lens = [b - a for a, b in zip(cu_q, cu_q[1:])]
    meta = AttentionMetadata.build(q_lens, inputs["seq_lens"].tolist(), DEVICE, block_table=inputs["block_table"])
    q, k_cache, v_cache = (inputs[n].float() for n in ("q", "k_cache", "v_cache"))
    return naive(q, k_cache, v_cache, meta, inputs["scale"])


def test_worked_example_uniform_attention_across_two_blocks():
    """q = 0: the decode query of a 3-token sequence averages the values of its 3 slots.

    block_size 16, sequence of 3 tokens stored in physical block 1 (block 0 is someone else's).
    """
    with torch.device(DEVICE):
        k_cache = torch.randn(2, 16, 1, 16)
        v_cache = torch.zeros(2, 16, 1, 16)
        v_cache[1, :3, 0] = torch.tensor([1.0, 2.0, 6.0])[:, None]  # slots 16, 17, 18
        out = paged_attention(
            q=torch.zeros(1, 2, 16),  # 2 query heads share the one KV head
            k_cache=k_cache,
            v_cache=v_cache,
            block_table=torch.tensor([[1]], dtype=torch.int32),
            seq_lens=torch.tensor([3], dtype=torch.int32),
            cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
            scale=0.25,
        )
        expected = torch.full((1, 2, 16), 3.0)
    assert_close(out, expected, 1e-6, 1e-6, "(1 + 2 + 6) / 3")


CASES = {  # name: (seq_lens, q_lens, block_size, H, Hkv, d)
    "decode across block edges, GQA 3": ([15, 16, 17, 33], [1, 1, 1, 1], 16, 9, 3, 64),
    "decode and chunks mixed, GQA 4": ([33, 17, 7, 16], [1, 9, 7, 0], 32, 8, 2, 128),
    "chunk on a long prefix, GQA 1": ([70], [17], 16, 2, 2, 64),
    "first query one key before a tile edge; last key opens a tile": ([40, 33], [10, 1], 16, 1, 1, 32),
    "tiny model, one block holds the tile": ([1, 20], [1, 20], 64, 6, 2, 16),
    "more queries than keys": ([3, 0], [5, 2], 16, 4, 1, 32),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_naive(case, dtype):
    seq_lens, q_lens, block_size, num_heads, num_kv_heads, head_dim = CASES[case]
    inputs = paged_batch(seq_lens, q_lens, block_size, num_heads, num_kv_heads, head_dim, dtype)
    out = paged_attention(**inputs, num_splits=1)
    assert out.dtype == dtype and out.shape == inputs["q"].shape
    assert torch.isfinite(out.float()).all(), "read a slot that no sequence owns"
    assert_close(out, reference(inputs), *TOL[dtype], case)


def test_64_bit_offset_path_matches_naive(monkeypatch):
    """The 64-bit path (a cache past 2^31 elements: too big for a test) on a chunk over a prefix, forced on."""
    import stagewise.kernels.paged_attention as pa

    monkeypatch.setattr(pa, "needs_int64_offsets", lambda *tensors: True)
    inputs = paged_batch([40, 17], [9, 17], 16, 4, 2, 32, torch.float32, seed=5)
    out = pa.paged_attention(**inputs, num_splits=1)
    assert_close(out, reference(inputs), *TOL[torch.float32], "int64 offsets")


def test_no_queries():
    inputs = paged_batch([5, 17], [0, 0], 16, 4, 2, 64, torch.float32)
    assert paged_attention(**inputs).shape == (0, 4, 64)


@pytest.mark.parametrize("num_splits", [2, 3])
def test_split_k_matches_naive(num_splits):
    """Split-K on decodes (one split may get no key: seq_len 5 < 3 tiles) and on a chunk."""
    inputs = paged_batch([130, 33, 5, 40], [1, 1, 1, 4], 16, 4, 2, 64, torch.float32, seed=3)
    out = paged_attention(**inputs, num_splits=num_splits)
    assert_close(out, reference(inputs), *TOL[torch.float32], f"{num_splits} splits")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_split_k_16_bit(dtype):
    """fp16 runs the 16-bit dots into the fp32 partials; the reduce casts the merged rows to fp16 once."""
    inputs = paged_batch([97, 2], [1, 1], 32, 3, 1, 64, dtype, seed=4)
    assert_close(paged_attention(**inputs, num_splits=4), reference(inputs), *TOL[dtype], f"{dtype} splits")


def test_fp16_runs_16_bit_dots_p_is_rounded_before_p_v():
    """Pins the 16-bit branch, as in test_flash_attention.py: base-2 scores 0 and -1 + 2^-11 give
    p = 1 and 0.50017, which fp16 rounds to 0.5; with v = -1 and 2 the output is exactly 0
    (unrounded P: 2.26e-4). Both with and without split-K (the split that holds the key pair decides)."""
    d = 16
    k_cache, v_cache = torch.zeros(1, 16, 1, d), torch.zeros(1, 16, 1, d)
    k_cache[0, 1, 0, 0] = -1.0 + 2.0**-11
    v_cache[0, 0], v_cache[0, 1] = -1.0, 2.0
    q = torch.zeros(1, 1, d)
    q[0, 0, 0] = 1.0
    meta = {
        "block_table": torch.tensor([[0]], dtype=torch.int32, device=DEVICE),
        "seq_lens": torch.tensor([2], dtype=torch.int32, device=DEVICE),
        "cu_seqlens_q": torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
        "scale": 1.0 / LOG2E,
    }
    half = {n: t.to(DEVICE, torch.float16) for n, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache))}
    for num_splits in (1, 2):
        out = paged_attention(**half, **meta, num_splits=num_splits)
        assert torch.equal(out.float().cpu(), torch.zeros(1, 1, d)), f"{num_splits} splits: P must be rounded to fp16"
    p1 = 2.0 ** (-1.0 + 2.0**-11)
    out32 = paged_attention(q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), **meta)
    assert_close(out32, torch.full((1, 1, d), (-1.0 + 2.0 * p1) / (1.0 + p1)), 1e-7, 1e-4, "fp32 keeps P unrounded")


@pytest.mark.skipif(not INTERPRETER, reason="counts the loads of Triton's CPU interpreter")
def test_decode_reads_each_cached_kv_element_once():
    """GQA packing: a decode step loads each sequence's cached K/V once per KV head (G = 3 here)."""
    seq_lens = [15, 33, 1]
    inputs = paged_batch(seq_lens, [1, 1, 1], 16, 6, 2, 16, torch.float32, seed=6)
    with count_loaded_bytes(inputs["k_cache"], inputs["v_cache"]) as loaded:
        out = paged_attention(**inputs, num_splits=1)
    used_bytes = sum(seq_lens) * 2 * 16 * 4  # keys x Hkv x d x fp32
    assert loaded == [used_bytes, used_bytes], f"K, V bytes loaded {loaded}, each used element once is {used_bytes}"
    assert_close(out, reference(inputs), *TOL[torch.float32], "decode")


def test_split_k_heuristic():
    assert choose_num_splits(num_programs=16, max_seq_len=4096, sms=None) == 1  # interpreter: never
    assert choose_num_splits(num_programs=16, max_seq_len=4096, sms=132) == 16  # few programs, long keys
    assert choose_num_splits(num_programs=64, max_seq_len=4096, sms=132) == 5  # enough for ~2 per SM
    assert choose_num_splits(num_programs=256, max_seq_len=4096, sms=132) == 1  # grid already fills the GPU
    assert choose_num_splits(num_programs=8, max_seq_len=300, sms=132) == 1  # too short to share


def test_strided_q_view():
    """q as split_qkv makes it: a view of the fused qkv output, token stride (H + 2 Hkv) d."""
    num_heads, num_kv_heads, head_dim = 6, 2, 16
    inputs = paged_batch([20, 9], [3, 1], 16, num_heads, num_kv_heads, head_dim, torch.float32, seed=5)
    qkv = torch.zeros(4, (num_heads + 2 * num_kv_heads) * head_dim, device=DEVICE)
    q = qkv[:, : num_heads * head_dim].view(4, num_heads, head_dim)
    q.copy_(inputs["q"])
    assert not q.is_contiguous()
    inputs["q"] = q
    assert_close(paged_attention(**inputs), reference(inputs), *TOL[torch.float32], "strided q")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_tokens", [1, 7, 33])
def test_registry_stage_triton_matches_naive(num_tokens, block_size, dtype):
    stage = STAGES["paged_attention"]
    assert stage.triton_kind.startswith("triton")
    inputs = stage.example_inputs(PRESETS["tiny"], num_tokens, DEVICE, dtype, block_size=block_size)
    out = stage.triton(**inputs)
    assert_close(out, stage.naive(**inputs), *TOL[dtype], f"paged_attention stage, T={num_tokens}")


def _bad(**changes):
    """Valid inputs (a decode and a chunk, GQA 2, block_size 16) with some entries replaced."""
    inputs = paged_batch([17, 9], [1, 4], 16, 4, 2, 64, torch.float32)
    inputs.update({n: f(inputs) if callable(f) else f for n, f in changes.items()})
    return inputs


def _wider_cache(inputs):
    """The same values inside a cache with twice the KV heads: a non-contiguous view."""
    c = inputs["k_cache"]
    return torch.cat([c, c], dim=2)[:, :, : c.shape[2]]


ERRORS = {  # name: (inputs, words the message must contain)
    "head_dim 48": (paged_batch([3], [1], 16, 2, 1, 48, torch.float32), "head_dim 48"),
    "head_dim 96": (paged_batch([3], [1], 16, 2, 1, 96, torch.float32), "head_dim 96"),
    "kv heads do not divide H": (paged_batch([3], [1], 16, 6, 4, 64, torch.float32), "H % Hkv"),
    "bf16 q, fp32 cache": (_bad(q=lambda i: i["q"].to(torch.bfloat16)), "must share one dtype"),
    "non-contiguous cache": (_bad(k_cache=_wider_cache), "k_cache must be contiguous"),
    "int64 block table": (_bad(block_table=lambda i: i["block_table"].long()), "block_table"),
    "cu_seqlens_q wrong length": (_bad(cu_seqlens_q=lambda i: i["cu_seqlens_q"][:-1]), "cu_seqlens_q"),
    "seq_lens wrong length": (_bad(seq_lens=lambda i: i["seq_lens"][:1]), "seq_lens"),
    "sequence longer than its block-table row": (_bad(seq_lens=lambda i: i["seq_lens"] * 4), "block-table row"),
    "cu_seqlens_q misses rows": (_bad(cu_seqlens_q=lambda i: i["cu_seqlens_q"] // 2), "cu_seqlens_q"),
    "3-D cache": (_bad(k_cache=lambda i: i["k_cache"][0], v_cache=lambda i: i["v_cache"][0]), "k_cache must be 4-D"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_launcher_rejects_bad_inputs(name):
    inputs, words = ERRORS[name]
    with pytest.raises(KernelInputError, match=words):
        paged_attention(**inputs)
