"""A GGUF kept quantized: loaded packed, bit for bit the file's values, the same tokens in every
mode and tier as the model dequantized to float32 (`quantization="none"`).

The tiny checkpoint (tests/checkpoints.py) stores its projections as Q4_1 or Q4_0 and its tied
embedding as Q8_0, the layout of SmolLM2's file.
"""

import gguf
import pytest
import torch

from stagewise.engine.llm import LLM
from stagewise.errors import StagewiseError
from stagewise.models.registry import load_model
from stagewise.quant.dequantize import dequantize
from stagewise.quant.packed_weight import is_packed
from stagewise.sampling_params import SamplingParams
from tests.checkpoints import hf_tiny_model, write_gguf

PROMPTS = ["hello world", "the cat sat on"]
GREEDY = SamplingParams(max_tokens=6, temperature=0)


@pytest.fixture(scope="module", params=["Q4_1", "Q4_0"])
def tiny_q4(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("q") / f"tiny-{request.param}.gguf"
    qtype = gguf.GGMLQuantizationType[request.param]
    return write_gguf(path, hf_tiny_model(seed=3), projection_type=qtype)


def test_kept_packed_with_the_files_values(tiny_q4):
    packed = load_model(str(tiny_q4), device="cpu", quantization="auto")
    floats = load_model(str(tiny_q4), device="cpu", quantization="none")
    pw, fw = packed.weights, floats.weights
    assert is_packed(pw.embed) and pw.embed.kind == "q8_0" and pw.tied() and pw.lm_head is pw.embed
    for lp, lf in zip(pw.layers, fw.layers):
        for name in ("w_qkv", "w_o", "w_gate_up", "w_down"):
            assert is_packed(getattr(lp, name)), name
            assert torch.equal(dequantize(getattr(lp, name)), getattr(lf, name)), name
    assert torch.equal(dequantize(pw.lm_head), fw.lm_head)
    assert pw.num_bytes() < fw.num_bytes() / 4  # ~0.6 bytes per projection weight, not 4
    assert not any(is_packed(t) for t in [fw.embed, *vars(fw.layers[0]).values()])


@pytest.mark.parametrize("mode", ["naive", "kv", "paged"])
def test_same_greedy_tokens_as_the_dequantized_model(tiny_q4, mode):
    """naive tier: exact same numbers as float32 (the same x @ w); torch tier: bf16 rounding."""
    ref = LLM(str(tiny_q4), backend="naive", mode=mode, device="cpu", quantization="none")
    ref_tokens = [o.token_ids for o in ref.generate(PROMPTS, GREEDY)]
    for backend in ("naive", "torch"):
        llm = LLM(str(tiny_q4), backend=backend, mode=mode, device="cpu", quantization="auto")
        assert "q4" in llm.describe()["weights"]
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == ref_tokens, backend


def test_triton_tier_same_tokens_as_naive(tiny_q4):
    if tiny_q4.name.endswith("Q4_0.gguf"):
        pytest.skip("the triton tier is checked on Q4_1 here (interpreter time); kernels: both")
    naive = LLM(str(tiny_q4), backend="naive", mode="kv", device="cpu", quantization="auto")
    triton = LLM(str(tiny_q4), backend="triton", mode="kv", device="cpu", quantization="auto")
    params = SamplingParams(max_tokens=3, temperature=0)
    assert triton.generate(PROMPTS[0], params)[0].token_ids == naive.generate(PROMPTS[0], params)[0].token_ids


def test_unknown_quantization_is_one_line(tiny_q4):
    with pytest.raises(StagewiseError, match="unknown quantization 'int3'"):
        load_model(str(tiny_q4), device="cpu", quantization="int3")


def test_llm_keeps_a_gguf_packed_by_default_and_load_model_does_not(tiny_q4):
    """`LLM(path)` (and every command) defaults to quantization="auto"; `load_model` to "none"."""
    assert is_packed(LLM(str(tiny_q4), device="cpu").loaded.weights.layers[0].w_qkv)
    assert not is_packed(load_model(str(tiny_q4), device="cpu").weights.layers[0].w_qkv)
