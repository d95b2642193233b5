"""What a proposer returns, and what every proposer offers the engine.

    Proposal(token_ids, probs)   k' <= k guessed tokens of one request, continuing
                                 req.all_token_ids; probs [k', vocab] float32 are the
                                 draft's q rows, or None for point masses (n-gram,
                                 greedy, a draft with the coupled acceptance)

The engine asks before each step's scheduling (`propose`), so the scheduler
knows how many query tokens each speculating request needs (1 + k'). After
every step that gave a running request tokens (a verify step, a plain decode
step, its first token after the prompt) `on_verified` lets a proposer with
state (the draft model's KV cache) rewind or catch up: `req.all_token_ids`
then ends with the accepted drafts and the target's own token,
`req.spec_token_ids` still holds the drafts that were verified (empty when
none were) and `req.last_num_accepted` says how many of them were kept. A
request that finished gets no `on_verified`, only `on_removed`, which drops
its state (finished, aborted, failed or preempted). Proposals are asked for
decoding requests only (all tokens but the last computed, at least one
output token); `propose` may be asked again for a request that was not
scheduled the last time (the token budget), with the same tokens.
"""

from dataclasses import dataclass
from typing import Protocol

import torch

from stagewise.engine.request import Request


@dataclass
class Proposal:
    token_ids: list[int]  # k' <= k proposed tokens (may be empty: nothing to propose)
    probs: torch.Tensor | None = None  # [k', vocab] float32 q rows (draft model); None = point mass


class Proposer(Protocol):
    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[Proposal]:
        """One Proposal per request, at most num_tokens[i] tokens each."""
        ...

    def on_verified(self, req: Request) -> None:
        """After acceptance: catch up with req.all_token_ids (drafts kept + the target's token)."""
        ...

    def on_removed(self, req: Request) -> None:
        """The request left (finished, aborted, failed, preempted): drop its state."""
        ...

    def close(self) -> None: ...
