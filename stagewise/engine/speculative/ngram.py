"""The n-gram proposer (prompt lookup): guess that text repeats.

Summaries quote their source, code edits copy most of the code, a chat answer
repeats the question's names. So: take the last n tokens of a request (prompt
and output so far), find their most recent earlier occurrence, and propose
the k tokens that followed it there. n runs from `prompt_lookup_max` down to
`prompt_lookup_min` (a longer match is a better predictor); no match, no
proposal. No model runs, so a guess costs a few vectorised comparisons; its
probabilities are a point mass (q = 1 on the guessed token), which the
rejection sampler knows as `draft_probs=None`.

    tokens  ... the cat sat on the mat . the cat | sat on the mat ...
                ^^^^^^^ earlier match            ^ proposals: the tokens that followed

Backing off (`adaptive`, on by default): on free prose a short n-gram often
matches by chance and its continuation is wrong. Each wrong guess costs a
verify step of 1 + k rows instead of 1, and rewinding. So each request keeps
a little state: after a step where no draft was accepted it stops proposing
for 1, 2, 4, ... up to 16 steps (doubling with each further miss in a row),
and it guesses fewer tokens (halved, then one more than it last got right)
until a step where every draft is accepted lets it grow back towards k.
"""

from dataclasses import dataclass

import numpy as np

from stagewise.engine.request import Request
from stagewise.engine.speculative.config import SpeculativeConfig
from stagewise.engine.speculative.proposal import Proposal

MAX_COOLDOWN = 16  # the most steps a request waits before guessing again


@dataclass
class _Backoff:
    k: int  # tokens this request may guess next time (1 .. num_speculative_tokens)
    misses: int = 0  # verify steps in a row where no draft was accepted
    cooldown: int = 0  # steps left before it guesses again


def lookup(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The tokens that followed the most recent earlier occurrence of the last n tokens.

    n from n_max down to n_min; [] when no suffix occurs earlier.
    """
    length = len(token_ids)
    if length < n_min + 1 or k < 1:
        return []
    ids = np.asarray(token_ids, dtype=np.int64)  # [L]
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = ids[-n:]  # [n]
        # windows over ids[:-1]: a match starting at i ends at i + n <= L - 1, before the suffix
        windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)  # [L - n, n]
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the most recent one: what followed it
            return token_ids[start : start + k]
    return []


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self._state: dict[str, _Backoff] = {}  # request id -> its back-off

    def _backoff(self, req: Request) -> _Backoff:
        state = self._state.get(req.request_id)
        if state is None:
            state = self._state[req.request_id] = _Backoff(self.config.num_speculative_tokens)
        return state

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[Proposal]:
        cfg, out = self.config, []
        for req, limit in zip(requests, num_tokens):
            k = min(limit, cfg.num_speculative_tokens)
            if cfg.adaptive:
                state = self._backoff(req)
                if state.cooldown > 0:
                    state.cooldown -= 1
                    k = 0
                k = min(k, state.k)
            ids = lookup(req.all_token_ids, k, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
            out.append(Proposal(token_ids=ids, probs=None))
        return out

    def on_verified(self, req: Request) -> None:
        """Adjust the back-off after a verify step (`req.spec_token_ids` were its drafts)."""
        proposed, accepted = len(req.spec_token_ids), req.last_num_accepted
        if not self.config.adaptive or proposed == 0:
            return
        state = self._backoff(req)
        if accepted == 0:
            state.misses += 1
            state.cooldown = min(2 ** (state.misses - 1), MAX_COOLDOWN)
            state.k = max(1, state.k // 2)
        elif accepted == proposed:
            state.misses = 0
            state.k = min(self.config.num_speculative_tokens, 2 * state.k)
        else:
            state.misses = 0
            state.k = min(self.config.num_speculative_tokens, accepted + 1)

    def on_removed(self, req: Request) -> None:
        self._state.pop(req.request_id, None)

    def close(self) -> None:
        self._state.clear()
