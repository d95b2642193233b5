"""Every stage's `torch` tier against its `naive` tier, on small irregular shapes.

The projections' torch tier (`stages/gemm_torch.py`) is checked with each CPU GEMM form
(`tuning/gemm_forms.py`) forced for every bucket, on the out-major weights the CPU stores and on
contiguous [in, out] ones; RoPE's (`stages/rope_torch.py`) on the strided q/k views `split_qkv`
returns. The naive tier is the textbook formula; the expected values come from it, not from the
code under test.
"""

import pytest
import torch

from stagewise.config import PRESETS
from stagewise.stages import STAGES, ffn, lm_head, o_proj, qkv_proj, rope
from stagewise.stages.rope import build_cos_sin_cache
from stagewise.tuning import gemm_forms
from tests.helpers import TOLERANCES, assert_close

ROWS = [1, 3, 8, 13, 70]  # decode rows, the three GEMM buckets, and past SMALL_M
PROJECTIONS = [qkv_proj, o_proj, ffn, lm_head]


def out_major(w: torch.Tensor) -> torch.Tensor:
    return w.t().contiguous().t()  # the same [K, N] numbers, stored [N, K] row-major (the CPU's)


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def projection_inputs(stage, m: int, layout: str, dtype: torch.dtype) -> dict:
    """Odd widths (37 in, 53 / 2*29 out) and, for 128 columns, whole blocks of the blocked form."""
    lay = out_major if layout == "out_major" else (lambda w: w)
    x = randn(m, 37, seed=m).to(dtype)
    if stage is qkv_proj:
        return {"x": x, "w_qkv": lay(randn(37, 53, seed=1).to(dtype))}
    if stage is o_proj:
        return {"x": x, "w_o": lay(randn(37, 128, seed=2).to(dtype))}
    if stage is ffn:
        w_gate_up = lay(randn(37, 2 * 29, seed=3).to(dtype) / 6)
        return {"x": x, "w_gate_up": w_gate_up, "w_down": lay(randn(29, 53, seed=4).to(dtype))}
    last = torch.tensor(sorted({m - 1, m // 2, 0}), dtype=torch.long)  # up to 3 sequences' last rows
    return {"hidden": x, "last_token_index": last, "w_lm": lay(randn(37, 128, seed=5).to(dtype))}


@pytest.mark.parametrize("stage", PROJECTIONS, ids=lambda s: s.STAGE.name)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("layout", ["out_major", "in_major"])
@pytest.mark.parametrize("form", gemm_forms.FORMS)
def test_projection_torch_tier_matches_naive(stage, m, layout, form, monkeypatch):
    forms = gemm_forms.CpuForms(chosen=dict.fromkeys(gemm_forms.BUCKET_M, form))
    monkeypatch.setattr(gemm_forms, "CPU_FORMS", forms)
    inputs = projection_inputs(stage, m, layout, torch.float32)
    ref = stage.STAGE.naive(**inputs)
    out = stage.STAGE.torch(**inputs)
    assert out.is_contiguous()
    atol, rtol = TOLERANCES[torch.float32]
    assert_close(out, ref, atol, rtol, f"{stage.STAGE.name} torch ({form}) vs naive, M={m}")


@pytest.mark.parametrize("stage", PROJECTIONS, ids=lambda s: s.STAGE.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_projection_torch_tier_other_dtypes(stage, dtype, monkeypatch):
    forms = gemm_forms.CpuForms(chosen=dict.fromkeys(gemm_forms.BUCKET_M, "transposed"))
    monkeypatch.setattr(gemm_forms, "CPU_FORMS", forms)
    inputs = projection_inputs(stage, 3, "out_major", dtype)
    atol, rtol = TOLERANCES.get(dtype, (1e-12, 1e-12))
    assert_close(stage.STAGE.torch(**inputs), stage.STAGE.naive(**inputs), atol, rtol, str(dtype))


def rope_inputs(num_tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    """q, k as `split_qkv` gives them: strided views into one [T, (H + 2*Hkv) * d] tensor."""
    qkv = randn(num_tokens, (heads + 2 * kv_heads) * head_dim, seed=num_tokens).to(dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.view(num_tokens, heads, head_dim)  # [T, H*d] -> [T, H, d] (strided)
    k = k.view(num_tokens, kv_heads, head_dim)  # [T, Hkv*d] -> [T, Hkv, d]
    positions = torch.randint(0, 200, (num_tokens,), generator=torch.Generator().manual_seed(7))
    return positions, q, k, build_cos_sin_cache(256, head_dim, 10000.0)


@pytest.mark.parametrize("num_tokens", ROWS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(5, 1, 6), (9, 3, 64), (3, 3, 10)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_torch_tier_matches_naive_bit_for_bit(num_tokens, heads, kv_heads, head_dim, dtype):
    """The same formula term by term (x1*cos - x2*sin, x2*cos + x1*sin in float32): equal bits."""
    positions, q, k, cache = rope_inputs(num_tokens, heads, kv_heads, head_dim, dtype)
    q_before, k_before = q.clone(), k.clone()
    ref_q, ref_k = rope.naive(positions, q, k, cache)
    out_q, out_k = rope.STAGE.torch(positions, q, k, cache)
    assert out_q.dtype == dtype and out_k.dtype == dtype
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)
    assert torch.equal(q, q_before) and torch.equal(k, k_before)  # new tensors, inputs untouched
    i32 = rope.STAGE.torch(positions.to(torch.int32), q, k, cache)
    assert torch.equal(i32[0], ref_q) and torch.equal(i32[1], ref_k)


@pytest.mark.parametrize("name", [n for n, s in STAGES.items() if s.torch is not None])
@pytest.mark.parametrize("num_tokens", [1, 13])
def test_registry_torch_tier_on_example_inputs(name, num_tokens):
    """Each stage with a torch tier: its example inputs through both tiers, the same outputs."""
    stage = STAGES[name]
    cfg = PRESETS["tiny"]

    def run(tier):
        inputs = stage.example_inputs(cfg, num_tokens, torch.device("cpu"), torch.float32)
        result = stage.tier(tier)(**inputs)
        if not stage.outputs:  # a stage that writes in place (kv_store): compare what it wrote
            return tuple(t for t in inputs.values() if isinstance(t, torch.Tensor))
        return result if isinstance(result, tuple) else (result,)

    ref, out = run("naive"), run("torch")
    assert len(out) == len(ref)
    atol, rtol = TOLERANCES[torch.float32]
    for o, r in zip(out, ref):
        assert_close(o, r, atol, rtol, f"{name} torch vs naive")


def test_torch_falls_back_to_naive_where_a_stage_has_no_torch_tier():
    has = {n for n, s in STAGES.items() if s.torch is not None}
    assert {"qkv_proj", "o_proj", "ffn", "lm_head", "rope"} <= has
    for name, stage in STAGES.items():
        assert stage.tier_that_runs("torch") == ("torch" if name in has else "naive")


def test_the_triton_tier_answers_to_its_older_name():
    """`optimized` (the Triton tier's name before the rename) stays an alias for one release."""
    for stage in STAGES.values():
        assert stage.optimized is stage.triton and stage.optimized_kind == stage.triton_kind
        assert stage.tier("optimized") is stage.triton and stage.tier_that_runs("optimized") == "triton"
