"""Speculative sampling leaves the output distribution exactly the target's: a chi-square test.

Rejection sampling accepts a guess x with probability min(1, p(x) / q(x)) and
otherwise draws from normalise(max(0, p - q)); the token that comes out is then
distributed exactly as p, whatever the proposer's q. Here that is tested on the
engine end to end, for both proposers:

- the model: the tiny architecture with an 8-letter vocabulary, so the joint
  law of two tokens has only 64 cells and a few thousand draws fill them;
- the draft: the target cut to its first layer, so q differs from p (the
  n-gram proposer's point mass alone never exercises min(1, p / q) with q < 1),
  with acceptance "rejection" (its q rows checked by min(1, p / q)); the n-gram
  runs the default coupled acceptance (engine/speculative/randomness.py);
- the sampling rules: temperature 1, top-k 6 (q may propose what p excludes),
  repetition penalty 1.2 (each verify row sees the guesses before it);
- the draws: 2000 requests with distinct seeds per proposer (1000 without
  speculation), max_tokens = k + 2 with k = 2; block size 4, so the prompt's
  first block is a prefix-cache hit and each prefill is one token.
  Token 1 comes from the prefill (no verification); tokens 2 and 3 went through
  the first verify step, token 4 through what followed it.

The reference is the exact law of plain sampling, computed by enumerating
every path (t1, t2, t3) of the target with the same `processed_probs`. Tests:
the joint law of (t2, t3), and the law of t4, against it, by Pearson's
chi-square (cells whose expected count is under 5 pooled into one); a cell of
probability 0 must stay empty. Each comparison has a false-alarm rate of
ALPHA = 1e-3 (a correct engine fails it with that probability over the choice
of seeds; the seeds are fixed, so a pass stays a pass); the test makes 6 of
them, so at most 0.6% of seed choices would fail a correct engine. The plain
engine is sampled too, against the same law ("with and without speculation
agree"): a wrong reference would fail there.

What it catches (bugs put in by hand; 2000 draws with other seeds): a rejection that redraws
from p instead of max(0, p - q): p = 2e-30 (draft), 3e-7 (n-gram); q rows
returned without the top-k and penalty the draft token was drawn with:
p = 3e-6; accept tests 20% too lenient (u * 0.8): p = 3e-4 (draft). Not caught
at this size: a penalty that ignores the guesses before a verify row
(penalty 1.2 moves these laws too little). Ignoring q altogether (every guess
treated as a point mass) is no bug: that rule is exact for any guess, it only
accepts less.
"""

import itertools

import pytest
import torch

from stagewise import LLM, SamplingParams
from stagewise.config import EngineConfig
from stagewise.kv.none import NoKVCache
from stagewise.models.forward_batch import ForwardBatch
from stagewise.models.registry import load_model
from stagewise.sampling_params import SamplingTensors
from stagewise.stages.sampling import processed_probs
from tests.engine.spec_models import LETTERS, one_thread, target_and_draft  # noqa: F401

ALPHA = 1e-3  # false-alarm rate of each chi-square comparison
K = 2  # guesses per verify step
NUM_DRAWS = {"plain": 1000, "ngram": 2000, "draft_model": 2000}  # seeded requests per run
PROMPT = "abcab"
PARAMS = dict(max_tokens=K + 2, temperature=1.0, top_k=6, repetition_penalty=1.2, ignore_eos=True)
ENGINE = EngineConfig(max_num_seqs=256, max_num_batched_tokens=4096, block_size=4)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target, draft = target_and_draft(tmp_path_factory.mktemp("spec_dist"), tokenizer=LETTERS)
    return load_model(target, dtype=torch.float32), draft


def next_token_probs(llm: LLM, prefixes: list[list[int]]) -> torch.Tensor:
    """[len(prefixes), vocab]: the law plain sampling draws the next token of each prefix from."""
    batch = ForwardBatch.from_sequences(prefixes, [0] * len(prefixes), torch.device("cpu"))
    logits = llm.model.forward(batch, NoKVCache.of(batch))  # [B, vocab]
    vocab = logits.shape[-1]
    seen = torch.zeros(len(prefixes), vocab, dtype=torch.bool)
    for row, prefix in enumerate(prefixes):
        seen[row, prefix] = True  # prompt and output so far: what the penalty sees
    params = [SamplingParams(**PARAMS)] * len(prefixes)
    sampling = SamplingTensors.from_params(params, seen, [0] * len(prefixes), [0] * len(prefixes), "cpu")
    return processed_probs(logits, sampling)  # [B, vocab] float64 below


def exact_laws(llm: LLM) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact laws of (t2, t3) [V, V] and of t4 [V] under plain sampling, by enumeration."""
    prompt = llm.encode(PROMPT)
    vocab = llm.config.vocab_size
    p1 = next_token_probs(llm, [prompt])[0].double()  # [V]
    pairs = list(itertools.product(range(vocab), repeat=2))
    triples = list(itertools.product(range(vocab), repeat=3))
    p2 = next_token_probs(llm, [prompt + [a] for a in range(vocab)]).double()  # [V(t1), V(t2)]
    p3 = next_token_probs(llm, [prompt + list(ab) for ab in pairs]).double().view(vocab, vocab, vocab)
    p4 = next_token_probs(llm, [prompt + list(t) for t in triples]).double().view(vocab, vocab, vocab, vocab)
    joint3 = p1[:, None, None] * p2[:, :, None] * p3  # P(t1, t2, t3)
    law_23 = joint3.sum(dim=0)  # [V, V]
    law_4 = (joint3[..., None] * p4).sum(dim=(0, 1, 2))  # [V]
    return law_23, law_4


def chi_square_p_value(observed: torch.Tensor, probs: torch.Tensor, what: str) -> float:
    """Pearson's test of counts against a law; cells expected under 5 are pooled into one."""
    observed, probs = observed.flatten().double(), probs.flatten()
    n = observed.sum()
    impossible = probs <= 1e-12
    assert observed[impossible].sum() == 0, f"{what}: drew an outcome of probability 0"
    expected = n * probs[~impossible] / probs[~impossible].sum()
    observed = observed[~impossible]
    rare = expected < 5
    if rare.any():
        expected = torch.cat([expected[~rare], expected[rare].sum()[None]])
        observed = torch.cat([observed[~rare], observed[rare].sum()[None]])
    statistic = ((observed - expected) ** 2 / expected).sum()
    df = observed.numel() - 1
    # the chi-square survival function: the regularized upper incomplete gamma Q(df/2, x/2)
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), statistic / 2))


def sample(llm: LLM, seeds: range) -> tuple[torch.Tensor, torch.Tensor]:
    """Run one request per seed; -> counts of (t2, t3) [V, V] and of t4 [V]."""
    vocab = llm.config.vocab_size
    params = [SamplingParams(**PARAMS, seed=s) for s in seeds]
    outs = llm.generate([PROMPT] * len(params), params)
    counts_23 = torch.zeros(vocab, vocab)
    counts_4 = torch.zeros(vocab)
    for out in outs:
        t = out.token_ids
        assert len(t) == K + 2
        counts_23[t[1], t[2]] += 1
        counts_4[t[3]] += 1
    return counts_23, counts_4


@pytest.mark.parametrize("method", ["plain", "ngram", "draft_model"])
def test_speculative_sampling_keeps_the_target_distribution(models, method):
    target, draft = models
    spec = {
        "plain": None,
        "ngram": {  # a 1-gram always matches in this prompt: guesses at nearly every step
            "method": "ngram",
            "num_speculative_tokens": K,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 2,
            "adaptive": False,
        },
        "draft_model": {  # the textbook min(1, p / q) with the draft's q rows
            "method": "draft_model",
            "model": draft,
            "num_speculative_tokens": K,
            "acceptance": "rejection",
        },
    }[method]
    llm = LLM(target, engine_config=ENGINE, speculative_config=spec)
    law_23, law_4 = exact_laws(llm)
    offset = {"plain": 0, "ngram": 1, "draft_model": 2}[method] * 10**6  # independent seeds
    counts_23, counts_4 = sample(llm, range(offset, offset + NUM_DRAWS[method]))
    if spec is not None:
        stats = llm.last_stats
        assert stats.spec_draft_tokens > NUM_DRAWS[method] // 2, "meant to guess most steps"
        assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens, "want kept and rejected"
    if method == "draft_model":  # its q is a real distribution (q < 1), not a point mass
        proposer = llm.engine.proposer
        probe = llm.make_request(PROMPT, SamplingParams(**PARAMS, seed=0))
        q = proposer.propose([probe], [K])[0].probs  # [K, vocab]
        proposer.on_removed(probe)
        assert q.shape == (K, 8) and bool((q.amax(dim=-1) < 0.99).all()), q
    p_23 = chi_square_p_value(counts_23, law_23, f"{method}: (t2, t3)")
    p_4 = chi_square_p_value(counts_4, law_4, f"{method}: t4")
    assert p_23 > ALPHA, f"{method}: the joint law of tokens 2..3 differs from the target's (p = {p_23:.2g})"
    assert p_4 > ALPHA, f"{method}: the law of token 4 differs from the target's (p = {p_4:.2g})"
