"""The torch tiers that cut PyTorch calls from a decode step, against the naive tiers.

RMSNorm (`stages/rmsnorm_torch.py`) and the KV store (`stages/kv_store_torch.py`) must give the
reference's bits; attention's rows (`stages/attention_torch.py`) run over fixed-size key chunks, as the
paged tier's do (`stages/chunked_attention.py`), within float32 rounding of the reference, and with
`batch_invariant=False` its prefill rows are the reference's bits (a greedy token can hang on a 1e-7
difference, so the variant keeps them exact); the SwiGLU FFN over packed
weights keeps bfloat16 between its two GEMMs (`stages/gemm_torch.py`), held to the bfloat16 bound of
the dequantize-GEMM's own tests.
Expected values come from the naive tiers, never from the code under test.
"""

import pytest
import torch

from stagewise.quant.quantize import quantize
from stagewise.stages import attention, attention_torch, ffn, gemm_torch, kv_store, rmsnorm
from stagewise.stages.attention_metadata import AttentionMetadata
from stagewise.stages.rope_torch import wide_cache
from tests.helpers import assert_close


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("rows", [1, 7])
def test_rmsnorm_torch_tier_gives_the_references_bits(dtype, with_residual, rows):
    x, residual = randn(rows, 37, seed=rows).to(dtype), randn(rows, 37, seed=9).to(dtype)
    weight = (1 + 0.1 * randn(37, seed=2)).to(dtype)
    res = residual if with_residual else None
    x_before = x.clone()
    ref, ref_res = rmsnorm.naive(x, weight, 1e-5, res)
    out, out_res = rmsnorm.STAGE.torch(x, weight, 1e-5, res)
    assert out.dtype == ref.dtype and torch.equal(out, ref)
    assert torch.equal(out_res, ref_res) and torch.equal(x, x_before)


def test_rmsnorm_torch_tier_follows_the_references_type_promotion():
    x, weight = randn(3, 16, seed=1).to(torch.bfloat16), 1 + 0.1 * randn(16, seed=2)  # f32 weight
    ref, _ = rmsnorm.naive(x, weight, 1e-5)
    out, _ = rmsnorm.STAGE.torch(x, weight, 1e-5)
    assert out.dtype == ref.dtype == torch.float32 and torch.equal(out, ref)


def attention_inputs(q_lens: list[int], k_lens: list[int], heads=6, kv_heads=2, head_dim=8):
    """Sequences packed end to end in a contiguous cache with spare rows after each one."""
    capacity = max(k_lens) + 3
    k_starts = [b * capacity for b in range(len(k_lens))]
    q = randn(sum(q_lens), heads, head_dim, seed=1)
    k = randn(len(k_lens) * capacity, kv_heads, head_dim, seed=2)
    v = randn(len(k_lens) * capacity, kv_heads, head_dim, seed=3)
    metadata = AttentionMetadata.build(q_lens, k_lens, torch.device("cpu"), k_starts=k_starts)
    return {"q": q, "k": k, "v": v, "metadata": metadata, "scale": head_dim**-0.5}


@pytest.mark.parametrize(
    ("q_lens", "k_lens"),
    [
        ([1], [1]),  # the first decode row: one key
        ([1], [29]),  # one sequence decoding
        ([1, 1, 1], [5, 17, 2]),  # a static batch of decode rows, unequal lengths
        ([1, 4, 1], [9, 4, 12]),  # a prefill between decode rows
        ([1, 1], [0, 6]),  # a padding row that may see no key: zeros, as the reference gives
        ([7], [7]),  # a prefill: the square's causal triangle
        ([3, 5], [11, 2]),  # a chunk on a cached prefix; more queries than keys (3 rows see none)
    ],
)
def test_attention_torch_tier_matches_the_reference(q_lens, k_lens):
    inputs = attention_inputs(q_lens, k_lens)
    ref = attention.naive(**inputs)
    out = attention.STAGE.torch(**inputs)  # every row over fixed key chunks
    assert out.dtype == ref.dtype
    assert_close(out, ref, 1e-6, 1e-6, f"attention torch tier {q_lens} {k_lens}")
    variant = attention.STAGE.tier("torch", batch_invariant=False)(**inputs)
    if all(n > 1 for n in q_lens):  # prefill rows only: the reference's products, bit for bit
        assert torch.equal(variant, ref), (q_lens, k_lens, (variant - ref).abs().max())
    else:  # decode rows: the chunked sums, float32 rounding apart
        assert_close(variant, ref, 1e-6, 1e-6, f"attention torch variant {q_lens} {k_lens}")


def test_a_decode_row_sees_every_key_with_equal_weights_when_scores_tie():
    """By hand: all keys equal -> equal scores -> the output is the mean of the values."""
    q = torch.ones(1, 2, 4)  # [1, H=2, d=4]
    k = torch.ones(3, 1, 4)  # [Lk=3, Hkv=1, d]
    v = torch.tensor([[[1.0, 0, 0, 0]], [[0, 2.0, 0, 0]], [[0, 0, 3.0, 6.0]]])  # [3, 1, 4]
    out = attention_torch.sequence_attention(q, k, v, scale=0.5)
    assert_close(out, torch.tensor([[[1 / 3, 2 / 3, 1.0, 2.0]] * 2]), 1e-6, 0, "mean of values")


@pytest.mark.parametrize("k_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_kv_store_torch_tier_writes_the_references_bits(k_dtype, slot_dtype):
    slots = [7, -1, 2, 11]  # one padding token that must not be written
    metadata = AttentionMetadata.build([4], [4], torch.device("cpu"), slot_mapping=slots)
    metadata.slot_mapping = metadata.slot_mapping.to(slot_dtype)
    k, v = randn(4, 2, 8, seed=1).to(k_dtype), randn(4, 2, 8, seed=2).to(k_dtype)
    caches = {tier: (torch.zeros(16, 2, 8), torch.zeros(16, 2, 8)) for tier in ("naive", "torch")}
    kv_store.STAGE.naive(k, v, *caches["naive"], metadata)
    kv_store.STAGE.torch(k, v, *caches["torch"], metadata)
    assert torch.equal(caches["torch"][0], caches["naive"][0])
    assert torch.equal(caches["torch"][1], caches["naive"][1])
    assert caches["torch"][0][[0, 1, 3]].abs().sum() == 0  # untouched slots stay zero


def test_rope_wide_cache_is_built_once_per_cache():
    cache = torch.cat([torch.ones(5, 2), torch.full((5, 2), 0.5)], dim=-1)  # cos 1, sin 0.5, d 4
    wide = wide_cache(cache)
    assert wide_cache(cache) is wide
    assert torch.equal(wide[0], torch.tensor([1.0, 1, 1, 1, -0.5, -0.5, 0.5, 0.5]))
    assert wide_cache(cache.clone()) is not wide  # another tensor: its own rows


@pytest.mark.parametrize("rows", [1, 5])
def test_packed_ffn_keeps_bfloat16_between_its_gemms_within_bfloat16_rounding(rows):
    w_gate_up = quantize(randn(64, 128, seed=1) / 8, "q4_1")  # hidden 64 (two groups of 32)
    w_down = quantize(randn(64, 64, seed=2) / 8, "q4_1")  # inter 64 -> hidden 64
    x = randn(rows, 64, seed=3)
    ref = ffn.naive(x, w_gate_up, w_down)  # dequantized float32 all the way
    out = gemm_torch.ffn(x, w_gate_up, w_down)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    worst = (out - ref).abs().max().item()
    assert worst <= 2e-2 * ref.abs().max().item(), (worst, ref.abs().max().item())
