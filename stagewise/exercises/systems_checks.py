"""Check for notebook 08's systems exercise: the student writes the KV cache.

Append each new token's K/V, attend its one query against all of them; the tiny model, run token
by token on the student's cache, must give recompute's greedy tokens. (09's allocator checks are
in block_checks.py, 10's scheduler check in schedule_checks.py.)
"""

import torch

from stagewise.exercises.core import call, close, equal
from stagewise.exercises.engine_checks import tiny_model
from stagewise.kv.access import KVAccess
from stagewise.stages import STAGES
from stagewise.stages.attention_metadata import AttentionMetadata

# ---------------------------------------------------------------- 08 the KV cache


class _StudentCache(KVAccess):
    """A `KVAccess` for the forward pass: each layer's attention is the student's function.

    Beside it the check keeps its own cache and runs the attention stage's naive path over it,
    so a wrong output or a wrong cache is caught at the layer and step where it happens.
    """

    def __init__(self, fn, cache: list[dict], ref: list[dict]):
        self.fn, self.cache, self.ref, self.step = fn, cache, ref, 0

    def attend(self, ops, layer, q, k, v, scale):  # q [1, H, d], k, v [1, Hkv, d]
        ref = self.ref[layer]
        ref["k"], ref["v"] = torch.cat([ref["k"], k]), torch.cat([ref["v"], v])  # [n, Hkv, d]
        n = ref["k"].shape[0]
        one_query = AttentionMetadata.build([1], [n], "cpu", k_starts=[0, n])
        want = STAGES["attention"].naive(q=q, k=ref["k"], v=ref["v"], metadata=one_query, scale=scale)
        where = f"step {self.step} (position {n - 1}), layer {layer}"
        got = call(self.fn, self.cache, layer, q, k, v, scale)
        close(got, want, f"{where}: attention output", atol=1e-5)
        for name in ("k", "v"):
            close(self.cache[layer][name], ref[name], f"{where}: cache[{layer}][{name!r}]", atol=0, rtol=0)
        return got


def check_cached_attention(fn) -> str:
    """my_cached_attention(cache, layer, q [1, H, d], k [1, Hkv, d], v, scale) -> out [1, H, d].

    The tiny model runs one token per forward pass (the prompt too), so every call brings one
    query; the greedy tokens must equal recompute's (the whole sequence every step, no cache).
    """
    from stagewise.kv.none import NoKVCache
    from stagewise.models.forward_batch import ForwardBatch
    from stagewise.models.llama import LlamaModel
    from stagewise.models.ops import StageOps

    loaded = tiny_model()
    model, cfg = LlamaModel(loaded, StageOps("naive")), loaded.config
    g = torch.Generator().manual_seed(8)
    prompt, new_tokens = torch.randint(0, cfg.vocab_size, (5,), generator=g).tolist(), 6

    def empty():
        return [{n: torch.zeros(0, cfg.num_kv_heads, cfg.head_dim) for n in ("k", "v")} for _ in range(cfg.num_layers)]

    recompute = list(prompt)
    for _ in range(new_tokens):
        batch = ForwardBatch.from_sequences([recompute], [0], "cpu")
        recompute.append(int(model.forward(batch, NoKVCache.of(batch))[0].argmax()))

    kv = _StudentCache(fn, empty(), empty())
    ids = list(prompt)
    for pos in range(len(prompt) + new_tokens - 1):
        kv.step = pos
        logits = model.forward(ForwardBatch.from_sequences([[ids[pos]]], [pos], "cpu"), kv)
        if pos >= len(prompt) - 1:
            ids.append(int(logits[0].argmax()))
    equal(ids, recompute, "greedy tokens (prompt, then generated)")
    return f"{len(ids) - 1} one-token steps x {cfg.num_layers} layers: outputs, cache and tokens equal recompute's"


CHECKS = {"08.cached_attention": check_cached_attention}
