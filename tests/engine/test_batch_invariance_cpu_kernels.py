"""Batch invariance end to end with the compiled CPU kernels on (STAGEWISE_CPU_KERNELS=1): the
integer-dot GEMM for packed weights (`cpu/int8_dot.py`) and the attention loop (`cpu/attention.py`)
serve every row of every step, so a request's logits, compared bit for bit, are the same alone and
at any slot of a batch, chunked at any budget, decoded or prefilled, verified among k + 1, and in
every mode. Tiny irregular shapes: G = 3 (float32 and q4_1) and G = 4 with head_dim 8 (q8_0)."""

import random
from dataclasses import replace

import pytest
import torch

from stagewise import LLM
from stagewise.config import PRESETS, EngineConfig
from stagewise.cpu import attention as cpu_attention
from stagewise.cpu import build
from stagewise.models.registry import LoadedModel
from stagewise.models.weights import random_weights
from stagewise.tokenizer import Tokenizer
from tests.engine.test_batch_invariance import (
    COPY,
    alone,
    assert_modes_agree,
    assert_same,
    greedy,
    packed,
    run_ids,
    words,
)

pytestmark = [
    pytest.mark.skipif(build.compiler() is None, reason="no C++ compiler: the CPU kernels are not built"),
    pytest.mark.usefixtures("int8_kernels"),
]


@pytest.fixture(scope="module")
def models(tiny):
    cfg = replace(PRESETS["tiny"], name="tiny-g4-d8", num_heads=8, num_kv_heads=2, head_dim=8, vocab_size=520)
    g4 = LoadedModel(
        cfg, random_weights(cfg, seed=4), Tokenizer.synthetic(520), "G=4", torch.device("cpu"), torch.float32
    )
    return {"g3": tiny, "g3-int4": packed(tiny, "int4"), "g4-int8": packed(g4, "int8")}


@pytest.fixture(autouse=True)
def counted(monkeypatch):
    """Counts the compiled attention's calls: each test checks that the kernel really ran."""
    calls = []
    real = cpu_attention.paged

    def paged(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_attention, "paged", paged)
    return calls


@pytest.mark.parametrize("name", ["g3", "g3-int4", "g4-int8"])
def test_alone_equals_any_slot_and_chunked_prefill(models, name, counted):
    rng = random.Random(name)
    llm = LLM(models[name])
    target = words(rng, 75)
    ref = alone(llm, target, greedy(10))
    others = [words(rng, rng.randrange(1, 90)) for _ in range(4)]
    out = llm.generate(others[:2] + [target] + others[2:], greedy(10))[2]
    assert_same(out, ref, f"{name}: at slot 2 of 5")
    chunked = LLM(models[name], engine_config=EngineConfig(max_num_batched_tokens=7, max_num_seqs=3))
    chunked.add_request(words(rng, 30), greedy(3))  # decoding while the target's chunks arrive
    chunked.step()
    assert_same(chunked.generate([target], greedy(10))[0], ref, f"{name}: chunks of 7")
    assert max(counted) > 7 and min(counted) == 1  # prefills, chunks and decode steps all ran it


@pytest.mark.parametrize("mode", ["paged", "kv", "naive"])
def test_a_decode_step_equals_the_last_row_of_a_prefill_of_its_prefix(models, mode, counted):
    llm = LLM(models["g4-int8"], mode=mode)
    prompt = llm.encode(words(random.Random(7), 40))
    (run,) = run_ids(llm, [prompt], greedy(8))
    for i, out in zip((1, 7), run_ids(llm, [prompt + run.token_ids[:i] for i in (1, 7)], greedy(1))):
        assert torch.equal(out.logprobs.values[0], run.logprobs.values[i]), f"{mode}: step {i}"
    assert counted


def test_the_modes_and_ngram_verify_give_the_same_logits(models):
    assert_modes_agree(models["g3-int4"])
    plain, spec = LLM(models["g3-int4"]), LLM(models["g3-int4"], speculative_config="ngram:4")
    out = spec.generate([COPY], greedy(20))[0]
    assert spec.last_stats.spec_draft_tokens > 0
    assert_same(out, alone(plain, COPY, greedy(20)), "ngram:4")


def test_the_kernels_change_the_logits_so_the_comparisons_above_test_them(models, monkeypatch):
    """Off (PyTorch's kernels) and on (the compiled ones) give other bits: the tests above ran the
    compiled path, not the default one."""
    prompt = words(random.Random(3), 40)
    on = alone(LLM(models["g3-int4"]), prompt, greedy(4))
    monkeypatch.setenv(build.ENV_SWITCH, "0")
    kept = alone(LLM(models["g3-int4"]), prompt, greedy(4))  # its weights' forms were built while on
    off = alone(LLM(packed(models["g3"], "int4")), prompt, greedy(4))  # forms built now: PyTorch's
    assert not torch.equal(on.logprobs.values, off.logprobs.values)
    assert (on.logprobs.values - off.logprobs.values).abs().max() < 0.05  # the same model all the same
    assert not torch.equal(kept.logprobs.values, on.logprobs.values)  # the attention is PyTorch's now
