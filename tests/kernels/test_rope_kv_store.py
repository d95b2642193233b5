"""RoPE fused with the KV store (`kernels/rope_kv_store.py`) against `rope.naive` then `kv_store.naive`.

q, k, v are the strided views `split_qkv` returns; slots are shuffled, one is -1 (padding: stored
nowhere, but its q still rotated); GQA 1 and 3, head_dim 16 and 32. Then the launcher's refusals.
"""

import pytest
import torch

from stagewise.kernels.checks import KernelInputError
from stagewise.kernels.rope_kv_store import rope_kv_store
from stagewise.stages import kv_store, rope
from stagewise.stages.attention_metadata import AttentionMetadata
from stagewise.stages.rope import build_cos_sin_cache
from tests.helpers import TOLERANCES

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
MAX_POSITION = 50
NUM_SLOTS = 40
# bf16: both rotate in fp32; only the final cast differs (the interpreter truncates): <= 1 ulp
TOL = {torch.float32: TOLERANCES[torch.float32], torch.bfloat16: (1e-6, 2**-7), torch.float16: (1e-6, 2**-10)}


def _inputs(num_tokens, num_heads, num_kv_heads, head_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(DEVICE, dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.view(num_tokens, num_heads, head_dim)  # strided views of the fused output, as split_qkv gives
    k = k.view(num_tokens, num_kv_heads, head_dim)
    v = v.view(num_tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), generator=gen).to(DEVICE)
    slots = torch.randperm(NUM_SLOTS, generator=gen)[:num_tokens]
    slots[num_tokens // 2] = -1  # padding
    cache = build_cos_sin_cache(MAX_POSITION, head_dim, 10000.0, DEVICE)
    return q, k, v, positions, slots.to(DEVICE), cache


def _caches(num_kv_heads, head_dim, dtype):
    shape = (NUM_SLOTS, num_kv_heads, head_dim)
    return torch.full(shape, 7.0, dtype=dtype, device=DEVICE), torch.full(shape, 7.0, dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("num_tokens", "num_heads", "num_kv_heads", "head_dim"), [(5, 6, 2, 32), (3, 4, 4, 16)])
def test_fused_equals_rope_then_kv_store(num_tokens, num_heads, num_kv_heads, head_dim, dtype):
    q, k, v, positions, slots, cache = _inputs(num_tokens, num_heads, num_kv_heads, head_dim, dtype, seed=num_tokens)
    q_ref, k_ref = rope.naive(positions, q, k, cache)
    k_cache_ref, v_cache_ref = _caches(num_kv_heads, head_dim, dtype)
    metadata = AttentionMetadata.build([num_tokens], [num_tokens], DEVICE, slot_mapping=slots.tolist())
    metadata.all_slots_valid = False
    kv_store.naive(k_ref, v, k_cache_ref, v_cache_ref, metadata)
    k_before = k.clone()
    k_cache, v_cache = _caches(num_kv_heads, head_dim, dtype)
    q_out = rope_kv_store(positions, q, k, v, cache, k_cache, v_cache, slots)
    atol, rtol = TOL[dtype]
    assert q_out is q
    torch.testing.assert_close(q, q_ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(k_cache, k_cache_ref, atol=atol, rtol=rtol)
    assert torch.equal(v_cache, v_cache_ref), "v is copied, not rounded"
    assert torch.equal(k, k_before), "k in the QKV buffer stays unrotated"
    assert (k_cache == 7.0).all(dim=(1, 2)).sum() == NUM_SLOTS - (num_tokens - 1), "only valid slots written"


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ("short_slots", "one entry per token"),
        ("cache_heads", "cache slots are"),
        ("partial_rotary", "partial rotary"),
        ("float_positions", "positions has dtype"),
        ("strided_cache", "k_cache must be contiguous"),
    ],
)
def test_launcher_refuses_wrong_layouts(change, match):
    q, k, v, positions, slots, cache = _inputs(4, 4, 2, 16, torch.float32)
    k_cache, v_cache = _caches(2, 16, torch.float32)
    if change == "short_slots":
        slots = slots[:-1]
    elif change == "cache_heads":
        k_cache, v_cache = _caches(1, 32, torch.float32)
    elif change == "partial_rotary":
        cache = cache[:, :8].contiguous()
    elif change == "float_positions":
        positions = positions.float()
    elif change == "strided_cache":
        k_cache = torch.zeros(2, NUM_SLOTS, 16, device=DEVICE).transpose(0, 1)
    with pytest.raises(KernelInputError, match=match):
        rope_kv_store(positions, q, k, v, cache, k_cache, v_cache, slots)
