"""Triton in-place RoPE vs the naive rotate-half reference.

Chain: a hand-checkable worked example -> strided q/k views exactly as `split_qkv`
returns them (GQA 1, 3, 4; head_dim 16, 64, 128; positions up to the cache end)
-> in-place semantics -> the registry stage -> the launcher's errors.
"""

import math
from dataclasses import replace

import pytest
import torch
import triton

import stagewise.kernels.rope as rope_kernel
from stagewise.config import PRESETS
from stagewise.kernels.checks import KernelInputError
from stagewise.kernels.rope import rope
from stagewise.stages import STAGES
from stagewise.stages.qkv_proj import split_qkv
from stagewise.stages.rope import build_cos_sin_cache, naive
from tests.helpers import TOLERANCES, assert_close

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
MAX_POSITION = 64

# bf16: the naive reference runs on the same bf16 inputs and both compute in fp32, so only the
# final cast differs: PyTorch rounds to nearest, Triton's interpreter truncates (a GPU rounds to
# nearest, but may fuse a multiply-add and flip a tie). One bf16 rounding: <= 1 ulp <= 2^-7 relative.
TOL = {torch.float32: TOLERANCES[torch.float32], torch.bfloat16: (1e-6, 2**-7)}

# (H, Hkv, d): GQA ratios 1, 3, 4 and head_dim 16, 64, 128
HEADS = [(4, 4, 16), (9, 3, 64), (8, 2, 128), (6, 2, 16)]


def strided_qkv(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype):
    """-> qkv [T, (H+2Hkv)*d] and its q, k, v views, exactly as the model gets them from split_qkv."""
    config = replace(PRESETS["tiny"], num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    gen = torch.Generator().manual_seed(num_tokens + head_dim)
    qkv = torch.randn(num_tokens, config.qkv_size, generator=gen).to(DEVICE, dtype)
    return (qkv, *split_qkv(qkv, config))


def positions_to_cache_end(num_tokens: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(num_tokens)
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), generator=gen)
    positions[-1] = MAX_POSITION - 1  # the last row of the cache
    return positions.to(DEVICE)


def test_worked_example():
    # head_dim 2, theta 10000: one pair (x0, x1), frequency 1, so position p rotates by p radians.
    # q = [1, 0] at position 1 -> [cos 1, sin 1]; k = [0, 2] at position 1 -> [-2 sin 1, 2 cos 1].
    cache = build_cos_sin_cache(4, 2, 10000.0, DEVICE)  # [4, 2]
    q = torch.tensor([[[1.0, 0.0]]], device=DEVICE)  # [T=1, H=1, d=2]
    k = torch.tensor([[[0.0, 2.0]]], device=DEVICE)
    rope(torch.tensor([1], device=DEVICE), q, k, cache)
    c, s = math.cos(1.0), math.sin(1.0)
    assert_close(q, torch.tensor([[[c, s]]]), 1e-6, 1e-6, what="q")
    assert_close(k, torch.tensor([[[-2 * s, 2 * c]]]), 1e-6, 1e-6, what="k")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", HEADS, ids=[f"H{h}-Hkv{kv}-d{d}" for h, kv, d in HEADS])
@pytest.mark.parametrize("num_tokens", [1, 7, 33])
def test_strided_views_match_naive(num_tokens, heads, dtype):
    num_heads, num_kv_heads, head_dim = heads
    qkv, q, k, v = strided_qkv(num_tokens, num_heads, num_kv_heads, head_dim, dtype)
    if num_tokens > 1:  # (a size-1 dim's stride is arbitrary: view() gives it H * d)
        assert q.stride(0) == (num_heads + 2 * num_kv_heads) * head_dim  # really strided along tokens
    positions = positions_to_cache_end(num_tokens)
    cache = build_cos_sin_cache(MAX_POSITION, head_dim, 10000.0, DEVICE)
    ref_q, ref_k = naive(positions, q, k, cache)  # new tensors; q, k untouched
    v_before = v.clone()

    out_q, out_k = rope(positions, q, k, cache)
    assert out_q is q and out_k is k  # the same objects, rotated in place
    assert_close(q, ref_q, *TOL[dtype], what="q")
    assert_close(k, ref_k, *TOL[dtype], what="k")
    assert torch.equal(v, v_before), "v, the third part of the fused qkv buffer, must not be touched"


def test_several_head_blocks(monkeypatch):
    # A smaller tile bound forces q head blocks of 8 (d/2 = 8): H = 12 needs two; k's 4 heads spread 2 + 2.
    monkeypatch.setattr(rope_kernel, "MAX_TILE", 64)
    heads, _ = rope_kernel.rope_tiles(5, 12, 4, 16)
    assert (heads["BLOCK_HQ"], heads["BLOCK_HK"]) == (8, 2)
    _, q, k, _ = strided_qkv(5, 12, 4, 16, torch.float32)
    positions = positions_to_cache_end(5)
    cache = build_cos_sin_cache(MAX_POSITION, 16, 10000.0, DEVICE)
    ref_q, ref_k = naive(positions, q, k, cache)
    rope(positions, q, k, cache)
    assert_close(q, ref_q, *TOL[torch.float32], what="q")
    assert_close(k, ref_k, *TOL[torch.float32], what="k")


def test_tiles():
    # Llama-3-8B: all 32 q heads and 8 k heads of one token per program (10 KB of bf16), 4 warps.
    heads, tile = rope_kernel.rope_tiles(65536, 32, 8, 128)
    assert heads == {"HALF": 64, "BLOCK_HALF": 64, "BLOCK_HQ": 32, "BLOCK_HK": 8}
    assert (tile.block_t, tile.num_warps) == (1, 4)
    # SmolLM2: 9 q + 3 k heads of 64 fill [16 + 4, 32] half-tiles; 4 tokens per program.
    heads, tile = rope_kernel.rope_tiles(65536, 9, 3, 64)
    assert (heads["BLOCK_HQ"], heads["BLOCK_HK"], tile.block_t) == (16, 4, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads, num_kv_heads, block_hk", [(9, 3, 1), (12, 4, 2)])
def test_ragged_token_tiles_and_head_blocks(monkeypatch, num_heads, num_kv_heads, block_hk, dtype):
    # q head blocks of 4 (d/2 = 8), 4 tokens per program: 7 tokens -> tiles of 4 + 3. H = 9: three q blocks,
    # 4 + 4 + 1 heads, one k head each; H = 12, Hkv = 4: k blocks of 2 heads, the third block's fully masked.
    monkeypatch.setattr(rope_kernel, "MAX_TILE", 32)
    monkeypatch.setattr(rope_kernel, "TOKEN_TILE", 4 * 6 * 8)
    heads, tile = rope_kernel.rope_tiles(7, num_heads, num_kv_heads, 16)
    assert (heads["BLOCK_HQ"], heads["BLOCK_HK"], tile.block_t) == (4, block_hk, 4)
    assert triton.cdiv(num_heads, 4) * block_hk >= num_kv_heads  # every k head has a block
    qkv, q, k, v = strided_qkv(7, num_heads, num_kv_heads, 16, dtype)
    positions = positions_to_cache_end(7)
    cache = build_cos_sin_cache(MAX_POSITION, 16, 10000.0, DEVICE)
    ref_q, ref_k = naive(positions, q, k, cache)
    v_before = v.clone()
    rope(positions, q, k, cache)
    assert_close(q, ref_q, *TOL[dtype], what="q")
    assert_close(k, ref_k, *TOL[dtype], what="k")
    assert torch.equal(v, v_before)


def test_int32_positions():
    _, q, k, _ = strided_qkv(7, 6, 2, 16, torch.float32)
    positions = positions_to_cache_end(7)
    cache = build_cos_sin_cache(MAX_POSITION, 16, 10000.0, DEVICE)
    ref_q, ref_k = naive(positions, q, k, cache)
    rope(positions.to(torch.int32), q, k, cache)
    assert_close(q, ref_q, *TOL[torch.float32], what="q")
    assert_close(k, ref_k, *TOL[torch.float32], what="k")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 33])
def test_registry_stage(num_tokens, dtype):
    stage = STAGES["rope"]
    inputs = stage.example_inputs(PRESETS["tiny"], num_tokens, DEVICE, dtype)
    ref_q, ref_k = stage.naive(**inputs)
    mine = {name: value.clone() for name, value in inputs.items()}  # the triton tier works in place
    out_q, out_k = stage.triton(**mine)
    assert_close(out_q, ref_q, *TOL[dtype], what="q")
    assert_close(out_k, ref_k, *TOL[dtype], what="k")
    assert stage.triton_kind.startswith("triton")


def t(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype)


GOOD_CACHE = build_cos_sin_cache(8, 16, 10000.0)  # [8, 16]


@pytest.mark.parametrize(
    "positions, q, k, cache, message",
    [
        (torch.tensor([0, 8]), t(2, 2, 16), t(2, 1, 16), GOOD_CACHE, r"positions must lie in \[0, 8\).*max 8"),
        (torch.tensor([-1, 0]), t(2, 2, 16), t(2, 1, 16), GOOD_CACHE, r"positions must lie in \[0, 8\).*min -1"),
        (torch.tensor([0, 1]), t(2, 2, 15), t(2, 1, 15), t(8, 15), "head_dim 15 is odd"),
        (torch.tensor([0, 1]), t(2, 2, 16), t(2, 1, 16), t(8, 8), "partial rotary .* not supported"),
        (torch.tensor([0, 1]), t(2, 2, 16, dtype=torch.int32), t(2, 1, 16), GOOD_CACHE, "q has dtype int32"),
        (torch.tensor([0, 1]), t(2, 2, 16), t(2, 1, 16), GOOD_CACHE.bfloat16(), "cos_sin_cache has dtype bfloat16"),
        (torch.tensor([0.0, 1.0]), t(2, 2, 16), t(2, 1, 16), GOOD_CACHE, "positions has dtype float32"),
        (torch.tensor([0, 1, 2]), t(2, 2, 16), t(2, 1, 16), GOOD_CACHE, "same number of tokens"),
        (torch.tensor([0, 1]), t(2, 2, 16), t(2, 1, 8), GOOD_CACHE, "q has head_dim 16 but k has 8"),
        (torch.tensor([0, 1]), t(2, 16, 2).transpose(1, 2), t(2, 1, 16), GOOD_CACHE, "contiguous last dimension"),
        (torch.tensor([0, 1]), t(2, 32), t(2, 1, 16), GOOD_CACHE, "q must be 3-D"),
    ],
)
def test_launcher_errors(positions, q, k, cache, message):
    with pytest.raises(KernelInputError, match=message):
        rope(positions.to(DEVICE), q.to(DEVICE), k.to(DEVICE), cache.to(DEVICE))
