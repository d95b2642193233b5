"""`n` through the official `openai` client: n choices, each the sample `LLM.generate` gives (sample i
seeded seed + i), whole and streamed, chat and completions; the prompt counted once in the usage;
n out of [1, 16] or n samples that could not fit the KV cache refused naming `n`; no block left."""

import httpx
import openai
import pytest

from stagewise.config import EngineConfig
from stagewise.engine.llm import LLM
from stagewise.sampling_params import MAX_SAMPLES, SamplingParams
from tests.serve.harness import running_server

PROMPT = "The quick brown fox"
ENGINE = EngineConfig(num_kv_blocks=40, block_size=16, max_model_len=256, prefix_cache="radix")


@pytest.fixture(scope="module")
def server(tiny):
    with running_server(LLM(tiny, engine_config=ENGINE)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(tiny):
    return LLM(tiny, engine_config=ENGINE)


def no_block_held(server) -> bool:
    """Every sample left: no request holds a block, and once the radix tree lets go of what it
    keeps for later requests, every block is free."""
    if not server.engine_idle_of_requests():
        return False
    llm = server.state.llm
    with llm._lock:  # the engine thread steps under it
        bm = llm.engine.block_manager
        bm.prefixes.evict(bm.num_blocks)
        return bm.num_free_blocks == bm.num_blocks


SAMPLED = dict(max_tokens=10, temperature=1.0, top_p=0.95, seed=77)


def test_completion_n_choices_are_generate_samples(server, client, reference):
    ref = reference.generate([PROMPT], SamplingParams(n=3, **SAMPLED))[0].samples
    out = client.completions.create(model="tiny", prompt=PROMPT, n=3, **SAMPLED)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [s.text for s in ref]
    assert len({c.text for c in out.choices}) > 1, "each sample draws from its own stream"
    assert out.usage.prompt_tokens == len(ref[0].prompt_token_ids)  # once, not n times
    assert out.usage.completion_tokens == sum(len(s.token_ids) for s in ref)
    assert no_block_held(server), "every sample's blocks went back"


def test_streamed_chat_n_choices_interleave_by_index(server, client, reference):
    messages = [{"role": "user", "content": "Say something"}]
    ref = reference.generate([messages], SamplingParams(n=2, **SAMPLED), chat=True)[0].samples
    stream = client.chat.completions.create(
        model="tiny", messages=messages, n=2, stream=True, stream_options={"include_usage": True}, **SAMPLED
    )
    texts, reasons, usage = {0: "", 1: ""}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    assert [texts[0], texts[1]] == [s.text for s in ref]
    assert reasons == {0: ref[0].finish_reason, 1: ref[1].finish_reason}
    assert usage.prompt_tokens == len(ref[0].prompt_token_ids)
    assert usage.completion_tokens == sum(len(s.token_ids) for s in ref)
    assert no_block_held(server)


@pytest.mark.parametrize("n", [0, MAX_SAMPLES + 1, True, 2.5])
def test_n_out_of_range_is_refused_naming_n(server, n):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "n": n}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text


def test_n_samples_that_cannot_fit_the_kv_cache_are_refused(server, client):
    # one sample of the prompt + 200 tokens needs 13 of the 40 blocks; four could need 52
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt=PROMPT, n=4, max_tokens=200, temperature=0)
    assert err.value.body["param"] == "n" and "n=4" in err.value.body["message"]
    out = client.completions.create(model="tiny", prompt=PROMPT, n=3, max_tokens=4, temperature=0)
    assert len({c.text for c in out.choices}) == 1, "greedy samples agree"
    assert no_block_held(server)
