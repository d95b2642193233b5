"""Counters every runner keeps about the work it did (for benchmarks and traces)."""

from dataclasses import dataclass


@dataclass
class RunStats:
    steps: int = 0  # forward passes run
    tokens_computed: int = 0  # rows pushed through the model, padding included
    padding_tokens: int = 0  # rows that were padding or belonged to finished requests (wasted work)
    kv_cache_bytes: int = 0  # largest KV cache allocated during the run
