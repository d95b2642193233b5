"""The perplexity function and greedy agreement (`stagewise.bench.commands.perplexity`), on the tiny model.

What the real SmolLM2 file gives (and the 1% target) is the benchmark's result, not a test: here
the function itself is checked. A model with a zero LM head guesses uniformly, so its perplexity
is exactly the vocabulary size; the target of position i is token i+1 (a greedy continuation is
each position's most likely token, so replacing one raises that position's loss); and packed
weights expanded by the naive tier give the float32 model's numbers bit for bit.
"""

import math

import pytest
import torch

from stagewise.bench.commands.perplexity import greedy_agreement, greedy_tokens, perplexity, token_nll
from stagewise.bench.harness.english_text import SOURCE, TEXT
from stagewise.errors import StagewiseError
from stagewise.models.registry import load_model
from stagewise.quant.dequantize import dequantize
from stagewise.quant.quantize import quantize

PROJECTIONS = ("w_qkv", "w_o", "w_gate_up", "w_down")


def test_a_uniform_model_scores_the_vocabulary_size():
    loaded = load_model("tiny", device="cpu")
    loaded.weights.lm_head.zero_()  # every logit 0: each of the V tokens has probability 1 / V
    ids = loaded.tokenizer.encode("the cat sat on the mat and looked at the door")
    assert math.isclose(perplexity(loaded, "naive", ids), loaded.config.vocab_size, rel_tol=1e-12)
    with pytest.raises(StagewiseError, match="at least 2 tokens"):
        perplexity(loaded, "naive", ids[:1])


def test_position_i_is_scored_on_token_i_plus_1(tiny):
    prompt = tiny.tokenizer.encode("once upon a time")
    generated = greedy_tokens(tiny, "naive", ["once upon a time"], 4)[0]
    ids = prompt + generated
    nll = token_nll(tiny, "naive", ids)  # [n-1]
    assert nll.shape == (len(ids) - 1,)
    for j in range(len(prompt), len(ids)):  # each greedy token is its position's argmax
        other = list(ids)
        other[j] = (ids[j] + 1) % tiny.config.vocab_size
        assert token_nll(tiny, "naive", other)[j - 1] > nll[j - 1]
    # causal: later tokens change nothing before them (up to the GEMMs' rounding at another length)
    torch.testing.assert_close(token_nll(tiny, "naive", ids[:5]), nll[:4], rtol=1e-5, atol=1e-5)


def test_packed_naive_equals_float32_and_greedy_agrees():
    packed, floats = load_model("tiny", device="cpu"), load_model("tiny", device="cpu")
    for lp, lf in zip(packed.weights.layers, floats.weights.layers):
        for name in PROJECTIONS:
            setattr(lp, name, quantize(getattr(lp, name), "q4_1"))
            setattr(lf, name, dequantize(getattr(lp, name)))  # the same numbers, as float32
    ids = floats.tokenizer.encode(TEXT)[:48]
    assert perplexity(packed, "naive", ids) == perplexity(floats, "naive", ids)
    assert greedy_agreement(floats, packed, "naive", ["hello world", "the cat"], 5) == [5, 5]
    assert "Pride and Prejudice" in SOURCE and "public domain" in SOURCE


def test_torch_stock_builds_pytorchs_forms_and_the_opt_in_kernel_the_integer_dot_ones(tmp_path, int8_kernels):
    """`--backends torch-stock`: the same torch tier, its packed weights in PyTorch's int4pack form."""
    import gguf

    from stagewise.bench.commands.perplexity import STOCK, load_stock, tier_of
    from stagewise.cpu import int8_dot
    from stagewise.quant.packed_parts import packed_leaves
    from tests.checkpoints import hf_tiny_model, write_gguf

    path = write_gguf(
        tmp_path / "tiny-q4_1.gguf", hf_tiny_model(seed=5), projection_type=gguf.GGMLQuantizationType.Q4_1
    )
    stock = load_stock(str(path))
    forms = [w.prepared["torch"] for w in packed_leaves(stock.weights.layers[0].w_qkv)]
    assert forms and all(len(f) == 2 for f in forms), "int4pack: packed codes and scale_zero"
    assert tier_of(STOCK) == "torch" and tier_of("naive") == "naive"
    ids = stock.tokenizer.encode(TEXT)[:24]
    if int8_dot.available():  # the default torch tier holds the rows8 form, and gives other bits
        default = load_model(str(path), device="cpu", quantization="auto")
        assert perplexity(default, "torch", ids) != perplexity(stock, "torch", ids)
        assert len(default.weights.layers[0].w_qkv.prepared["torch"]) == 1
