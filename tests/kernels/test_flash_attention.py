"""Triton FlashAttention (varlen, causal, GQA) vs the naive attention reference.

Chain: the online softmax equals the full softmax -> hand-checkable examples (uniform
attention; fp16 rounds P before P @ V) -> a decode step loads each K/V element once (GQA
packing, counted) -> irregular packed batches (prefill, chunks on a prefix, decode, rows
with no key, empty sequences) in fp32, bf16 and fp16 -> a contiguous cache with gaps
(seqused_k) -> split-K -> strided q/k/v views of a fused qkv -> the registry stage -> the
launcher's errors.
"""

import pytest
import torch

from stagewise.config import PRESETS
from stagewise.kernels import INTERPRETER
from stagewise.kernels.attention_common import LOG2E, needs_int64_offsets, online_softmax_reference
from stagewise.kernels.checks import KernelInputError
from stagewise.kernels.flash_attention import flash_attention
from stagewise.stages import STAGES
from stagewise.stages.attention import naive
from stagewise.stages.attention_metadata import AttentionMetadata
from tests.helpers import assert_close
from tests.kernels.interpreter_loads import count_loaded_bytes

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# The reference runs in IEEE fp32 on the very same (16-bit-rounded) inputs. fp32: the kernel's dots are
# IEEE fp32 too (the interpreter always; on a GPU tests/kernels/conftest.py keeps TF32 off), so only the
# order of the additions (tile by tile, exp2 instead of exp) differs: ~1e-6 relative, well inside 1e-5.
# bf16 (8 significant bits): the output is rounded once to bf16 — to nearest on a GPU (<= 2^-8
# relative), by truncation in Triton's interpreter (< 2^-7, one ulp) — and on a GPU P is also
# rounded to bf16 before P @ V (<= 2^-8 per weight; the errors average out over the keys). Outputs are weighted means of
# N(0, 1) values, |out| <~ 3, so 1e-2 absolute + 1e-2 relative covers both with margin.
# fp16 (11 significant bits; 16-bit dots in the interpreter too): q k^T is exact (fp16 x fp16 products
# fit in fp32), P is rounded to fp16 before P @ V (<= 2^-11 per weight, so <= 2^-11 * max|v| ~ 2e-3
# absolute at the very worst, far less as the errors average out), and the output is rounded once
# (<= 2^-11 relative): 2e-3 absolute + 2^-10 relative.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1e-2), torch.float16: (2e-3, 2**-10)}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]


def packed_batch(q_lens, k_lens, num_heads, num_kv_heads, head_dim, dtype, seed=0):
    """Random q [sum q_lens, H, d], k/v [sum k_lens, Hkv, d] and their cu_seqlens."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen)
    k = torch.randn(sum(k_lens), num_kv_heads, head_dim, generator=gen)
    v = torch.randn(sum(k_lens), num_kv_heads, head_dim, generator=gen)
    return {
        "q": q.to(DEVICE, dtype),
        "k": k.to(DEVICE, dtype),
        "v": v.to(DEVICE, dtype),
        "cu_seqlens_q": torch.tensor([0, *q_lens]).cumsum(0).to(DEVICE, torch.int32),
        "cu_seqlens_k": torch.tensor([0, *k_lens]).cumsum(0).to(DEVICE, torch.int32),
        "scale": head_dim**-0.5,
    }


def reference(inputs: dict) -> torch.Tensor:
    """The naive stage in fp32 on the same (possibly bf16-rounded) inputs, lengths as metadata."""
    cu_q, cu_k = inputs["cu_seqlens_q"].tolist(), inputs["cu_seqlens_k"].tolist()
    used = inputs.get("seqused_k")
    seq_lens = used.tolist() if used is not None else [b - a for a, b in zip(cu_k, cu_k[1:])]
    q_lens = [b - a for a, b in zip(cu_q, cu_q[1:])]
    meta = AttentionMetadata.build(q_lens, seq_lens, DEVICE, k_starts=cu_k)
    q, k, v = (inputs[n].float() for n in ("q", "k", "v"))
    return naive(q, k, v, meta, inputs["scale"])


def test_online_softmax_tile_by_tile_equals_full_softmax():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(5, 11, generator=gen) * 4
    scores[1, 7:] = float("-inf")  # a causal-like mask
    scores[3] = float("-inf")  # a row that sees nothing -> 0
    values = torch.randn(11, 4, generator=gen)
    full = torch.softmax(scores.double(), dim=-1).nan_to_num(0.0) @ values.double()
    for block_n in (1, 3, 4, 11):
        assert_close(online_softmax_reference(scores, values, block_n), full, 1e-12, 1e-12, f"block_n={block_n}")


def test_worked_example_uniform_attention():
    """q = 0 makes every visible key equally likely: causal row i is the mean of v[0..i]."""
    v = torch.arange(3 * 16, dtype=torch.float32, device=DEVICE).view(3, 1, 16)  # [3 tokens, 1 head, d 16]
    cu = torch.tensor([0, 3], dtype=torch.int32, device=DEVICE)
    q, k = torch.zeros(3, 1, 16, device=DEVICE), torch.randn(3, 1, 16, device=DEVICE)
    out = flash_attention(q, k, v, cu, cu, scale=0.25)
    expected = torch.stack([v[0], (v[0] + v[1]) / 2, (v[0] + v[1] + v[2]) / 3])
    assert_close(out, expected, 1e-5, 1e-6, "mean of the visible values")


def test_fp16_runs_16_bit_dots_p_is_rounded_before_p_v():
    """Pins the 16-bit branch: with fp16 inputs P is rounded to fp16 before P @ V, as on tensor cores.

    One query, two keys; scale * log2(e) = 1, so the base-2 scores are q.k = 0 and -1 + 2^-11:
    p = 1 and 2^(-1 + 2^-11) = 0.50017, which fp16 (spacing 2^-11 above 0.5) rounds to 0.5.
    With v = -1 and 2: out = (1 * -1 + 0.5 * 2) / l = 0 exactly; unrounded, (-1 + 2 * 0.50017) / 1.50017 = 2.26e-4.
    """
    d = 16
    q = torch.zeros(1, 1, d)
    q[0, 0, 0] = 1.0
    k = torch.zeros(2, 1, d)
    k[1, 0, 0] = -1.0 + 2.0**-11
    v = torch.stack([torch.full((1, d), -1.0), torch.full((1, d), 2.0)])  # [2 keys, 1 head, d]
    cu_q, cu_k = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32)
    args = dict(cu_seqlens_q=cu_q.to(DEVICE), cu_seqlens_k=cu_k.to(DEVICE), scale=1.0 / LOG2E)
    p1 = 2.0 ** (-1.0 + 2.0**-11)
    unrounded = (-1.0 + 2.0 * p1) / (1.0 + p1)
    half = [t.to(DEVICE, torch.float16) for t in (q, k, v)]
    out16 = flash_attention(*half, **args)
    assert torch.equal(out16.float().cpu(), torch.zeros(1, 1, d)), "fp16 inputs must run 16-bit dots (P in fp16)"
    out32 = flash_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), **args)
    assert_close(out32, torch.full((1, 1, d), unrounded), 1e-7, 1e-4, "fp32 keeps P unrounded")


@pytest.mark.skipif(not INTERPRETER, reason="counts the loads of Triton's CPU interpreter")
def test_decode_reads_each_kv_element_once():
    """GQA packing: a decode step (one query per sequence) loads every used K/V element exactly once.

    G = 3 query heads share each KV head; one program per query head would load K/V three times.
    The slots past seqused_k are never loaded at all.
    """
    k_lens, used = [40, 33, 17], [40, 20, 17]
    inputs = packed_batch([1, 1, 1], k_lens, 6, 2, 16, torch.float32, seed=4)
    inputs["seqused_k"] = torch.tensor(used, dtype=torch.int32)
    with count_loaded_bytes(inputs["k"], inputs["v"]) as loaded:
        out = flash_attention(**inputs)
    used_bytes = sum(used) * 2 * 16 * 4  # keys x Hkv x d x fp32
    assert loaded == [used_bytes, used_bytes], f"K, V bytes loaded {loaded}, each used element once is {used_bytes}"
    assert_close(out, reference(inputs), *TOL[torch.float32], "decode")


CASES = {  # name: (q_lens, k_lens, H, Hkv, d)
    "prefill, GQA 1": ([7, 33, 1], [7, 33, 1], 2, 2, 64),
    "decode and chunk on a prefix, GQA 3": ([1, 7, 1], [33, 20, 1], 9, 3, 64),
    "more queries than keys, GQA 4": ([7, 5], [3, 0], 4, 1, 128),
    "empty sequences, tiny model": ([0, 7, 0, 1], [5, 7, 0, 3], 6, 2, 16),
    "head_dim 32": ([17], [17], 2, 1, 32),
    "long prefix: many key tiles": ([1, 3], [150, 97], 4, 2, 64),
    "first query one key before a tile edge; last key opens a tile": ([10, 1], [40, 33], 1, 1, 32),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_naive_on_packed_batches(case, dtype):
    q_lens, k_lens, num_heads, num_kv_heads, head_dim = CASES[case]
    inputs = packed_batch(q_lens, k_lens, num_heads, num_kv_heads, head_dim, dtype)
    out = flash_attention(**inputs)
    assert out.dtype == dtype and out.shape == inputs["q"].shape
    assert_close(out, reference(inputs), *TOL[dtype], case)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("num_splits", [2, 3])
def test_split_k_matches_naive(num_splits, dtype):
    """Split-K on decodes over a cache with gaps (one split of the 5-key row gets no key) and on a chunk."""
    capacity, used, q_lens = 130, [130, 33, 5, 40], [1, 1, 1, 4]
    inputs = packed_batch(q_lens, [capacity] * 4, 4, 2, 64, dtype, seed=3)
    for b, n in enumerate(used):  # slots past seqused_k hold NaN: a read would show
        inputs["k"][b * capacity + n : (b + 1) * capacity] = float("nan")
        inputs["v"][b * capacity + n : (b + 1) * capacity] = float("nan")
    inputs["seqused_k"] = torch.tensor(used, dtype=torch.int32, device=DEVICE)
    out = flash_attention(**inputs, num_splits=num_splits)
    assert torch.isfinite(out.float()).all()
    assert_close(out, reference(inputs), *TOL[dtype], f"{num_splits} splits")


def test_offsets_are_32_bit_unless_a_tensor_spans_2_31_elements():
    """Shapes only (meta tensors: no memory): 8B-sized prefill fits int32; a 2^31-element cache does not."""
    meta = dict(device="meta", dtype=torch.bfloat16)
    q, kv = torch.empty(8192, 32, 128, **meta), torch.empty(8192, 8, 128, **meta)
    assert not needs_int64_offsets(q, kv, kv)
    assert needs_int64_offsets(q, torch.empty(2**31 // 1024 + 1, 8, 128, **meta))
    # a view's reach counts, not its numel: rows 2^24 apart in a [2, 128] view
    assert needs_int64_offsets(torch.empty(2**31, **meta).as_strided((2, 128), (2**24 * 128, 1)))


def test_64_bit_offset_path_matches_naive(monkeypatch):
    """The 64-bit path (tensors past 2^31 elements: too big for a test) on a small prefill, forced on."""
    import stagewise.kernels.flash_attention as fa

    monkeypatch.setattr(fa, "needs_int64_offsets", lambda *tensors: True)
    inputs = packed_batch([33, 7], [33, 20], 4, 2, 32, torch.float32, seed=5)
    assert_close(fa.flash_attention(**inputs), reference(inputs), *TOL[torch.float32], "int64 offsets")


def test_empty_batch():
    inputs = packed_batch([], [], 4, 2, 64, torch.float32)
    assert flash_attention(**inputs).shape == (0, 4, 64)


def test_head_dim_256():
    inputs = packed_batch([5], [9], 2, 1, 256, torch.float32)
    assert_close(flash_attention(**inputs), reference(inputs), *TOL[torch.float32], "head_dim 256")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_seqused_k_reads_a_cache_with_gaps(dtype):
    """A contiguous cache: row b owns slots [b * 40, b * 40 + 40) and uses seqused_k[b] of them.

    The unused slots hold NaN: one read of them would poison the output.
    """
    capacity, used, q_lens = 40, [33, 1, 17], [1, 1, 17]
    inputs = packed_batch(q_lens, [capacity] * 3, 4, 1, 64, dtype, seed=1)
    for b, n in enumerate(used):
        inputs["k"][b * capacity + n : (b + 1) * capacity] = float("nan")
        inputs["v"][b * capacity + n : (b + 1) * capacity] = float("nan")
    inputs["seqused_k"] = torch.tensor(used, dtype=torch.int32, device=DEVICE)
    out = flash_attention(**inputs)
    assert torch.isfinite(out.float()).all()
    assert_close(out, reference(inputs), *TOL[dtype], "seqused_k")


def test_strided_views_of_a_fused_qkv():
    """q, k, v as split_qkv makes them: token stride (H + 2 Hkv) d, head stride d."""
    num_heads, num_kv_heads, head_dim, lens = 6, 2, 16, [7, 12]
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(sum(lens), (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(DEVICE)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.view(-1, num_heads, head_dim)  # [T, H, d] with token stride (H + 2 Hkv) d
    k, v = k.view(-1, num_kv_heads, head_dim), v.view(-1, num_kv_heads, head_dim)
    assert not q.is_contiguous() and q.stride(0) == (num_heads + 2 * num_kv_heads) * head_dim
    cu = torch.tensor([0, *lens]).cumsum(0).to(DEVICE, torch.int32)
    inputs = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu, "cu_seqlens_k": cu, "scale": head_dim**-0.5}
    assert_close(flash_attention(**inputs), reference(inputs), *TOL[torch.float32], "strided views")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("num_tokens", [1, 7, 33])
def test_registry_stage_triton_matches_naive(num_tokens, dtype):
    stage = STAGES["attention"]
    assert stage.triton_kind.startswith("triton")
    inputs = stage.example_inputs(PRESETS["tiny"], num_tokens, DEVICE, dtype)
    # both paths round their output to dtype once; the tolerance covers one rounding each
    assert_close(stage.triton(**inputs), stage.naive(**inputs), *TOL[dtype], f"attention stage, T={num_tokens}")


def _bad(**changes):
    """Valid inputs (prefill of 7 and 5 tokens, GQA 2) with some entries replaced."""
    inputs = packed_batch([7, 5], [7, 5], 4, 2, 64, torch.float32)
    inputs.update({n: f(inputs) if callable(f) else f for n, f in changes.items()})
    return inputs


ERRORS = {  # name: (inputs, words the message must contain)
    "head_dim 48": (packed_batch([3], [3], 2, 1, 48, torch.float32), "head_dim 48"),
    "head_dim 96": (packed_batch([3], [3], 2, 1, 96, torch.float32), "head_dim 96"),
    "kv heads do not divide H": (packed_batch([3], [3], 6, 4, 64, torch.float32), "H % Hkv"),
    "integer q": (_bad(q=lambda i: i["q"].to(torch.int32)), "dtype"),
    "mixed dtypes": (_bad(k=lambda i: i["k"].to(torch.bfloat16)), "share one dtype"),
    "k/v head_dim differs from q": (_bad(k=lambda i: i["k"][..., :32], v=lambda i: i["v"][..., :32]), "head_dim"),
    "cu_seqlens_k too long": (
        _bad(cu_seqlens_k=lambda i: torch.cat([i["cu_seqlens_k"], i["cu_seqlens_k"][-1:]])),
        "cu_seqlens_k",
    ),
    "cu_seqlens int64": (_bad(cu_seqlens_q=lambda i: i["cu_seqlens_q"].long()), "cu_seqlens_q"),
    "cu_seqlens_q misses rows": (_bad(cu_seqlens_q=lambda i: i["cu_seqlens_q"] - 1), "cu_seqlens_q"),
    "keys past the end of k": (
        _bad(seqused_k=lambda i: torch.tensor([7, 9], dtype=torch.int32, device=DEVICE)),
        "reads keys",
    ),
    "seqused_k wrong length": (
        _bad(seqused_k=lambda i: torch.tensor([7], dtype=torch.int32, device=DEVICE)),
        "seqused_k",
    ),
    "last dim strided": (_bad(q=lambda i: i["q"].transpose(1, 2).contiguous().transpose(1, 2)), "last dimension"),
    "zero scale": (_bad(scale=0.0), "scale"),
    "zero splits": (_bad(num_splits=0), "num_splits"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_launcher_rejects_bad_inputs(name):
    inputs, words = ERRORS[name]
    with pytest.raises(KernelInputError, match=words):
        flash_attention(**inputs)
