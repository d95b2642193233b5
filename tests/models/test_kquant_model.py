"""A GGUF with K-quant projections, kept packed: the file's values, and the dequantized model's tokens.

The tiny model's rows are 96 or 256 values long; a K-quant block holds 256, so (as llama.cpp does
for rows that do not fit) only ffn_down, whose rows are 256 long, is Q4_K / Q6_K here and the other
projections Q4_1.
"""

import gguf
import pytest
import torch

from stagewise.engine.llm import LLM
from stagewise.kv.none import NoKVCache
from stagewise.models.forward_batch import ForwardBatch
from stagewise.models.llama import LlamaModel
from stagewise.models.ops import StageOps
from stagewise.models.registry import load_model
from stagewise.quant.dequantize import dequantize
from stagewise.quant.packed_weight import is_packed
from stagewise.sampling_params import SamplingParams
from tests.checkpoints import hf_tiny_model, write_gguf

PROMPTS = ["hello world", "the cat sat on"]
GREEDY = SamplingParams(max_tokens=5, temperature=0)


def write_k_gguf(directory, type_name: str):
    k_type, q4_1 = gguf.GGMLQuantizationType[type_name], gguf.GGMLQuantizationType.Q4_1

    def types(name: str):
        return k_type if name.endswith("ffn_down.weight") else q4_1

    path = directory / f"tiny-{type_name}.gguf"
    return write_gguf(path, hf_tiny_model(seed=3), projection_type=types), type_name.lower()


@pytest.fixture(scope="module", params=["Q4_K", "Q6_K"])
def tiny_k(request, tmp_path_factory):
    return write_k_gguf(tmp_path_factory.mktemp("k"), request.param)


def test_kept_packed_with_the_files_values(tiny_k, capsys):
    path, kind = tiny_k
    packed = load_model(str(path), device="cpu", quantization="auto")
    floats = load_model(str(path), device="cpu", quantization="none")
    assert "dequantized at load" not in capsys.readouterr().err  # every type kept: no notice
    for lp, lf in zip(packed.weights.layers, floats.weights.layers):
        assert is_packed(lp.w_down) and lp.w_down.kind == kind
        assert lp.w_gate_up.kind == "q4_1"
        assert torch.equal(dequantize(lp.w_down), lf.w_down)  # bit for bit gguf.quants' numbers


def logits(loaded, tier: str) -> torch.Tensor:
    ids = [[5, 17, 200, 31, 99], [7, 300, 12]]
    batch = ForwardBatch.from_sequences(ids, [0] * len(ids), torch.device("cpu"))
    return LlamaModel(loaded, StageOps(tier)).forward(batch, NoKVCache.of(batch))  # [B, vocab]


def test_logits_of_each_tier_against_the_dequantized_model(tiny_k):
    """naive: the float model's numbers (x @ the same float32 matrix); torch: bfloat16 activations
    and scales (8 significant bits, ~0.4% per rounding): RMS within 2% of the logits' std
    (measured 0.5-0.6%)."""
    path, _ = tiny_k
    ref = logits(load_model(str(path), device="cpu", quantization="none"), "naive")
    packed = load_model(str(path), device="cpu", quantization="auto")
    torch.testing.assert_close(logits(packed, "naive"), ref, rtol=1e-5, atol=1e-5)
    out = logits(packed, "torch")
    assert 0 < (out - ref).pow(2).mean().sqrt() / ref.std() < 0.02


def test_same_greedy_tokens_as_the_dequantized_model(tmp_path):
    """Q4_K (Q4_K_M's main type) through the engine's torch tier (int4pack) against the float32
    model's tokens; the naive tier's numbers equal float32's (the logits test above)."""
    path, _ = write_k_gguf(tmp_path, "Q4_K")
    ref = LLM(str(path), backend="naive", mode="kv", device="cpu", quantization="none")
    llm = LLM(str(path), backend="torch", mode="kv", device="cpu", quantization="auto")
    assert "q4_k" in llm.describe()["weights"]
    want = [o.token_ids for o in ref.generate(PROMPTS, GREEDY)]
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want


def test_a_type_not_kept_is_dequantized_with_one_line(tmp_path, capsys):
    q5_0 = gguf.GGMLQuantizationType.Q5_0
    path = write_gguf(tmp_path / "q5_0.gguf", hf_tiny_model(seed=3), projection_type=q5_0)
    loaded = load_model(str(path), device="cpu", quantization="auto")
    assert not is_packed(loaded.weights.layers[0].w_down)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Q5_0 tensors are dequantized at load" in err[0]
