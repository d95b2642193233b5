"""Each naive stage against the matching Hugging Face transformers computation (float32)."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama import modeling_llama as hf

from stagewise.config import PRESETS
from stagewise.stages import STAGES, attention, embedding, ffn, lm_head, qkv_proj, rmsnorm, rope
from stagewise.stages.attention_metadata import AttentionMetadata
from tests.helpers import assert_close

CFG = PRESETS["tiny"]
ATOL, RTOL = 2e-5, 2e-5


def hf_config(num_heads=6, num_kv_heads=2, head_dim=16) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=CFG.vocab_size,
        hidden_size=num_heads * head_dim,
        intermediate_size=CFG.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        rope_theta=CFG.rope_theta,
        rms_norm_eps=CFG.rms_norm_eps,
        max_position_embeddings=CFG.max_position_embeddings,
        attn_implementation="eager",
    )


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_embedding_matches_hf_embed_tokens():
    table = torch.nn.Embedding(CFG.vocab_size, CFG.hidden_size)
    ids = torch.tensor([5, 0, 511, 5, 17, 300, 2])
    with torch.no_grad():
        assert_close(embedding.naive(ids, table.weight), table(ids), 0, 0, "embedding")


@pytest.mark.parametrize("num_tokens", [1, 7, 33])
def test_rmsnorm_matches_hf(num_tokens):
    norm = hf.LlamaRMSNorm(CFG.hidden_size, eps=CFG.rms_norm_eps)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * randn(CFG.hidden_size, seed=1))
        x, res = randn(num_tokens, CFG.hidden_size, seed=2), randn(num_tokens, CFG.hidden_size, seed=3)
        out, new_res = rmsnorm.naive(x, norm.weight, CFG.rms_norm_eps, residual=res)
        assert_close(new_res, x + res, 0, 0, "residual add")
        assert_close(out, norm(x + res), ATOL, RTOL, "rmsnorm")
        out_plain, same = rmsnorm.naive(x, norm.weight, CFG.rms_norm_eps)
        assert same is x
        assert_close(out_plain, norm(x), ATOL, RTOL, "rmsnorm without residual")


def test_rope_matches_hf_rotary_embedding():
    cfg = hf_config()
    rotary = hf.LlamaRotaryEmbedding(cfg)
    positions = torch.tensor([0, 1, 2, 7, 100, 1023, 5])
    q, k = randn(7, 6, 16, seed=4), randn(7, 2, 16, seed=5)
    cache = rope.build_cos_sin_cache(CFG.max_position_embeddings, 16, CFG.rope_theta)
    q_out, k_out = rope.naive(positions, q, k, cache)
    cos, sin = rotary(q, positions[None])  # [1, T, d]
    # HF works on [batch, heads, T, d]
    q_ref, k_ref = hf.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    assert_close(q_out, q_ref[0].transpose(0, 1), ATOL, RTOL, "rope q")
    assert_close(k_out, k_ref[0].transpose(0, 1), ATOL, RTOL, "rope k")
    # the torch tier (q and k rotated as one tensor): the same rotation, bit for bit
    q_fast, k_fast = rope.STAGE.torch(positions, q, k, cache)
    assert torch.equal(q_fast, q_out) and torch.equal(k_fast, k_out)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(6, 2, 16), (4, 4, 32), (8, 2, 16), (9, 3, 64)])
def test_qkv_rope_attention_o_proj_match_hf_llama_attention(num_heads, num_kv_heads, head_dim):
    """Our qkv_proj -> rope -> attention -> o_proj chain equals HF's LlamaAttention (eager) per sequence."""
    cfg = hf_config(num_heads, num_kv_heads, head_dim)
    torch.manual_seed(0)
    layer = hf.LlamaAttention(cfg, layer_idx=0).eval()
    rotary = hf.LlamaRotaryEmbedding(cfg)
    hidden = cfg.hidden_size
    w_qkv = torch.cat([layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight], 0).t().contiguous()
    w_o = layer.o_proj.weight.t().contiguous()
    lens = [5, 1, 11]  # three sequences packed in one flattened batch
    x = randn(sum(lens), hidden, seed=6)
    positions = torch.cat([torch.arange(n) for n in lens])
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    config = CFG.__class__(
        name="t",
        vocab_size=16,
        hidden_size=hidden,
        intermediate_size=8,
        num_layers=1,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
    )
    with torch.no_grad():
        qkv = qkv_proj.naive(x, w_qkv)
        q, k, v = qkv_proj.split_qkv(qkv, config)
        cache = rope.build_cos_sin_cache(64, head_dim, cfg.rope_parameters["rope_theta"])
        q, k = rope.naive(positions, q, k, cache)
        o = attention.naive(q, k, v, AttentionMetadata.over_batch(cu), head_dim**-0.5)
        ours = o.reshape(sum(lens), -1) @ w_o
        start = 0
        for n in lens:
            xb = x[start : start + n][None]
            pos = torch.arange(n)[None]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            ref, _ = layer(xb, rotary(xb, pos), attention_mask=mask)
            assert_close(ours[start : start + n], ref[0], 5e-5, 5e-5, f"attention block, seq of {n}")
            start += n


def test_attention_worked_example_by_hand():
    """Two tokens, one head, d=2: token 1 attends to both with weights softmax([q.k0, q.k1]/sqrt(2))."""
    q = torch.tensor([[[1.0, 0.0]], [[0.0, 2.0]]])  # [T=2, H=1, d=2]
    k = torch.tensor([[[1.0, 1.0]], [[0.0, 1.0]]])
    v = torch.tensor([[[10.0, 0.0]], [[0.0, 10.0]]])
    cu = torch.tensor([0, 2], dtype=torch.int32)
    out = attention.naive(q, k, v, AttentionMetadata.over_batch(cu), scale=2**-0.5)
    assert_close(out[0, 0], torch.tensor([10.0, 0.0]), 1e-6, 0, "token 0 sees only itself")
    s0, s1 = 2.0 * 2**-0.5, 2.0 * 2**-0.5  # q1.k0 = 2, q1.k1 = 2 -> equal weights
    w = torch.softmax(torch.tensor([s0, s1]), 0)
    assert_close(out[1, 0], w[0] * v[0, 0] + w[1] * v[1, 0], 1e-6, 0, "token 1")
    assert_close(out[1, 0], torch.tensor([5.0, 5.0]), 1e-5, 0, "token 1 by hand")


def test_attention_bottom_right_causal_and_empty_rows():
    """3 queries on 2 keys: the first query sees nothing (zeros), the others see a causal prefix."""
    q, k, v = randn(3, 2, 4, seed=7), randn(2, 1, 4, seed=8), randn(2, 1, 4, seed=9)
    out = attention.naive(q, k, v, AttentionMetadata.build([3], [2], "cpu", k_starts=[0, 2]), scale=0.5)
    assert torch.equal(out[0], torch.zeros(2, 4))
    assert_close(out[1], v[0].expand(2, 4), 1e-6, 0, "second query sees key 0 only")
    # seq_lens: keys beyond a sequence's length are ignored even if present (a cache's spare slots)
    k2, v2 = torch.cat([k, randn(5, 1, 4, seed=10)]), torch.cat([v, randn(5, 1, 4, seed=11)])
    out2 = attention.naive(q, k2, v2, AttentionMetadata.build([3], [2], "cpu", k_starts=[0, 7]), 0.5)
    assert_close(out2, out, 0, 0, "seq_lens")


@pytest.mark.parametrize("num_tokens", [1, 7])
def test_ffn_matches_hf_mlp(num_tokens):
    cfg = hf_config()
    torch.manual_seed(1)
    mlp = hf.LlamaMLP(cfg).eval()
    w_gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], 0).t().contiguous()
    w_down = mlp.down_proj.weight.t().contiguous()
    x = randn(num_tokens, cfg.hidden_size, seed=12)
    with torch.no_grad():
        assert_close(ffn.naive(x, w_gate_up, w_down), mlp(x), ATOL, RTOL, "ffn")


def test_silu_and_mul_worked_example():
    gate_up = torch.tensor([[0.0, 1.0, 2.0, 3.0]])  # gate [0, 1], up [2, 3]
    silu1 = 1.0 / (1.0 + torch.exp(torch.tensor(-1.0)))  # silu(1) = 1 * sigmoid(1)
    assert_close(ffn.silu_and_mul_naive(gate_up), torch.tensor([[0.0, 3.0 * silu1]]), 1e-6, 0, "silu_and_mul")


def test_lm_head_only_last_tokens_match_full_gemm():
    head = torch.nn.Linear(CFG.hidden_size, CFG.vocab_size, bias=False)
    h = randn(10, CFG.hidden_size, seed=13)
    last = torch.tensor([3, 4, 9])
    with torch.no_grad():
        assert_close(lm_head.naive(h, last, head.weight.t().contiguous()), head(h)[last], ATOL, RTOL, "lm_head")


def test_rope_worked_example_quarter_turn():
    """With one frequency pair and angle pi/2 at position 1, (x1, x2) -> (-x2, x1)."""
    cache = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # row p: [cos, sin]; p=0 identity, p=1 quarter turn
    q = torch.tensor([[[3.0, 4.0]], [[3.0, 4.0]]])
    q_out, _ = rope.naive(torch.tensor([0, 1]), q, q.clone(), cache)
    assert_close(q_out, torch.tensor([[[3.0, 4.0]], [[-4.0, 3.0]]]), 1e-6, 0, "rope by hand")


def test_rmsnorm_worked_example():
    x = torch.tensor([[3.0, 4.0]])  # mean square 12.5
    out, _ = rmsnorm.naive(x, torch.tensor([1.0, 2.0]), eps=0.0)
    r = 12.5**0.5
    assert_close(out, torch.tensor([[3.0 / r, 8.0 / r]]), 1e-6, 0, "rmsnorm by hand")


def test_kv_store_worked_example():
    k = torch.tensor([[[1.0]], [[2.0]], [[3.0]]])
    cache_k, cache_v = torch.zeros(5, 1, 1), torch.zeros(5, 1, 1)
    STAGES["kv_store"].naive(k, -k, cache_k, cache_v, AttentionMetadata.build([3], [3], "cpu", slot_mapping=[4, -1, 0]))
    assert cache_k.flatten().tolist() == [3.0, 0.0, 0.0, 0.0, 1.0]
    assert cache_v.flatten().tolist() == [-3.0, 0.0, 0.0, 0.0, -1.0]


@pytest.mark.parametrize("name", [n for n in STAGES if n not in ("tokenize", "sampling")])
@pytest.mark.parametrize("num_tokens", [1, 7, 33])
def test_every_stage_runs_on_its_example_inputs(name, num_tokens):
    """The registry contract: example_inputs feed every tier; same signature, finite outputs."""
    stage = STAGES[name]
    for path in (stage.naive, stage.tier("torch"), stage.triton):
        inputs = stage.example_inputs(CFG, num_tokens, torch.device("cpu"), torch.float32)
        result = path(**inputs)
        outs = result if isinstance(result, tuple) else (result,)
        if stage.outputs:
            assert len(outs) == len(stage.outputs)
            assert all(torch.isfinite(o.float()).all() for o in outs)
