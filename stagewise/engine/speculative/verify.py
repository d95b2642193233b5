"""The verify step: from the target's logits at every guessed position to the tokens kept.

A speculating request b ran 1 + k_b query tokens this step — its last real
token t, then its guesses x_1 .. x_k — and the LM head ran on all of them, so
its logits rows are

    row 0: the target's next token after t         (p_0, checks x_1)
    row i: the next token after x_1 .. x_i         (p_i, checks x_{i+1})
    row k: the "bonus" position after every guess  (p_k)

    logits [sum_b (1 + k_b), vocab]  ->  target_probs [num_draft + num_seqs, vocab]

Each row is turned into the distribution plain sampling would draw from at
that position (`stages.sampling.processed_probs`, with the row's own state:
its repetition penalty sees the guesses before the row, as if they had been
sampled). The rejection sampler stage (`stages/rejection_sampling.py`) then
keeps the longest run of guesses the target agrees with and adds one token of
the target's own: between 1 and k_b + 1 tokens per request per step.

Randomness (`randomness.py`): every random number is tied to the output
position of the token it decides — row i of request b decides output token
t = len(output) + i, with its own noise E_t and uniform v_t — never to a
stream consumed step by step. For point-mass guesses the
uniforms are coupled to the target's own draw y_t = argmax p_t / E_t, so the
tokens kept are y_t, y_t+1, ... whatever was guessed: a seeded request writes
the same text alone or batched, even when the token budget or the KV blocks
cut its guesses. Every guess that comes without q rows (n-gram, greedy, a
draft model with acceptance "coupled") is checked so. A draft's guesses with
q rows (acceptance "rejection") are checked by the textbook min(1, p / q),
with the same per-position numbers, uniforms independent of the noise.
"""

import torch

from stagewise.engine.logprobs import note_logprobs
from stagewise.engine.request import Request
from stagewise.engine.speculative import randomness
from stagewise.models.ops import StageOps
from stagewise.sampling_params import SamplingTensors
from stagewise.stages import rejection_sampling
from stagewise.stages.sampling import processed_probs


def _row_seen(requests: list[Request], vocab: int) -> torch.Tensor:
    """[rows, vocab] bool: what the repetition penalty sees at each verify row (host)."""
    rows = []
    for req in requests:
        seen = req.seen_mask(vocab).clone()  # [V]: prompt + output so far
        rows.append(seen.clone())
        for x in req.spec_token_ids:  # row i also sees the guesses before it
            seen[x] = True
            rows.append(seen.clone())
    return torch.stack(rows)  # [rows, V]


def _randomness(
    requests: list[Request], target_probs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """uniform [num_draft] and exponential [num_draft + num_seqs, vocab]: a row per target row.

    Row i of a request: the noise of output position len(output) + i; its guess's uniform the
    same position's. Point-mass guesses (no q rows) get coupled uniforms: u < p(x) exactly when
    x is the target's own race winner at that position."""
    vocab, device = target_probs.shape[-1], target_probs.device
    uniform, exponential, row = [], [], 0
    for req in requests:
        k, first = len(req.spec_token_ids), len(req.output_token_ids)
        if req.params.greedy:  # greedy rows take argmaxes: no randomness (fixed, harmless values)
            uniform.append(torch.zeros(k, device=device))
            exponential.append(torch.ones(k + 1, vocab, device=device))
            row += k + 1
            continue
        positions = list(range(first, first + k + 1))  # output index each row decides
        noise = randomness.exponentials(req.seed, positions, vocab, device)  # [k + 1, V]
        v = randomness.uniforms(req.seed, positions[:k], device)  # [k]
        if k and req.spec_probs is None:  # point masses: couple (randomness.py)
            p = target_probs[row : row + k]  # [k, V]: the rows that check a guess
            x = torch.tensor(req.spec_token_ids, device=device)  # [k]
            winner = randomness.race_rows(p, noise[:k])  # [k]: the target's own draws y_t
            p_x = p.gather(1, x[:, None])[:, 0]  # [k]
            v = randomness.coupled_uniforms(p_x, winner == x, v)
        uniform.append(v)
        exponential.append(noise)
        row += k + 1
    return torch.cat(uniform), torch.cat(exponential)


def _draft_probs(requests: list[Request], vocab: int, device) -> torch.Tensor | None:
    """[num_draft, vocab] q rows, or None when every guess is a point mass (n-gram)."""
    if all(req.spec_probs is None for req in requests):
        return None
    rows = []
    for req in requests:
        if not req.spec_token_ids:
            continue
        if req.spec_probs is not None:
            rows.append(req.spec_probs.to(device=device, dtype=torch.float32))  # [k, V]
        else:  # a point mass written out: q = 1 at the guess
            ids = torch.tensor(req.spec_token_ids, device=device)
            rows.append(torch.nn.functional.one_hot(ids, vocab).float())  # [k, V]
    return torch.cat(rows) if rows else torch.zeros(0, vocab, device=device)


def verify(ops: StageOps, logits: torch.Tensor, requests: list[Request]) -> list[list[int]]:
    """logits [sum_b (1 + k_b), vocab] -> the tokens each request keeps (1 .. k_b + 1 each).

    Guesses without q rows (n-gram, greedy, a coupled draft) are checked as point masses with
    coupled uniforms; guesses with q rows (a draft with acceptance "rejection") by min(1, p/q)
    with independent ones."""
    vocab = logits.shape[-1]
    if logits.is_meta:  # a shape-only model: all-zero logits (greedy picks token 0)
        logits = torch.zeros(logits.shape, dtype=torch.float32)
    device = logits.device
    params, offsets, seeds = [], [], []
    for req in requests:
        for i in range(1 + len(req.spec_token_ids)):  # one row per verified position
            params.append(req.params)
            offsets.append(len(req.output_token_ids) + i)
            seeds.append(req.seed)
    if any(r.params.repetition_penalty != 1.0 for r in requests):
        seen = _row_seen(requests, vocab)  # [rows, V]
    else:
        seen = torch.zeros(len(params), vocab, dtype=torch.bool, device=device)
    sampling = SamplingTensors.from_params(params, seen, offsets, seeds, device)
    target_probs = processed_probs(logits, sampling)  # [rows, V] float32
    drafts = [x for req in requests for x in req.spec_token_ids]
    cu = [0]
    for req in requests:
        cu.append(cu[-1] + len(req.spec_token_ids))
    uniform, exponential = _randomness(requests, target_probs)
    max_k = max((len(r.spec_token_ids) for r in requests), default=0)
    tokens, counts = ops(
        rejection_sampling,
        draft_token_ids=torch.tensor(drafts, dtype=torch.int64, device=device),  # [num_draft]
        cu_num_draft_tokens=torch.tensor(cu, dtype=torch.int32, device=device),  # [num_seqs + 1]
        draft_probs=_draft_probs(requests, vocab, device),  # [num_draft, V] or None
        target_probs=target_probs,  # [num_draft + num_seqs, V]
        is_greedy=torch.tensor([r.params.greedy for r in requests], device=device),  # [num_seqs]
        uniform=uniform,  # [num_draft]
        exponential=exponential,  # [num_draft + num_seqs, V]: a row per target row
        max_num_draft_tokens=max_k,  # known on the host: the launcher reads nothing back
    )  # -> [num_seqs, max_k + 1], [num_seqs]
    # the step's one device -> host read: the kept tokens, with their counts in front
    table = torch.cat([counts.to(torch.int64)[:, None], tokens], dim=1).tolist()
    kept = [row[1 : 1 + row[0]] for row in table]
    if any(r.params.logprobs is not None for r in requests):  # SamplingParams(logprobs=k)
        rows = [1 + len(r.spec_token_ids) for r in requests]  # row i decided kept token i
        note_logprobs(logits, requests, rows, kept)
    return kept
