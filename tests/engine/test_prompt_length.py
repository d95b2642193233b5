"""A prompt that cannot fit in max_model_len is refused before the tokenizer reads all of it: a 300 MB
prompt used to spend minutes in the tokenizer before the length check."""

import time

import pytest

from stagewise import LLM, SamplingParams
from stagewise.config import EngineConfig
from stagewise.engine.prompts import longest_token_bytes
from stagewise.errors import StagewiseError

ONE = SamplingParams(max_tokens=1, temperature=0.0)


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny, mode="kv", engine_config=EngineConfig(max_model_len=256))


@pytest.mark.parametrize("chat", [False, True], ids=["raw", "chat"])
def test_a_huge_prompt_is_refused_at_once(llm, chat):
    prompt = "The quick brown fox. " * 3_000_000  # 63 MB
    start = time.perf_counter()
    with pytest.raises(StagewiseError, match=r"^the prompt is 63,000,000 bytes: more than max_model_len=256"):
        llm.generate([prompt], ONE, chat=chat)
    assert time.perf_counter() - start < 1.0  # ~0.2 s here; tokenizing it all took minutes


def test_the_byte_bound_is_the_longest_token(llm):
    """Tiny's longest token is 13 bytes: 256 tokens cover at most 3328 bytes."""
    assert longest_token_bytes(llm.tokenizer) == 13
    with pytest.raises(StagewiseError, match="3,329 bytes"):
        llm.make_request("x" * 3329, ONE)


def test_below_the_byte_bound_tokenizing_stops_at_the_limit(llm):
    """Within the bound, the count decides: runs between control tokens are counted as they are tokenized."""
    prompt = "zq" * 1500  # 3000 bytes, ~1500+ tokens (no merges for this pair)
    with pytest.raises(StagewiseError, match=r"^the prompt has \d+\+ tokens, more than max_model_len=256"):
        llm.make_request(prompt, ONE, chat=True)


def test_a_prompt_that_fits_still_runs(llm):
    (out,) = llm.generate(["Hello there"], ONE)
    assert len(out.token_ids) == 1
