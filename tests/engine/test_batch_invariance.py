"""A request's logits do not depend on who else is in the batch (the project's design notes, "Batch invariance").

End to end, through the public handle `SamplingParams(logprobs=k)`: every output token's top-k
log-probabilities and the drawn token's — the raw float32 log-softmax of the step's logits — are
compared with `torch.equal`, as vLLM's batch-invariance suite does. The scenarios: a prompt alone
and at a random slot among random prompts; batch 1 against batch 32; chunked prefill at budgets 1,
7, 13 and the default; preemption and recompute; prefix-cache hits; a decode step against the last
row of a prefill of the same prefix; speculative verify rows (n-gram and a draft model) against
plain decoding; the naive, kv and paged modes. On the torch tier with tiny irregular shapes (G = 3
and G = 4; prompt lengths not multiples of 64), float32 and packed (the int4 kernel, the bfloat16
weight copies); SmolLM2 in tests marked `model`. The negative control runs the same comparisons
with `batch_invariant=False` and must find a difference, or the prompts are not sensitive enough.
"""

import random
from dataclasses import replace

import pytest
import torch

from stagewise import LLM, SamplingParams
from stagewise.config import PRESETS, EngineConfig
from stagewise.engine.outputs import RequestOutput
from stagewise.models.quantize_at_load import quantize_weights
from stagewise.models.registry import LoadedModel
from stagewise.models.weights import random_weights
from stagewise.tokenizer import Tokenizer

TOP_K = 8
WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "ran", "far", "away", "quickly", "7", "!", "of"]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=TOP_K, **kw)


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def same_bits(a: RequestOutput, b: RequestOutput) -> bool:
    """The same tokens and, at every step, the same log-probabilities, bit for bit."""
    la, lb = a.logprobs, b.logprobs
    return (
        a.token_ids == b.token_ids
        and torch.equal(la.token_ids, lb.token_ids)
        and torch.equal(la.values, lb.values)
        and torch.equal(la.sampled, lb.sampled)
    )


def first_difference(a: RequestOutput, b: RequestOutput) -> str:
    for i, (x, y) in enumerate(zip(a.logprobs.values, b.logprobs.values)):
        if not torch.equal(x, y):
            return f"step {i}: max |diff| {(x - y).abs().max().item():.3g}"
    return f"tokens {a.token_ids} vs {b.token_ids}"


def assert_same(a: RequestOutput, b: RequestOutput, what: str) -> None:
    assert same_bits(a, b), f"{what}: {first_difference(a, b)}"


def g4_model(vocab: int = 520) -> LoadedModel:
    """G = 4 query heads per KV head (8 / 2), head_dim 12, a 520-token vocabulary (N % 16 = 8)."""
    cfg = replace(PRESETS["tiny"], name="tiny-g4", num_heads=8, num_kv_heads=2, head_dim=12, vocab_size=vocab)
    weights = random_weights(cfg, seed=3)
    return LoadedModel(cfg, weights, Tokenizer.synthetic(vocab), "tiny G=4", torch.device("cpu"), torch.float32)


def packed(loaded: LoadedModel, scheme: str) -> LoadedModel:
    """The same model with its projections packed (int4: q4_1, int8: q8_0) and the table q8_0."""
    weights = quantize_weights(loaded.weights, scheme, loaded.config.name)
    return replace(loaded, weights=weights, source=f"{loaded.source}, {scheme}")


@pytest.fixture(scope="module")
def models(tiny):
    """G = 3 (the tiny preset) and G = 4, float32 and packed: the int4 kernel for G = 3's int4; for
    G = 4's int8 a q8_0 table of 520 columns, which the int4 kernel cannot take (a bfloat16 copy)."""
    g4 = g4_model()
    return {"g3": tiny, "g4": g4, "g3-int4": packed(tiny, "int4"), "g4-int8": packed(g4, "int8")}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny shapes on one torch thread (a second one mostly waits); 2 threads are swept per op in
    tests/stages/test_batch_invariance_ops.py. Restored after the module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def alone(llm: LLM, prompt: str, params: SamplingParams) -> RequestOutput:
    return llm.generate([prompt], params)[0]


@pytest.mark.parametrize("name", ["g3", "g4", "g3-int4", "g4-int8"])
def test_a_prompt_alone_equals_it_at_a_random_slot_among_random_prompts(models, name):
    rng = random.Random(name)
    llm = LLM(models[name])
    target = words(rng, 75)  # 75 words: past one 64-key chunk
    ref = alone(llm, target, greedy(12))
    for trial in range(2):
        others = [words(rng, rng.randrange(1, 90)) for _ in range(rng.randrange(3, 8))]
        slot = rng.randrange(len(others) + 1)
        prompts = others[:slot] + [target] + others[slot:]
        params = [greedy(rng.randrange(4, 16)) for _ in others[:slot]] + [greedy(12)]
        params += [greedy(rng.randrange(4, 16)) for _ in others[slot:]]
        out = llm.generate(prompts, params)[slot]
        assert_same(out, ref, f"{name}: at slot {slot} of {len(prompts)} (trial {trial})")


def test_batch_of_one_equals_batch_of_32(models):
    rng = random.Random(32)
    llm = LLM(models["g3-int4"], engine_config=EngineConfig(max_num_seqs=32))
    prompts = [words(rng, rng.randrange(1, 40)) for _ in range(32)]
    together = llm.generate(prompts, greedy(5))
    for i in sorted(rng.sample(range(32), 5)):  # five of them, each run alone
        assert_same(together[i], alone(llm, prompts[i], greedy(5)), f"request {i} of 32")


@pytest.mark.parametrize("budget", [1, 7, 13, None])
def test_chunked_prefill_at_any_budget_equals_the_prompt_alone(models, budget):
    """The prompt cut into chunks of `budget` tokens (None: the default budget and the CPU's 64-token
    cap beside decodes), beside other requests decoding."""
    rng = random.Random(budget or 0)
    llm = LLM(models["g3-int4"])
    prompts = [words(rng, 40), words(rng, 3), words(rng, 25)]  # ~75, ~5, ~45 tokens
    refs = [alone(llm, p, greedy(6)) for p in prompts]
    ecfg = EngineConfig() if budget is None else EngineConfig(max_num_batched_tokens=budget, max_num_seqs=3)
    chunked = LLM(models["g3-int4"], engine_config=ecfg)
    chunked.add_request(words(rng, 80), greedy(3))  # decoding while the others' prompts arrive
    chunked.step()
    for i, (out, ref) in enumerate(zip(chunked.generate(prompts, greedy(6)), refs)):
        assert_same(out, ref, f"budget {budget}, request {i}")


def test_preemption_and_recompute_give_the_same_logits(models):
    loaded = models["g4"]
    cfg = loaded.config
    block_bytes = 16 * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    ecfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=24, kv_cache_bytes=10 * block_bytes)
    rng = random.Random(5)
    prompts = [words(rng, n) for n in (40, 3, 25, 60, 9)]
    params = [greedy(m) for m in (20, 30, 12, 8, 25)]
    llm = LLM(loaded, engine_config=ecfg)
    outs = llm.generate(prompts, params)
    assert llm.last_stats.preemptions > 0, "the KV budget was meant to force preemption"
    plain = LLM(loaded)
    for i, (prompt, p, out) in enumerate(zip(prompts, params, outs)):
        assert_same(out, alone(plain, prompt, p), f"request {i} after preemption")


def test_prefix_cache_hits_give_the_same_logits(models):
    rng = random.Random(6)
    shared = words(rng, 50)  # ~90 tokens: several 16-token blocks, reused from the cache
    prompts = [shared + " " + words(rng, n) for n in (2, 9, 30)]
    llm = LLM(models["g3"], engine_config=EngineConfig(enable_prefix_caching=True))
    nocache = LLM(models["g3"], engine_config=EngineConfig(enable_prefix_caching=False))
    llm.generate([shared], greedy(2))  # fills the cache
    for i, prompt in enumerate(prompts):
        out = alone(llm, prompt, greedy(6))
        assert_same(out, alone(nocache, prompt, greedy(6)), f"prompt {i} on a cached prefix")
    assert llm.last_stats.prefix_hit_tokens > 0


def run_ids(llm: LLM, id_lists: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
    """Requests from token ids (a prompt and generated tokens need not round-trip through text)."""
    requests = []
    for ids in id_lists:
        req = llm.make_request("x", params)
        req.prompt_token_ids = list(ids)
        requests.append(req)
    for _ in llm._stream_requests(requests):
        pass
    return [RequestOutput.of(r) for r in requests]


@pytest.mark.parametrize("mode", ["paged", "kv", "naive"])
def test_a_decode_step_equals_the_last_row_of_a_prefill_of_its_prefix(models, mode):
    """Step i of a run (a decode row) against a fresh prompt of the prompt and the first i tokens
    (its last prefill row): the same logits."""
    llm = LLM(models["g4"], mode=mode)
    prompt = llm.encode(words(random.Random(7), 40))
    (run,) = run_ids(llm, [prompt], greedy(10))
    prefixes = [prompt + run.token_ids[:i] for i in (1, 4, 9)]
    for i, out in zip((1, 4, 9), run_ids(llm, prefixes, greedy(1))):
        assert out.token_ids[0] == run.token_ids[i]
        assert torch.equal(out.logprobs.values[0], run.logprobs.values[i]), f"{mode}: step {i}"
        assert torch.equal(out.logprobs.sampled[0], run.logprobs.sampled[i])


def assert_modes_agree(loaded: LoadedModel) -> None:
    """naive (recompute), kv (static batches, left padding) and paged: one batch, the same bits."""
    rng = random.Random(8)
    prompts = [words(rng, n) for n in (5, 66, 1, 30)]
    params = [greedy(m) for m in (9, 4, 12, 7)]
    outs = {mode: LLM(loaded, mode=mode).generate(prompts, params) for mode in ("naive", "kv", "paged")}
    for i in range(len(prompts)):
        assert_same(outs["kv"][i], outs["paged"][i], f"kv vs paged, request {i}")
        assert_same(outs["naive"][i], outs["paged"][i], f"naive vs paged, request {i}")


def test_the_modes_give_the_same_logits(models):
    assert_modes_agree(models["g3-int4"])


COPY = "the cat sat on the mat and then the cat sat on the mat and then the cat sat on the"


@pytest.mark.parametrize("k", [1, 3, 8])
def test_ngram_verify_rows_equal_plain_decode_rows(models, k):
    """n-gram speculation: each kept token's logits come from a row verified among k + 1."""
    plain = LLM(models["g3-int4"])
    spec = LLM(models["g3-int4"], speculative_config=f"ngram:{k}")
    prompts = [COPY, words(random.Random(k), 30) + " " + COPY]
    outs = spec.generate(prompts, greedy(24))
    assert spec.last_stats.spec_draft_tokens > 0, "no guess was verified"
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert_same(out, alone(plain, prompt, greedy(24)), f"ngram:{k}, prompt {i}")


def test_draft_model_verify_rows_equal_plain_decode_rows(tmp_path):
    from tests.engine.spec_models import target_and_draft

    target, draft = target_and_draft(tmp_path)
    plain = LLM(target)
    spec = LLM(target, speculative_config=f"draft:{draft}:3")
    prompts = ["the cat sat on the mat", words(random.Random(9), 20)]
    outs = spec.generate(prompts, greedy(16))
    assert spec.last_stats.spec_draft_tokens > 0
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert_same(out, alone(plain, prompt, greedy(16)), f"draft, prompt {i}")


def test_seeded_sampling_draws_the_same_tokens_alone_and_batched(models):
    """Per-request random streams: a request's draws depend on its seed, never on its neighbours."""
    rng = random.Random(10)
    llm = LLM(models["g3-int4"])
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=42, ignore_eos=True, logprobs=2)
    target = words(rng, 20)
    ref = alone(llm, target, params)
    others = [words(rng, n) for n in (4, 50, 12)]
    out = llm.generate(others[:2] + [target] + others[2:], [greedy(5)] * 2 + [params] + [greedy(5)])[2]
    assert_same(out, ref, "seeded sampling at slot 2")


# ---- the negative control: without invariance the same comparisons see a difference ----


def test_without_batch_invariance_the_sweep_finds_a_difference(models):
    """`batch_invariant=False`: a prompt alone against the same prompt batched, chunked, decoded vs
    prefilled. If none of these differ the prompts are not sensitive enough to test anything."""
    found = []
    for name in ("g3", "g3-int4"):
        llm = LLM(models[name], batch_invariant=False)
        rng = random.Random(11)
        target = words(rng, 75)
        ref = alone(llm, target, greedy(12))
        batched = llm.generate([words(rng, 40), target, words(rng, 9)], greedy(12))[1]
        found.append(not same_bits(batched, ref))
        chunked = LLM(models[name], batch_invariant=False, engine_config=EngineConfig(max_num_batched_tokens=7))
        found.append(not same_bits(alone(chunked, target, greedy(12)), ref))
    assert any(found), "batch_invariant=False changed no logit: the invariance tests would prove nothing"
    assert LLM(models["g3"], batch_invariant=False).describe()["batch_invariant"] is False


@pytest.mark.parametrize(
    ("value", "message"),
    [(-1, "logprobs must be None or an int >= 0, got -1"), (2.5, "got 2.5"), (True, "got True")],
)
def test_bad_logprobs_are_one_line(value, message):
    from stagewise import StagewiseError

    with pytest.raises(StagewiseError, match=message):
        SamplingParams(logprobs=value)


def test_logprobs_records_are_a_distributions_top_k(models):
    """Greedy: the drawn token is the most likely, its log-probability the first of k, in order."""
    from stagewise.engine.logprobs import Logprobs

    llm = LLM(models["g3"], mode="naive")
    out = alone(llm, "the cat sat", greedy(1))
    assert isinstance(out.logprobs, Logprobs) and out.logprobs.values.dtype == torch.float32
    values, ids = out.logprobs.values[0], out.logprobs.token_ids[0]
    assert ids[0] == out.token_ids[0] and torch.equal(out.logprobs.sampled[0], values[0])  # greedy
    assert (values[:-1] >= values[1:]).all() and values.shape == (TOP_K,)
    assert torch.logsumexp(values, 0) < 0  # a part of a distribution
    assert out.logprobs.as_dicts(out.token_ids)[0][out.token_ids[0]] == values[0].item()
    assert alone(llm, "the cat sat", SamplingParams(max_tokens=1)).logprobs is None  # not asked
    with pytest.raises(Exception, match="logprobs=513 is more than the vocabulary"):
        alone(llm, "the cat sat", SamplingParams(logprobs=513))


def test_batch_invariant_must_be_a_bool(models):
    from stagewise import StagewiseError

    with pytest.raises(StagewiseError, match="batch_invariant must be True or False, got 'no'"):
        LLM(models["g3"], batch_invariant="no")


# ---- SmolLM2: a few short runs, float32 and packed (the default) ----


@pytest.fixture(scope="module")
def smollm_packed():
    return LLM("smollm2-135m")  # quantization="auto": the GGUF's Q4_1 / Q8_0 blocks stay packed


SMOL_PROMPTS = [
    "The capital of France is",
    "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived",
]


@pytest.mark.model
@pytest.mark.parametrize("weights", ["float32", "packed"])
def test_smollm2_alone_equals_batched_and_chunked(smollm, smollm_packed, weights):
    llm = smollm_packed if weights == "packed" else LLM(smollm)
    prompts = SMOL_PROMPTS if weights == "packed" else SMOL_PROMPTS[:2]
    refs = [alone(llm, p, greedy(6)) for p in prompts]
    tight = LLM(llm.loaded, engine_config=EngineConfig(max_num_batched_tokens=7, max_num_seqs=4))
    for i, (out, ref) in enumerate(zip(tight.generate(prompts, greedy(6)), refs)):
        assert_same(out, ref, f"{weights}: prompt {i} batched, chunks of 7")


@pytest.mark.model
def test_smollm2_packed_ngram_verify_equals_plain(smollm_packed):
    spec = LLM(smollm_packed.loaded, speculative_config="ngram:4")
    prompt = SMOL_PROMPTS[1]
    out = spec.generate([prompt], greedy(16))[0]
    assert spec.last_stats.spec_draft_tokens > 0
    assert_same(out, alone(smollm_packed, prompt, greedy(16)), "SmolLM2 packed, ngram:4")
