"""Triton KV store vs the naive `index_copy_`: exact, since a store only copies (or casts).

Chain: a hand-checkable worked example -> strided k/v views from `split_qkv`, shuffled
slots with -1 entries, GQA shapes, a paged cache viewed as slots -> dtype casts ->
the registry stage -> the launcher's errors.
"""

from dataclasses import replace

import pytest
import torch

import stagewise.kernels.kv_store as kv_store_kernel
from stagewise.config import PRESETS
from stagewise.kernels.checks import KernelInputError
from stagewise.kernels.kv_store import kv_store
from stagewise.stages import STAGES
from stagewise.stages.attention_metadata import AttentionMetadata
from stagewise.stages.kv_store import naive
from stagewise.stages.qkv_proj import split_qkv
from tests.helpers import assert_close

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# (H, Hkv, d): GQA ratios 1, 3, 4 and head_dim 16, 64, 128
HEADS = [(4, 4, 16), (9, 3, 64), (8, 2, 128)]


def strided_kv(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype):
    """-> k, v [T, Hkv, d]: views into a fused qkv buffer, exactly as the model gets them."""
    config = replace(PRESETS["tiny"], num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    gen = torch.Generator().manual_seed(num_tokens + head_dim)
    qkv = torch.randn(num_tokens, config.qkv_size, generator=gen).to(DEVICE, dtype)
    _, k, v = split_qkv(qkv, config)
    return k, v


def shuffled_slots(num_tokens: int, num_slots: int) -> torch.Tensor:
    """Distinct slots in random order, every third token -1 (not stored)."""
    gen = torch.Generator().manual_seed(num_tokens)
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[1::3] = -1
    return slots.to(DEVICE)


def sentinel_cache(num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """A cache full of a value no token has, so a stray write (or a skipped -1 written) shows."""
    return torch.full((num_slots, num_kv_heads, head_dim), 7.0, dtype=dtype, device=DEVICE)


def run_both(k, v, k_cache, v_cache, slot_mapping):
    """-> (ours, reference) caches after storing into copies of the same starting caches."""
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    one_seq = AttentionMetadata.build([k.shape[0]], [k.shape[0]], k.device)  # the stage's metadata, these slots
    naive(k, v, ref_k, ref_v, replace(one_seq, slot_mapping=slot_mapping, all_slots_valid=False))
    kv_store(k, v, k_cache, v_cache, slot_mapping)
    return (k_cache, v_cache), (ref_k, ref_v)


def test_worked_example():
    # Two tokens, slots [3, -1]: token 0 lands in slot 3, token 1 is padding; slots 0-2 keep their zeros.
    k = torch.tensor([[[1.0, 2.0]], [[3.0, 4.0]]], device=DEVICE)  # [T=2, Hkv=1, d=2]
    v = -k
    k_cache = torch.zeros(4, 1, 2, device=DEVICE)
    v_cache = torch.zeros(4, 1, 2, device=DEVICE)
    kv_store(k, v, k_cache, v_cache, torch.tensor([3, -1], device=DEVICE))
    assert k_cache.tolist() == [[[0.0, 0.0]], [[0.0, 0.0]], [[0.0, 0.0]], [[1.0, 2.0]]]
    assert v_cache.tolist() == [[[0.0, 0.0]], [[0.0, 0.0]], [[0.0, 0.0]], [[-1.0, -2.0]]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", HEADS, ids=[f"H{h}-Hkv{kv}-d{d}" for h, kv, d in HEADS])
@pytest.mark.parametrize("num_tokens", [1, 7, 33])
def test_strided_views_match_naive(num_tokens, heads, dtype):
    _, num_kv_heads, head_dim = heads
    k, v = strided_kv(num_tokens, *heads, dtype)
    if num_tokens > 1:  # (a size-1 dim's stride is arbitrary: view() gives it Hkv * d)
        assert k.stride(0) == (heads[0] + 2 * num_kv_heads) * head_dim  # really strided along tokens
    num_slots = 2 * num_tokens + 3
    slots = shuffled_slots(num_tokens, num_slots)
    caches = [sentinel_cache(num_slots, num_kv_heads, head_dim, dtype) for _ in range(2)]
    ours, ref = run_both(k, v, *caches, slots)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])  # copies: bit-exact


def test_paged_cache_viewed_as_slots():
    # [num_blocks=5, block_size=4, Hkv, d] seen as [20, Hkv, d]: slot = block_id * 4 + offset.
    k, v = strided_kv(6, 6, 2, 16, torch.float32)
    paged_k = torch.zeros(5, 4, 2, 16, device=DEVICE)
    paged_v = torch.zeros(5, 4, 2, 16, device=DEVICE)
    slots = torch.tensor([3 * 4 + 0, 3 * 4 + 1, 0 * 4 + 3, -1, 4 * 4 + 2, 1 * 4 + 0], device=DEVICE)
    kv_store(k, v, paged_k.view(-1, 2, 16), paged_v.view(-1, 2, 16), slots)
    assert torch.equal(paged_k[3, 1], k[1]) and torch.equal(paged_v[0, 3], v[2]) and torch.equal(paged_k[4, 2], k[4])
    assert int((paged_k.abs().sum(dim=(2, 3)) > 0).sum()) == 5  # five slots written, the -1 token nowhere


def test_several_head_blocks(monkeypatch):
    # A smaller tile bound forces blocks of 2 heads (d = 16): Hkv = 3 needs two, the second half masked.
    monkeypatch.setattr(kv_store_kernel, "MAX_TILE", 32)
    k, v = strided_kv(7, 9, 3, 16, torch.float32)
    slots = shuffled_slots(7, 20)
    ours, ref = run_both(
        k, v, sentinel_cache(20, 3, 16, torch.float32), sentinel_cache(20, 3, 16, torch.float32), slots
    )
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])


def test_llama_tiles():
    # Llama-3-8B: all 8 heads of a token in one program, 4 tokens: 2 x 8 KB of bf16 in flight, 4 warps.
    heads, (tile,) = kv_store_kernel.kv_store_tiles(65536, 8, 128, interpreter=True)
    assert heads == {"HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_HEADS": 8}
    assert (tile.block_t, tile.num_warps) == (4, 4)
    _, candidates = kv_store_kernel.kv_store_tiles(65536, 8, 128, interpreter=False)
    assert tile in candidates and len(candidates) > 1  # a GPU autotunes around it


def test_ragged_token_tiles_and_head_blocks(monkeypatch):
    # 4 tokens and 2 heads per program (d = 16): 7 tokens -> tiles of 4 + 3, Hkv = 3 -> head blocks of 2 + 1.
    monkeypatch.setattr(kv_store_kernel, "MAX_TILE", 32)
    monkeypatch.setattr(kv_store_kernel, "TOKEN_TILE", 4 * 32)
    heads, (tile,) = kv_store_kernel.kv_store_tiles(7, 3, 16, interpreter=True)
    assert heads["BLOCK_HEADS"] == 2 and tile.block_t == 4
    k, v = strided_kv(7, 9, 3, 16, torch.float32)
    slots = shuffled_slots(7, 20)
    assert slots[1] == -1 and slots[4] == -1  # a skipped token in each token tile
    caches = [sentinel_cache(20, 3, 16, torch.float32) for _ in range(2)]
    ours, ref = run_both(k, v, *caches, slots)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])


def test_a_tile_of_skipped_tokens(monkeypatch):
    # The first tile's four tokens are all -1: nothing of theirs lands anywhere; the second tile stores all four.
    monkeypatch.setattr(kv_store_kernel, "TOKEN_TILE", 4 * 2 * 16)
    k, v = strided_kv(8, 6, 2, 16, torch.float32)
    slots = torch.tensor([-1, -1, -1, -1, 6, 0, 9, 3], device=DEVICE)
    ours, ref = run_both(
        k, v, sentinel_cache(10, 2, 16, torch.float32), sentinel_cache(10, 2, 16, torch.float32), slots
    )
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])
    assert int((ours[0] != 7.0).any(dim=(1, 2)).sum()) == 4  # exactly four slots written


def test_casts_to_the_cache_dtype():
    k, v = strided_kv(7, 6, 2, 16, torch.float32)
    slots = shuffled_slots(7, 16).to(torch.int32)
    ours, ref = run_both(
        k, v, sentinel_cache(16, 2, 16, torch.bfloat16), sentinel_cache(16, 2, 16, torch.bfloat16), slots
    )
    # fp32 -> bf16: PyTorch rounds to nearest, Triton's interpreter truncates: <= 1 bf16 ulp (2^-7 relative).
    assert_close(ours[0], ref[0], 0.0, 2**-7, what="k_cache")
    assert_close(ours[1], ref[1], 0.0, 2**-7, what="v_cache")
    # bf16 -> fp32 is exact.
    k16, v16 = k.bfloat16(), v.bfloat16()
    ours, ref = run_both(
        k16, v16, sentinel_cache(16, 2, 16, torch.float32), sentinel_cache(16, 2, 16, torch.float32), slots
    )
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 33])
def test_registry_stage(num_tokens, dtype):
    stage = STAGES["kv_store"]
    inputs = stage.example_inputs(PRESETS["tiny"], num_tokens, DEVICE, dtype)
    # both paths write their caches in place
    mine = {name: value.clone() if isinstance(value, torch.Tensor) else value for name, value in inputs.items()}
    assert stage.naive(**inputs) is None and stage.triton(**mine) is None
    assert torch.equal(mine["k_cache"], inputs["k_cache"]) and torch.equal(mine["v_cache"], inputs["v_cache"])
    assert stage.triton_kind.startswith("triton")


def t(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype)


SLOTS = torch.tensor([0, -1])


@pytest.mark.parametrize(
    "k, v, k_cache, v_cache, slots, message",
    [
        (t(2, 2, 16), t(2, 2, 16), t(4, 16, 2).transpose(1, 2), t(4, 2, 16), SLOTS, "k_cache must be contiguous"),
        (t(2, 2, 16), t(2, 3, 16), t(4, 2, 16), t(4, 2, 16), SLOTS, "must agree"),
        (t(2, 2, 16), t(2, 2, 16), t(4, 2, 16), t(4, 2, 16), torch.tensor([0, 1, 2]), "must agree"),
        (t(2, 2, 16), t(2, 2, 16), t(4, 1, 16), t(4, 1, 16), SLOTS, r"cache slots are \[1, 16\]"),
        (t(2, 2, 16), t(2, 2, 16), t(4, 2, 16), t(5, 2, 16), SLOTS, "same shape and dtype"),
        (t(2, 2, 16), t(2, 2, 16), t(4, 2, 16), t(4, 2, 16, dtype=torch.bfloat16), SLOTS, "same shape and dtype"),
        (t(2, 2, 16, dtype=torch.int64), t(2, 2, 16), t(4, 2, 16), t(4, 2, 16), SLOTS, "k has dtype int64"),
        (t(2, 2, 16), t(2, 2, 16), t(4, 2, 16), t(4, 2, 16), torch.tensor([0.0, 1.0]), "slot_mapping has dtype"),
        (t(2, 2, 16), t(2, 2, 16), t(4, 2, 16), t(4, 2, 16), torch.tensor([0, 4]), r"\[0, 4\).*max 4"),
        (t(2, 2, 16), t(2, 2, 16), t(4, 2, 16), t(4, 2, 16), torch.tensor([-2, 0]), r"or be -1.*min -2"),
        (t(2, 32), t(2, 32), t(4, 2, 16), t(4, 2, 16), SLOTS, "k must be 3-D"),
    ],
)
def test_launcher_errors(k, v, k_cache, v_cache, slots, message):
    with pytest.raises(KernelInputError, match=message):
        kv_store(k.to(DEVICE), v.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), slots.to(DEVICE))
