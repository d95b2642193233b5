"""Solutions to the exercises of notebook 03 (fused QKV and GQA)."""

import torch


def my_split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
    T = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_size].view(T, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(T, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].view(T, num_kv_heads, head_dim)
    return q, k, v


def my_repeat_kv(kv: torch.Tensor, num_heads: int) -> torch.Tensor:
    group = num_heads // kv.shape[1]
    kv_head_of = torch.arange(num_heads) // group  # query head h reads KV head h // group
    return kv[:, kv_head_of]  # [T, Hkv, d] -> [T, H, d], a copy


def my_kv_bytes_per_token(cfg, dtype_bytes: int) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes  # K and V, every layer


SOLUTIONS = {"03.split_qkv": my_split_qkv, "03.repeat_kv": my_repeat_kv, "03.kv_bytes_per_token": my_kv_bytes_per_token}
