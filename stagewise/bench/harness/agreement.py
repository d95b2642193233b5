"""Greedy agreement: how many tokens two runs share before they part, and the prompts it is read on.

Two weight formats (or tiers) of one model are compared by decoding the same prompts greedily with
both: a token that differs changes every token after it, so the count up to the first difference
says how long the two agree, not how far apart their logits are.
"""

PROMPTS = [  # short, varied prompts: prose, code, a number sequence, facts
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 5, 8, 13,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "In machine learning, a neural network is",
    "The quick brown fox",
]


def agreement(a: list[int], b: list[int]) -> int:
    """Tokens equal before the first difference."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
