"""Counters every runner keeps about the work it did (for benchmarks and traces)."""

from dataclasses import dataclass, field


@dataclass
class RunStats:
    steps: int = 0  # forward passes run
    tokens_computed: int = 0  # rows pushed through the model, padding included
    padding_tokens: int = 0  # rows that were padding or belonged to finished requests (wasted work)
    kv_cache_bytes: int = 0  # KV cache allocated for the run
    preemptions: int = 0  # requests sent back to waiting because blocks ran out (paged)
    # KV blocks held during each step (paged)
    blocks_in_use: list[int] = field(default_factory=list)
    prefix_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache (paged)
    prefix_hit_tokens: int = 0  # of those, tokens whose K/V were reused (paged)
    forked_tokens: int = 0  # prompt tokens parallel samples shared with their first sample (paged)
    spec_verify_steps: int = 0  # speculative decoding: (request, step) pairs that checked guesses
    spec_draft_tokens: int = 0  # guesses verified
    spec_accepted_tokens: int = 0  # of those, guesses the target kept

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def spec_mean_accepted(self) -> float:
        """Guesses kept per verify step (each step adds one token of the target's own too)."""
        return self.spec_accepted_tokens / self.spec_verify_steps if self.spec_verify_steps else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return (
            self.prefix_hit_tokens / self.prefix_queried_tokens
            if self.prefix_queried_tokens
            else 0.0
        )
