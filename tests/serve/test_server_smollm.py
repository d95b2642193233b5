"""`stagewise serve` on the real SmolLM2-135M-Instruct through the `openai` client: a chat answer
that means something (the capital of France), streamed and whole alike, and seeded sampling through
the chat template giving exactly `LLM.generate`'s tokens."""

import openai
import pytest

from stagewise.engine.llm import LLM
from stagewise.sampling_params import SamplingParams
from tests.serve.harness import running_server

pytestmark = pytest.mark.model
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def served(smollm):
    with running_server(LLM(smollm)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        yield server, client


def test_chat_answers_paris_streamed_and_whole(served):
    server, client = served
    name = server.state.model_name
    whole = client.chat.completions.create(model=name, messages=QUESTION, max_tokens=12, temperature=0)
    assert "Paris" in whole.choices[0].message.content
    chunks = client.chat.completions.create(model=name, messages=QUESTION, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content


def test_seeded_chat_sampling_equals_generate(served, smollm):
    server, client = served
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=7)
    ref = LLM(smollm).generate([QUESTION], params, chat=True)[0]
    out = client.chat.completions.create(
        model=server.state.model_name, messages=QUESTION, max_tokens=16, temperature=0.8, top_p=0.95, seed=7
    )
    assert out.choices[0].message.content == ref.text
    assert out.usage.completion_tokens == len(ref.token_ids)
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
