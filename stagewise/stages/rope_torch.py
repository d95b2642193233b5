"""The torch tier of RoPE: the same rotation in fewer PyTorch ops, for a CPU decode step.

    positions [T], q [T, H, d], k [T, Hkv, d], cos_sin_cache [max_position, d]
        -> q, k rotated (same shapes, new tensors)

A decode step rotates one token per sequence in each of 30 layers, so the
stage's time is the number of PyTorch calls, not arithmetic: `rope.naive`
makes about 18 per layer (gather, two cats to widen cos and sin to d, then
for q and for k a cast, a chunk, a negation, a cat, two multiplies, an add).
This tier makes 9: q and k are joined into one [T, H + Hkv, d] tensor and
rotated together, with the half-width angles used as they are read from the
cache,

    [x1, x2] -> [x1 * cos - x2 * sin, x2 * cos + x1 * sin]      (cos, sin [T, 1, d/2])

which is the same formula term by term, so it gives the same numbers.

The engine used to reach the same end differently: the model gathered
`cos`/`sin` once per step and passed them to every layer (state carried
through the forward pass). Measured on a 2-core AMD EPYC (SmolLM2-135M
shapes, 30 layer calls = one step, float32, medians of 7 alternated rounds of
40 steps; the machine was shared with other jobs, so the absolute times are
inflated and the spreads wide, 20-40 %):

    T (tokens)   naive, per layer   naive, angles once per step   this tier
    1            11.6 ms            8.7 ms                        7.5 ms
    8            13.3 ms            8.4 ms                        8.9 ms
    64           542 ms             323 ms                        513 ms

For decode (T of 1 to 8) the cheaper rotation buys what the per-step angles
bought, with no state kept between layers, so the per-step angles are gone.
At T = 64 the times are dominated by the loaded machine (PyTorch's two
threads fighting other jobs) and say little; re-measure them on a quiet one.
"""

import torch


def rope(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T], q [T, H, d], k [T, Hkv, d] -> new rotated (q, k); inputs are not modified."""
    num_heads = q.shape[1]
    cos, sin = cos_sin_cache[positions].unsqueeze(1).float().chunk(2, dim=-1)  # [T, 1, d/2] each
    qk = torch.cat([q, k], dim=1).float()  # [T, H + Hkv, d]: both rotated by the same angles
    x1, x2 = qk.chunk(2, dim=-1)  # [T, H + Hkv, d/2] each
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)  # [T, H + Hkv, d]
    return out[:, :num_heads].to(q.dtype), out[:, num_heads:].to(k.dtype)  # [T, H, d], [T, Hkv, d]
