"""Target and draft checkpoints for the speculative-decoding tests, written as HF Llama folders.

The target is the tiny architecture (2 layers) with seeded random weights, its
embedding scaled to rows of norm ~1 so the tied logits have std ~1 (unscaled,
the last input token's own logit dominates and a random model only repeats
it). The draft is that target cut to its first layer — the "truncated-layer"
draft a real deployment can make from any model — or the whole target with
noise added to its weights; either way its probabilities are related to the
target's but differ, and some guesses are rejected.

`tokenizer`: the tiny 512-token vocabulary by default; the distribution test
passes an 8-letter one so that the joint law of two tokens has 64 cells.
"""

import copy
from pathlib import Path

import pytest
import torch

from stagewise.models.tokenizer_files import tokenizer_to_hf_dir
from stagewise.tokenizer import Tokenizer
from tests.checkpoints import CFG, hf_tiny_model

LETTERS = Tokenizer(tokens=list("abcdefgh"), merges=[], special_tokens={}, bos_id=None, eos_id=None)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny shapes run on one torch thread (on a loaded machine a second one mostly waits: the
    speculative tests ran ~10x faster so); the thread count is restored after the module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def target_and_draft(
    folder: Path,
    seed: int = 0,
    tokenizer: Tokenizer | None = None,
    layers: int = 1,
    noise: float = 0.0,
) -> tuple[str, str]:
    """Write the target and its draft under `folder`; -> their paths (as strings).

    The draft keeps the target's first `layers` layers; `noise` adds seeded Gaussian noise of
    this size, relative to each tensor's spread, to all of its weights (0: exact copies)."""
    tokenizer = tokenizer or Tokenizer.tiny()
    target = hf_tiny_model(seed=seed, vocab_size=tokenizer.vocab_size)
    with torch.no_grad():
        target.model.embed_tokens.weight /= CFG.hidden_size**0.5  # tied logits of std ~1
    draft = copy.deepcopy(target)
    draft.model.layers = draft.model.layers[:layers]  # the target's first layers, norm and head
    draft.config.num_hidden_layers = layers
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in draft.parameters() if noise else ():
            p += noise * p.std() * torch.randn(p.shape, generator=generator)
    paths = []
    for name, model in (("target", target), ("draft", draft)):
        path = folder / name
        model.save_pretrained(path, safe_serialization=True)
        tokenizer_to_hf_dir(tokenizer, path)
        paths.append(str(path))
    return paths[0], paths[1]
