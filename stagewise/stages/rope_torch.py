"""The torch tier of RoPE: the same rotation in fewer PyTorch ops, for a CPU decode step.

    positions [T], q [T, H, d], k [T, Hkv, d], cos_sin_cache [max_position, d]
        -> q, k rotated (same shapes, new tensors)

A decode step rotates one token per sequence in each of 30 layers, so the
stage's time is the number of PyTorch calls, not arithmetic: `rope.naive`
makes about 18 per layer (gather, two cats to widen cos and sin to d, then
for q and for k a cast, a chunk, a negation, a cat, two multiplies, an add).
This tier makes 6: one row gather, one cat that joins q and k into a
[T, H + Hkv, d] tensor (both are turned by the same angles), one copy that
swaps each head's halves, two multiplies and an add:

    x = [x1, x2]  ->  x * [cos, cos] + [x2, x1] * [-sin, sin]
                   =  [x1 * cos - x2 * sin, x2 * cos + x1 * sin]

The angles come from a widened copy of the cache, row p = [cos, cos, -sin, sin]
(2 d floats: for 8192 positions of 64-dim heads, 4 MB beside the cache's
2 MB), built once per cache and remembered beside it (`wide_cache`, space for
time as the cache itself is). Negating a sine and adding is exactly
subtracting, so the numbers are the reference's, bit for bit.

What the calls cost is hard to time on a shared 2-core machine (at a load
average of 6-12 a step's time moved by +-10 % between runs, more than these
calls cost); what can be counted is the calls: the previous form
of this tier (q and k joined, half-width angles) made 9 plus 2 casts that
changed nothing for a float32 model, this one 6, and none of the casts.
"""

import weakref

import torch

from stagewise.cpu import rows as cpu_rows

# id(cos_sin_cache) -> (a weak reference to it, its widened rows [max_position, 2 d]); an entry
# goes when its cache does (keyed by id: tensors compare by value, so they make no dict keys)
_WIDE: dict[int, tuple[weakref.ref, torch.Tensor]] = {}


def wide_cache(cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """[max_position, d] = [cos, sin] -> [max_position, 2 d] = [cos, cos, -sin, sin], float32."""
    key = id(cos_sin_cache)
    entry = _WIDE.get(key)
    if entry is not None and entry[0]() is cos_sin_cache:
        return entry[1]
    cos, sin = cos_sin_cache.float().chunk(2, dim=-1)  # [max_position, d/2] each
    wide = torch.cat([cos, cos, -sin, sin], dim=-1).contiguous()  # [max_position, 2 d]
    _WIDE[key] = (weakref.ref(cos_sin_cache, lambda _: _WIDE.pop(key, None)), wide)
    return wide


def rope(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T], q [T, H, d], k [T, Hkv, d] -> new rotated (q, k); inputs are not modified."""
    num_tokens, num_heads, head_dim = q.shape
    if cpu_rows.serves(q) and k.dtype == torch.float32:  # one compiled call, the same bits
        return cpu_rows.rope(positions, q, k, wide_cache(cos_sin_cache))
    half = head_dim // 2
    angles = wide_cache(cos_sin_cache).index_select(0, positions)  # [T, 2 d]
    cos, sin = angles.view(num_tokens, 1, 2 * head_dim).split(head_dim, dim=-1)  # [T, 1, d] each
    qk = torch.cat([q, k], dim=1)  # [T, H + Hkv, d]: a new tensor (the inputs stay as they are)
    if qk.dtype != torch.float32:
        qk = qk.float()
    swapped = qk.view(num_tokens, -1, 2, half).flip(2).view(qk.shape)  # [x2, x1], [T, H + Hkv, d]
    out = qk.mul_(cos).add_(swapped.mul_(sin))  # [T, H + Hkv, d], in the new tensors
    q_out, k_out = out[:, :num_heads], out[:, num_heads:]  # [T, H, d], [T, Hkv, d] views
    if q.dtype != torch.float32:  # back to the inputs' dtype (a float32 model has nothing to do)
        q_out, k_out = q_out.to(q.dtype), k_out.to(k.dtype)
    return q_out, k_out
