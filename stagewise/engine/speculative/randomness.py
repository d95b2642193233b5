"""The random numbers of speculative sampling, each tied to the position of the token it decides.

A seeded request must write the same text alone or beside others. In a
speculating engine that is harder than in plain sampling, because how many
guesses a request gets in a step depends on the others: the step's token
budget and the free KV blocks cut guesses short. So the random numbers are
never a stream consumed step by step; each is a function of

    (the request's seed, the output index t of the token being decided, what it is for)

    exponential  E_t [vocab]  Exp(1) noise: the exponential race argmax w / E_t at position t
    uniform      v_t          in [0, 1): the accept test of the guess at position t

That alone is not enough. Say a request guessed x at position t. Alone, its
guess survives or not by a test on (u_t, p_t(x)); batched, the budget cut that
guess, and position t is decided by a plain draw from p_t. Two different rules
decide the same token, so the texts part at t, however the numbers are keyed.

The remedy is a *coupling* (acceptance "coupled", the default): the token at
position t is always the target's own draw y_t = argmax p_t / E_t, guessed or
not, and a guess is kept exactly when it equals y_t. It is still the textbook
rejection sampler underneath, fed coupled numbers:

- a guess is a point mass q = 1 at x (the n-gram proposer's guesses are;
  a draft model's guess is drawn with the *same* E_t, x = argmax q_t / E_t, so
  it equals y_t often when q is near p — the Gumbel-max coupling);
- its uniform is u_t = v_t * p(x) when y_t = x, else p(x) + v_t * (1 - p(x)).
  Then u_t < p(x) exactly when y_t = x, and u_t is still uniform on [0, 1):
  P(y_t = x) = p(x), and given either case u_t is uniform on its side of p(x);
- a rejected guess draws from p with x removed, by the race with E_t: that is
  y_t, the overall winner, because it is not x.

So the output is y_1, y_2, ... whatever was guessed: the target's own sample,
exactly its law, and the same text alone, batched, cut or not. For n-gram
guesses the textbook rule (accept with probability p(x), else p without x)
has the same law per position, so nothing is lost. For a draft model it
accepts less than min(1, p / q) with independent numbers (acceptance
"rejection", the textbook rule with the draft's q rows): at least
(1 - d) / (1 + d) instead of 1 - d, d the total variation distance between p
and q. "rejection" keeps its seeded text reproducible only while the guesses a
request gets do not change (nothing cut).
"""

import torch
from torch import Tensor

from stagewise.stages.sampling import stream_seed

EXPONENTIAL_STREAM = 0x5BEC_E4B0  # the race noise E_t, shared by the verifier and a coupled draft
UNIFORM_STREAM = 0x5BEC_0A11  # the accept test's v_t
DRAFT_STREAM = 0x5DEECE66D_D4AF7  # acceptance "rejection": a draft model's own draw at position t


def generator_at(seed: int, stream: int, position: int, device) -> torch.Generator:
    """A generator seeded by (seed, what it is for, output position): one draw's own state."""
    generator = torch.Generator(device=device)
    generator.manual_seed(stream_seed(seed ^ stream, position))
    return generator


def exponentials(seed: int, positions: list[int], vocab: int, device) -> Tensor:
    """[len(positions), vocab] Exp(1): row i is E_t for t = positions[i], drawn on its own."""
    rows = [
        torch.empty(vocab, device=device).exponential_(
            generator=generator_at(seed, EXPONENTIAL_STREAM, t, device)
        )
        for t in positions
    ]
    return torch.stack(rows) if rows else torch.empty(0, vocab, device=device)


def uniforms(seed: int, positions: list[int], device) -> Tensor:
    """[len(positions)] in [0, 1): v_t for each position."""
    values = [
        torch.rand(1, generator=generator_at(seed, UNIFORM_STREAM, t, device), device=device)
        for t in positions
    ]
    return torch.cat(values) if values else torch.empty(0, device=device)


def race_rows(weights: Tensor, exponential: Tensor) -> Tensor:
    """[n, V] weights >= 0, [n, V] noise -> [n]: argmax w / E per row, zero weights never win."""
    scores = torch.where(weights > 0, weights / exponential, -1.0)  # [n, V]
    return scores.argmax(dim=-1)  # first index on ties, as the stage's race


def coupled_uniforms(p_x: Tensor, keep: Tensor, v: Tensor) -> Tensor:
    """Uniforms with u < p_x exactly where `keep`: [n] p(x), [n] bool, [n] v in [0, 1) -> [n].

    keep: v * p(x), held strictly below p(x) (a product can round up to it);
    else: p(x) + v * (1 - p(x)), at least p(x)."""
    below = torch.minimum(v * p_x, torch.nextafter(p_x, torch.zeros_like(p_x)))
    return torch.where(keep, below, p_x + v * (1.0 - p_x))
