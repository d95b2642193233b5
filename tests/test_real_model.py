"""SmolLM2-135M-Instruct (the real GGUF) against Hugging Face transformers on the same file."""

import pytest
import torch

from stagewise import LLM, SamplingParams
from stagewise.models.forward_batch import ForwardBatch, NoKVCache
from stagewise.models.llama import LlamaModel
from stagewise.models.ops import StageOps

pytestmark = [pytest.mark.model, pytest.mark.oracle]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 5, 8, 13,",
]


def test_full_model_logits_match_transformers(smollm, hf_smollm):
    model = LlamaModel(smollm, StageOps("naive"))
    ids = [smollm.tokenizer.encode(p) for p in PROMPTS]
    batch = ForwardBatch.from_sequences(ids, [0] * len(ids), "cpu")
    batch.last_token_index = torch.arange(batch.num_tokens)  # every position's logits
    ours = model.forward(batch, NoKVCache(batch.cu_seqlens_q))
    start, worst = 0, 0.0
    for seq in ids:
        with torch.no_grad():
            ref = hf_smollm(torch.tensor([seq])).logits[0]
        diff = (ours[start : start + len(seq)] - ref).abs().max().item()
        worst = max(worst, diff)
        assert torch.equal(ours[start : start + len(seq)].argmax(-1), ref.argmax(-1))
        start += len(seq)
    print(f"\nmax |logits - transformers| over {batch.num_tokens} positions: {worst:.3g}")
    assert worst < 1e-3


@pytest.mark.parametrize("mode", ["kv", "naive"])
def test_greedy_32_tokens_identical_to_transformers_generate(smollm, hf_smollm, mode):
    llm = LLM(smollm, mode=mode)
    prompts = PROMPTS[:3] if mode == "kv" else PROMPTS[:1]  # naive recompute is slow: one prompt
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0))
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([smollm.tokenizer.encode(prompt)])
        with torch.no_grad():
            ref = hf_smollm.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1] :].tolist()
        assert out.token_ids == ref, f"{prompt!r}: ours {out.text!r} vs transformers {smollm.tokenizer.decode(ref)!r}"


def test_chat_answer_names_paris(smollm):
    out = LLM(smollm).generate(
        "What is the capital of France?", SamplingParams(max_tokens=24, temperature=0), chat=True
    )
    assert "Paris" in out[0].text, out[0].text
    assert out[0].finish_reason == "stop"  # it ends with <|im_end|> well before 24 tokens
