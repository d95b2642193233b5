"""The triton tier is batch-invariant end to end: the `tiny` model in the CPU interpreter.

The same comparisons as tests/engine/test_batch_invariance.py, on `LLM(backend="triton")`, with
every step's log-probabilities (`SamplingParams(logprobs=k)`) compared bit for bit: a prompt alone
and in a batch whose prefill crosses the 16-row decode tile, its prompt cut into chunks, a decode
step against the last row of a prefill of its prefix, and the kv (FlashAttention) and paged modes.
The interpreter's `tl.dot` is numpy's BLAS, not row-invariant by itself, so these run under a
fixed-order dot (tests/kernels/fixed_order_dot.py): what they test is the kernels' design. The
negative control: `batch_invariant=False` must part a batched prompt from the prompt alone.
"""

import pytest
import torch

from stagewise import LLM
from stagewise.config import EngineConfig
from tests.engine.test_batch_invariance import assert_same, greedy, run_ids, same_bits
from tests.kernels.fixed_order_dot import fixed_order_dot  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("fixed_order_dot")

TARGET = "the cat sat on the mat and then"  # 13 tokens: alone, one 16-row tile
OTHERS = ["a b c d e f g h i j k l m n o p q r s t u", "7 ! of"]  # together with it: 60 rows


def test_a_prompt_alone_batched_or_chunked_gives_the_same_logits(tiny):
    llm = LLM(tiny, backend="triton")
    ref = llm.generate([TARGET], greedy(4))[0]
    batched = llm.generate([OTHERS[0], TARGET, OTHERS[1]], greedy(4))[1]
    assert_same(batched, ref, "at slot 1 of 3")
    chunked = LLM(tiny, backend="triton", engine_config=EngineConfig(max_num_batched_tokens=5))
    assert_same(chunked.generate([TARGET], greedy(4))[0], ref, "chunks of 5")


def test_a_decode_step_equals_the_last_row_of_a_prefill_of_its_prefix(tiny):
    llm = LLM(tiny, backend="triton")
    prompt = llm.encode(TARGET)
    (run,) = run_ids(llm, [prompt], greedy(4))
    for i, out in zip((1, 3), run_ids(llm, [prompt + run.token_ids[:1], prompt + run.token_ids[:3]], greedy(1))):
        assert torch.equal(out.logprobs.values[0], run.logprobs.values[i]), f"step {i}"
        assert torch.equal(out.logprobs.sampled[0], run.logprobs.sampled[i])


def test_kv_and_paged_modes_give_the_same_logits(tiny):
    """kv: FlashAttention over a contiguous cache, static batches; paged: paged attention."""
    prompts, params = [TARGET, OTHERS[1]], [greedy(4), greedy(3)]
    kv = LLM(tiny, backend="triton", mode="kv").generate(prompts, params)
    paged = LLM(tiny, backend="triton").generate(prompts, params)
    for i in range(len(prompts)):
        assert_same(kv[i], paged[i], f"kv vs paged, request {i}")


def test_without_batch_invariance_the_batch_changes_the_logits(tiny):
    """The negative control: alone, the prompt's 13 rows run the decode GEMM; batched to 60 rows,
    the prefill tiles, which add each row's K steps in another order."""
    llm = LLM(tiny, backend="triton", batch_invariant=False)
    ref = llm.generate([TARGET], greedy(4))[0]
    batched = llm.generate([OTHERS[0], TARGET, OTHERS[1]], greedy(4))[1]
    assert not same_bits(batched, ref), "batch_invariant=False changed no logit: the tests above prove nothing"
