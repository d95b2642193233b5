"""Solutions to the exercises of notebook 04 (RoPE)."""

import torch


def my_cos_sin_cache(max_position: int, rotary_dim: int, theta: float) -> torch.Tensor:
    inv_freq = theta ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)  # [rotary_dim / 2]
    angles = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [max_pos, rotary_dim / 2]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def my_rope(positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    cos, sin = cos_sin_cache[positions, :half][:, None, :], cos_sin_cache[positions, half:][:, None, :]  # [T, 1, d/2]
    x1, x2 = x.float()[..., :half], x.float()[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


SOLUTIONS = {"04.cos_sin_cache": my_cos_sin_cache, "04.rope": my_rope}
