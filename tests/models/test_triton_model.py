"""The whole model with Triton kernels (CPU interpreter here) against the naive PyTorch stages."""

import pytest
import torch

from stagewise import LLM, SamplingParams
from stagewise.config import EngineConfig
from stagewise.kv.none import NoKVCache
from stagewise.models.forward_batch import ForwardBatch
from stagewise.models.llama import LlamaModel
from stagewise.models.ops import StageOps
from stagewise.stages import STAGES
from tests.helpers import assert_close

PROMPTS = ["Hello there, how are you?", "A", "The quick brown fox jumps over the lazy dog again"]


@pytest.mark.parametrize("mode", ["paged", "kv", "naive"])
def test_tiny_naive_torch_triton_greedy_tokens_equal(tiny, mode):
    """The three tiers, every stage at once: the same greedy tokens in every mode."""
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ecfg = EngineConfig(max_num_batched_tokens=16)  # paged: chunked prefill through the Triton kernels too
    tokens = {}
    for tier in ("naive", "torch", "triton"):
        llm = LLM(tiny, backend=tier, mode=mode, engine_config=ecfg)
        assert llm.describe()["backend"] == tier
        tokens[tier] = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert tokens["torch"] == tokens["naive"], "torch tier"
    assert tokens["triton"] == tokens["naive"], "triton tier"


def test_default_tier_is_torch_and_says_which_stages_run_it(tiny):
    llm = LLM(tiny)
    assert llm.describe()["backend"] == "torch"
    assert llm.ops.tier("qkv_proj") == "torch" and llm.ops.tier("embedding") == "naive"  # no torch tier
    tiers = llm.describe()["tiers"]
    assert tiers.startswith("naive: tokenize, embedding, sampling") and "torch: rmsnorm, qkv_proj, rope" in tiers


def test_tiny_triton_every_stage_is_a_kernel(tiny):
    llm = LLM(tiny, backend="triton")
    assert set(llm.ops.backends.values()) == {"triton"}
    for name, stage in STAGES.items():
        if name != "tokenize":  # its triton tier is the Rust tokenizers library
            assert stage.triton_kind.startswith("triton"), name


def test_per_stage_override(tiny):
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    mixed = LLM(tiny, backend="triton", stage_backends={"paged_attention": "naive", "sampling": "naive"})
    assert mixed.ops.backends["paged_attention"] == "naive" and mixed.ops.backends["ffn"] == "triton"
    ref = LLM(tiny).generate(PROMPTS, params)
    assert [o.token_ids for o in mixed.generate(PROMPTS, params)] == [o.token_ids for o in ref]


@pytest.mark.model
def test_real_model_triton_prefill_logits_match_naive():
    """SmolLM2's next-token logits after a short prompt, every stage a Triton kernel (interpreter).

    Float weights (quantization="none"): the packed model's fused dequantize-GEMM takes the
    interpreter over 8 minutes here; tests/kernels/test_dequant_matmul.py checks it on tiny shapes.
    """
    from stagewise.models.registry import load_model

    smollm = load_model("smollm2-135m", quantization="none")
    ids = smollm.tokenizer.encode("The capital of France is")
    batch = ForwardBatch.from_sequences([ids], [0], "cpu")
    naive = LlamaModel(smollm, StageOps("naive")).forward(batch, NoKVCache(batch.cu_seqlens_q))
    triton = LlamaModel(smollm, StageOps("triton")).forward(batch, NoKVCache(batch.cu_seqlens_q))
    assert_close(triton, naive, 2e-3, 2e-3, "real model, triton vs naive logits")
    assert torch.equal(triton.argmax(-1), naive.argmax(-1))
