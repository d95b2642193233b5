"""Rejection sampling: keep the drafts the target model agrees with, then add one token of its own.

Speculative decoding guesses k tokens cheaply (a proposer: an n-gram lookup or a
small draft model), then runs the large target model once over all of them. That
one forward gives the target's distribution p at every guessed position, plus one
more (the "bonus" position after the last guess). This stage decides, per
sequence, how many guesses survive and which one token the target adds:

    draft_token_ids      [num_draft]              int64    every sequence's guesses, concatenated
    cu_num_draft_tokens  [num_seqs + 1]           int32    seq b's guesses: draft_token_ids[cu[b]:
                                                           cu[b+1]], k_b = cu[b+1] - cu[b] (maybe 0)
    draft_probs          [num_draft, vocab]|None  float32  q at each guess; None = a point mass on
                                                           the guessed token (the n-gram proposer)
    target_probs         [num_draft + num_seqs, vocab]     float32 p: seq b owns the k_b + 1 rows
                                                           cu[b] + b .. cu[b+1] + b (last: bonus)
    is_greedy            [num_seqs]               bool
    uniform              [num_draft]              float32  in [0, 1): one accept test per guess
    exponential          [num_seqs, vocab]        float32  Exp(1) noise: each sequence's one draw;
                         or [num_draft + num_seqs, vocab]  one row per target row: the draw at
                                                           a row uses that row's noise
    ->
    output_token_ids     [num_seqs, max_k + 1]    int64    accepted guesses, then the target's
                                                           token; 0 past num_output_tokens[b]
    num_output_tokens    [num_seqs]               int32    accepted + 1, between 1 and k_b + 1

The rule, for draft i = 0, 1, ... of a sequence with guess x_i, target row p_i
and draft row q_i:

- greedy rows: accept x_i while it is the target's argmax (first index on ties).
  At the first mismatch, output argmax p_i and stop. If every guess survives,
  output the argmax of the bonus row. The text is then exactly what plain greedy
  decoding would write, only produced several tokens per target forward.
- sampling rows: accept x_i when u_i < p_i(x_i) / q_i(x_i), written without a
  division as u_i * q_i(x_i) < p_i(x_i). At the first rejection, draw the
  replacement from the residual r = max(0, p_i - q_i) (normalised) and stop; for
  a point mass q that residual is p_i with x_i zeroed. If every guess survives,
  draw the bonus token from the bonus row p_k. (A residual that is zero
  everywhere in floating point, which only happens when p_i is q_i, draws from
  p_i.)

Why the output is distributed exactly as p (the short proof). The draft token
x comes from q. The chance that y comes out of one position is

    P(y) = q(y) * min(1, p(y)/q(y))  +  P(reject) * r(y) / Z
         = min(p(y), q(y))           +  (1 - sum_x min(p(x), q(x))) * max(0, p(y) - q(y)) / Z

and Z = sum_y max(0, p(y) - q(y)) = 1 - sum_x min(p(x), q(x)) (both sides are the
mass where p exceeds q), so the second term is max(0, p(y) - q(y)), and
min(p, q) + max(0, p - q) = p. Once a position is fixed, the next target row is
the target's distribution given that prefix, so by induction the whole run of
tokens is distributed as if the target had sampled them one at a time. The
proposer changes only the speed (how many guesses survive), never the text's law.

The draw itself is an exponential race: with E_j independent Exp(1) draws,
E_j / r_j is Exp(r_j), and the smallest of independent exponential clocks is
clock j with probability r_j / sum(r). So argmax_j r_j / E_j is a draw from r,
and r need not even be normalised. Every input of randomness (uniform,
exponential) is a tensor the caller draws, so the textbook version here and the
fused Triton kernel (`stagewise.kernels.rejection_sampling`) see the same
numbers and must give the same tokens, exactly. The noise comes either as one
row per sequence (used wherever its walk stops) or as one row per target row
(the draw at row i uses row i): then every random number belongs to the
position it decides, which is what lets a caller make a seeded request's text
independent of how many guesses it was given (the engine's coupling,
engine/speculative/randomness.py).

What the Triton version changes: one program per sequence walks that
sequence's guesses on the device (a guess's accept test is one load from p and
q; a greedy guess needs the row's argmax, one pass over the vocabulary), then
makes its one draw in a single pass over the vocabulary in chunks. The counts
are written to device memory and never read back: no host synchronisation.
"""

import torch
from torch import Tensor

from stagewise.config import ModelConfig
from stagewise.errors import StagewiseError
from stagewise.stages.base import Stage


def race(weights: Tensor, exponential: Tensor) -> Tensor:
    """A draw from `weights` (unnormalised, >= 0) by the exponential race: argmax w_j / E_j.

    Entries with zero weight never win (their score is -1, below every positive one's).
    """
    scores = torch.where(weights > 0, weights / exponential, -1.0)  # [V]
    return scores.argmax()  # first index on ties


def residual(p: Tensor, q: Tensor | None, token: int) -> Tensor:
    """max(0, p - q), the part of p the draft under-proposed; q None = a point mass on `token`."""
    if q is None:
        return p.clone().index_fill_(0, torch.tensor([token], device=p.device), 0.0)  # [V]
    return (p - q).clamp(min=0.0)  # [V]


def accept_one_sequence(
    drafts: list[int],
    q_rows: Tensor | None,
    p_rows: Tensor,
    greedy: bool,
    uniform: Tensor,
    exponential: Tensor,
) -> list[int]:
    """The textbook rule for one sequence: accepted drafts, then the target's one token.

    drafts [k], q_rows [k, V] or None, p_rows [k + 1, V], uniform [k], exponential [V] (the
    sequence's one noise row) or [k + 1, V] (a row per target row: the draw at row i uses row i).
    """
    if exponential.dim() == 1:
        exponential = exponential.expand(len(drafts) + 1, -1)  # [k + 1, V]: one row for all
    out: list[int] = []
    for i, x in enumerate(drafts):
        p = p_rows[i]  # [V]
        if greedy:
            target_token = int(p.argmax())
            if x != target_token:
                return out + [target_token]  # the target's choice replaces the first wrong guess
        else:
            q_x = 1.0 if q_rows is None else q_rows[i, x]
            if not bool(uniform[i] * q_x < p[x]):  # rejected: u >= p(x) / q(x)
                r = residual(p, None if q_rows is None else q_rows[i], x)  # [V]
                if not bool((r > 0).any()):  # p == q in floating point: nothing left over
                    r = p
                return out + [int(race(r, exponential[i]))]
        out.append(x)
    bonus = p_rows[len(drafts)]  # [V]: every guess survived; the target adds one more
    k = len(drafts)
    return out + [int(bonus.argmax()) if greedy else int(race(bonus, exponential[k]))]


def check_inputs(
    draft_token_ids: Tensor,
    cu_num_draft_tokens: Tensor,
    draft_probs: Tensor | None,
    target_probs: Tensor,
    is_greedy: Tensor,
    uniform: Tensor,
    exponential: Tensor,
) -> tuple[int, int, int]:
    """Shapes and dtypes, each refused in one line; -> (num_seqs, num_draft, vocab)."""
    name = "rejection_sampling"

    def need(ok: bool, message: str) -> None:
        if not ok:
            raise StagewiseError(f"{name}: {message}")

    for label, t, dtype, ndim in [
        ("draft_token_ids", draft_token_ids, torch.int64, 1),
        ("cu_num_draft_tokens", cu_num_draft_tokens, torch.int32, 1),
        ("target_probs", target_probs, torch.float32, 2),
        ("is_greedy", is_greedy, torch.bool, 1),
        ("uniform", uniform, torch.float32, 1),
        ("exponential", exponential, torch.float32, 2),
    ] + ([("draft_probs", draft_probs, torch.float32, 2)] if draft_probs is not None else []):
        need(t.dtype == dtype, f"{label} has dtype {t.dtype}, expected {dtype}")
        need(t.dim() == ndim, f"{label} must be {ndim}-D, got shape {list(t.shape)}")
    num_seqs, num_draft, vocab = is_greedy.shape[0], draft_token_ids.shape[0], target_probs.shape[1]
    need(
        cu_num_draft_tokens.shape[0] == num_seqs + 1,
        f"cu_num_draft_tokens has {cu_num_draft_tokens.shape[0]} entries, expected num_seqs + 1 = "
        f"{num_seqs + 1}",
    )
    need(
        target_probs.shape[0] == num_draft + num_seqs,
        f"target_probs has {target_probs.shape[0]} rows, expected num_draft + num_seqs = "
        f"{num_draft + num_seqs}",
    )
    need(
        uniform.shape[0] == num_draft,
        f"uniform has {uniform.shape[0]} entries, expected {num_draft}",
    )
    need(
        tuple(exponential.shape) in ((num_seqs, vocab), (num_draft + num_seqs, vocab)),
        f"exponential has shape {list(exponential.shape)}, expected [{num_seqs}, {vocab}] (per "
        f"sequence) or [{num_draft + num_seqs}, {vocab}] (per target row)",
    )
    if draft_probs is not None:
        need(
            tuple(draft_probs.shape) == (num_draft, vocab),
            f"draft_probs has shape {list(draft_probs.shape)}, expected [{num_draft}, {vocab}]",
        )
    return num_seqs, num_draft, vocab


def check_counts(cu: list[int], num_draft: int, max_num_draft_tokens: int | None) -> int:
    """cu must rise from 0 to num_draft; -> max_k (the output is max_k + 1 tokens wide)."""
    counts = [b - a for a, b in zip(cu, cu[1:])]
    if cu[0] != 0 or cu[-1] != num_draft or min(counts, default=0) < 0:
        raise StagewiseError(
            f"rejection_sampling: cu_num_draft_tokens must rise from 0 to num_draft = {num_draft}, "
            f"got {cu}"
        )
    max_k = max(counts, default=0)
    if max_num_draft_tokens is not None and max_num_draft_tokens < max_k:
        raise StagewiseError(
            f"rejection_sampling: max_num_draft_tokens = {max_num_draft_tokens}, "
            f"but a sequence has {max_k} drafts"
        )
    return max_k if max_num_draft_tokens is None else max_num_draft_tokens


def naive(
    draft_token_ids: Tensor,
    cu_num_draft_tokens: Tensor,
    draft_probs: Tensor | None,
    target_probs: Tensor,
    is_greedy: Tensor,
    uniform: Tensor,
    exponential: Tensor,
    max_num_draft_tokens: int | None = None,
) -> tuple[Tensor, Tensor]:
    """The textbook algorithm, one sequence at a time -> (output_token_ids, num_output_tokens).

    `max_num_draft_tokens` (optional) fixes the output's width at max_k + 1 without reading
    cu_num_draft_tokens; by default it is the largest k_b.
    """
    num_seqs, num_draft, _ = check_inputs(
        draft_token_ids,
        cu_num_draft_tokens,
        draft_probs,
        target_probs,
        is_greedy,
        uniform,
        exponential,
    )
    cu = cu_num_draft_tokens.tolist()  # host copy: this reference walks the sequences in Python
    max_k = check_counts(cu, num_draft, max_num_draft_tokens)
    device = target_probs.device
    output = torch.zeros(num_seqs, max_k + 1, dtype=torch.int64, device=device)  # [B, max_k + 1]
    counts = torch.zeros(num_seqs, dtype=torch.int32, device=device)  # [B]
    drafts_host, greedy_host = draft_token_ids.tolist(), is_greedy.tolist()
    per_row = exponential.shape[0] == num_draft + num_seqs and num_draft > 0
    for b in range(num_seqs):
        start, end = cu[b], cu[b + 1]
        tokens = accept_one_sequence(
            drafts_host[start:end],
            None if draft_probs is None else draft_probs[start:end],  # [k_b, V]
            target_probs[start + b : end + b + 1],  # [k_b + 1, V]
            greedy_host[b],
            uniform[start:end],  # [k_b]
            exponential[start + b : end + b + 1] if per_row else exponential[b],  # [k_b + 1, V]|[V]
        )
        output[b, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64, device=device)
        counts[b] = len(tokens)
    return output, counts


def triton(
    draft_token_ids: Tensor,
    cu_num_draft_tokens: Tensor,
    draft_probs: Tensor | None,
    target_probs: Tensor,
    is_greedy: Tensor,
    uniform: Tensor,
    exponential: Tensor,
    max_num_draft_tokens: int | None = None,
) -> tuple[Tensor, Tensor]:
    """The fused Triton kernel: one program per sequence, the same tokens as `naive`."""
    # lazy: picks GPU or interpreter
    from stagewise.kernels.rejection_sampling import rejection_sample

    return rejection_sample(
        draft_token_ids=draft_token_ids,
        cu_num_draft_tokens=cu_num_draft_tokens,
        draft_probs=draft_probs,
        target_probs=target_probs,
        is_greedy=is_greedy,
        uniform=uniform,
        exponential=exponential,
        max_num_draft_tokens=max_num_draft_tokens,
    )


OPTIMIZED_KIND = (
    "triton: one program per sequence, accept walk + exponential-race draw, no host sync"
)


def example_inputs(
    config: ModelConfig, num_tokens: int, device: torch.device, dtype: torch.dtype
) -> dict:
    """num_tokens sequences with 0..3 drafts each, greedy and sampling, draft probs or point masses.

    The probabilities are float32 whatever `dtype` (the stage computes in float32). Drafts come
    from a q close to p, so some are accepted and some rejected.
    """
    generator = torch.Generator().manual_seed(0)
    vocab, num_seqs = config.vocab_size, num_tokens
    k = [b % 4 for b in range(num_seqs)]  # drafts per sequence: 0, 1, 2, 3, 0, ...
    cu = [0]
    for k_b in k:
        cu.append(cu[-1] + k_b)
    num_draft = cu[-1]
    logits = 2.0 * torch.randn(num_draft + num_seqs, vocab, generator=generator)
    target_probs = torch.softmax(logits, dim=-1)  # [num_draft + B, V]
    rows = torch.tensor(
        [cu[b] + b + i for b in range(num_seqs) for i in range(k[b])], dtype=torch.int64
    )
    noise = 0.5 * torch.randn(num_draft, vocab, generator=generator)
    draft_probs = torch.softmax(logits[rows] + noise, dim=-1)  # [num_draft, V]: q near p
    if num_draft:
        draft = torch.multinomial(draft_probs, 1, generator=generator)[:, 0]  # [num_draft]
    else:
        draft = torch.zeros(0, dtype=torch.int64)
    is_greedy = torch.tensor([b % 3 == 1 for b in range(num_seqs)])  # [B]
    uniform = torch.rand(num_draft, generator=generator)  # [num_draft]
    exponential = torch.empty(num_seqs, vocab).exponential_(generator=generator)  # [B, V]
    return {
        "draft_token_ids": draft.to(device),
        "cu_num_draft_tokens": torch.tensor(cu, dtype=torch.int32, device=device),
        "draft_probs": draft_probs.to(device)
        if num_seqs % 2
        else None,  # odd batches: a draft model
        "target_probs": target_probs.to(device),
        "is_greedy": is_greedy.to(device),
        "uniform": uniform.to(device),
        "exponential": exponential.to(device),
    }


STAGE = Stage(
    name="rejection_sampling",
    summary=(
        "speculative decoding's verify: keep the drafts the target accepts "
        "(greedy match or u < p/q), then one target token"
    ),
    shapes="[num_draft + num_seqs, vocab] -> [num_seqs, max_k + 1], [num_seqs]",
    naive=naive,
    triton=triton,
    triton_kind=OPTIMIZED_KIND,
    example_inputs=example_inputs,
    outputs=("output_token_ids", "num_output_tokens"),
    axes={
        "draft_token_ids": "num_draft",
        "cu_num_draft_tokens": "num_seqs_plus_1",
        "draft_probs": "num_draft vocab",
        "target_probs": "num_verified vocab",
        "is_greedy": "num_seqs",
        "uniform": "num_draft",
        "exponential": "num_seqs vocab",
        "output_token_ids": "num_seqs max_k_plus_1",
        "num_output_tokens": "num_seqs",
    },
)
