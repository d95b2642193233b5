"""`logprobs` through the server: OpenAI's two shapes, filled from the engine's own float32 records.

The numbers must be the ones `LLM.generate(..., SamplingParams(logprobs=k))` gives for the request
alone, bit for bit, also when the request shares the engine with others: batch invariance seen from
the client (the project's design notes, "Batch invariance"). One server (tiny model) for the module.
"""

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from stagewise.engine.llm import LLM
from stagewise.sampling_params import SamplingParams
from tests.serve.harness import running_server

PROMPT = "The quick brown fox"
OTHERS = ["Once upon a time", "1 2 3 4 5 6", "Paris is the capital of", "def main():"]


@pytest.fixture(scope="module")
def server(tiny):
    with running_server(LLM(tiny)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def alone(tiny):
    """The request's records from a second LLM over the same weights, run alone."""
    llm = LLM(tiny)

    def run(prompt: str, k: int, chat: bool, max_tokens: int = 6):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=k)
        return llm.generate([prompt], params, chat=chat)[0]

    return run


def test_completion_logprobs_are_the_engines_records(client, alone):
    ref = alone(PROMPT, 3, chat=False)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert lp.token_logprobs == ref.logprobs.sampled.tolist()
    for top, values in zip(lp.top_logprobs, ref.logprobs.values.tolist()):  # {text: logprob}, the likeliest first
        assert list(top.values())[0] == values[0] and set(top.values()) <= set(values)
    assert len(lp.tokens) == len(lp.text_offset) == 6 and lp.text_offset[0] == 0


def test_chat_logprobs_name_each_token_and_its_top_k(client, alone, tiny):
    ref = alone(PROMPT, 2, chat=True)
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = out.choices[0].logprobs.content
    vocab = tiny.tokenizer
    assert [bytes(e.bytes) for e in content] == [vocab.bytes_of([t]) for t in ref.token_ids]
    assert [e.logprob for e in content] == ref.logprobs.sampled.tolist()
    assert [[t.logprob for t in e.top_logprobs] for e in content] == ref.logprobs.values.tolist()
    tops = [[bytes(t.bytes) for t in e.top_logprobs] for e in content]
    assert tops == [[vocab.bytes_of([t]) for t in row] for row in ref.logprobs.token_ids.tolist()]


def test_streamed_logprobs_are_the_whole_answers(client):
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=6, temperature=0)
    whole = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=1).choices[0].logprobs.content
    chunks = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=1, stream=True)
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in whole]


def test_a_request_among_others_gets_the_bits_it_gets_alone(client, alone):
    ref = alone(PROMPT, 4, chat=False, max_tokens=8)

    def ask(prompt: str):
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, logprobs=4)

    with ThreadPoolExecutor(len(OTHERS) + 1) as pool:
        outs = list(pool.map(ask, OTHERS[:2] + [PROMPT] + OTHERS[2:]))
    assert outs[2].choices[0].logprobs.token_logprobs == ref.logprobs.sampled.tolist()


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs", "[0, 20]"),
        ("/v1/completions", {"prompt": "hi", "logprobs": "3"}, "logprobs", "int"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs", "needs 'logprobs': true"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs", "[0, 20]"),
        ("/v1/chat/completions", {"logprobs": 1}, "logprobs", "bool"),
    ],
)
def test_bad_logprobs_are_a_400_naming_the_field(server, path, body, param, message):
    if path.endswith("chat/completions"):
        body = {"messages": [{"role": "user", "content": "hi"}], **body}
    r = httpx.post(server.url + path, json={"max_tokens": 1, **body}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_each_of_n_samples_carries_its_own_logprobs(client):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=1.0, seed=3, n=2, logprobs=1)
    assert len(out.choices) == 2
    for choice in out.choices:
        assert len(choice.logprobs.token_logprobs) == 5 and "".join(choice.logprobs.tokens) == choice.text
