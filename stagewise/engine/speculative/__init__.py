"""Speculative decoding: guess k tokens cheaply, verify them in one target forward pass.

    config.py    SpeculativeConfig, parse_speculative_config (dict, JSON, "ngram:k")
    proposal.py  Proposal and the Proposer protocol every proposer follows
    ngram.py     prompt lookup (the last n tokens searched for earlier in the text)
    draft.py     a smaller draft model with its own paged KV cache
    draft_load.py  loading the draft (or the target's own first layers), the vocabulary check
    verify.py    the verify step: target probabilities per row, the rejection sampler
    randomness.py  random numbers tied to the position they decide; the coupling that makes
                 a seeded text independent of how many guesses were made

`make_proposer(config, target_llm)` builds the proposer a config names.
"""

from stagewise.engine.speculative.config import SpeculativeConfig, parse_speculative_config
from stagewise.engine.speculative.proposal import Proposal, Proposer

__all__ = ["Proposal", "Proposer", "SpeculativeConfig", "make_proposer", "parse_speculative_config"]


def make_proposer(config: SpeculativeConfig, target_llm) -> Proposer:
    """The proposer of `config.method`; `target_llm`: the LLM being built (its model, tokenizer)."""
    if config.method == "ngram":
        from stagewise.engine.speculative.ngram import NgramProposer

        return NgramProposer(config)
    from stagewise.engine.speculative.draft import DraftModelProposer  # loads a second model

    return DraftModelProposer(config, target_llm)
