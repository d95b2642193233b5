"""Solutions to the exercises of notebook 08 (KV cache)."""

import torch


def my_kv_cache_bytes(cfg, num_tokens: int, dtype_bytes: int) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes * num_tokens


def my_naive_step_flops(cfg, context: int) -> float:
    qkv, o = cfg.hidden_size * cfg.qkv_size, cfg.q_size * cfg.hidden_size
    per_layer = qkv + o + 3 * cfg.hidden_size * cfg.intermediate_size  # matmul weights of one block
    linear = 2 * context * cfg.num_layers * per_layer + 2 * cfg.vocab_size * cfg.hidden_size  # LM head: last token
    attention = 4 * cfg.num_layers * cfg.q_size * context * context  # the full N x N scores, masked afterwards
    return linear + attention


def my_rows_computed(prompt_len: int, new_tokens: int) -> tuple[int, int]:
    naive = sum(prompt_len + i for i in range(new_tokens))  # P, P+1, ..., P+n-1
    return naive, prompt_len + new_tokens - 1


def my_cached_attention(cache, layer, q, k, v, scale):
    """Append this token's K/V to layer's cache, then attend its one query to every cached key."""
    cache[layer]["k"] = torch.cat([cache[layer]["k"], k])  # [n-1, Hkv, d] + [1, Hkv, d] -> [n, Hkv, d]
    cache[layer]["v"] = torch.cat([cache[layer]["v"], v])
    keys, values = cache[layer]["k"], cache[layer]["v"]
    group = q.shape[1] // keys.shape[1]  # query heads per KV head (GQA)
    kv_head = torch.arange(q.shape[1]) // group  # [H]: the KV head each query head reads
    scores = torch.einsum("hd,nhd->hn", q[0], keys[:, kv_head]) * scale  # [H, n]
    probs = torch.softmax(scores, dim=-1)  # no mask: the one query is the newest token
    return torch.einsum("hn,nhd->hd", probs, values[:, kv_head])[None]  # [1, H, d]


SOLUTIONS = {
    "08.kv_cache_bytes": my_kv_cache_bytes,
    "08.naive_step_flops": my_naive_step_flops,
    "08.rows_computed": my_rows_computed,
    "08.cached_attention": my_cached_attention,
}
