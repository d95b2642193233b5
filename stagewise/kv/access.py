"""`KVAccess`: what the forward pass asks of a step's KV layout, one call per layer.

Every engine mode hands `LlamaModel.forward` one of these: `NoKVCache` (`kv/none.py`), a
contiguous cache's step (`kv/contiguous.py`) or a paged cache's step (`kv/paged.py`). Each
stores the new K/V (or not) and runs the attention stage over what it holds: `attend`.

The model calls `rope_and_attend`: RoPE on q and k (the rope stage), then `attend`. A layout may
do the two in fewer kernels — the paged cache's triton tier rotates k as it stores it
(`PagedKVStep.rope_and_attend`) — so the model never needs to know which cache it runs over.
"""

import torch

from stagewise.stages import rope


class KVAccess:
    def attend(
        self, ops, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q [T, H, d], new k/v [T, Hkv, d] (rotated) -> attention output [T, H, d]."""
        raise NotImplementedError

    def rope_and_attend(
        self,
        ops,
        layer: int,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """RoPE on q and k at `positions` [T], then `attend` -> attention output [T, H, d]."""
        q, k = ops(rope, layer=layer, positions=positions, q=q, k=k, cos_sin_cache=cos_sin_cache)
        return self.attend(ops, layer=layer, q=q, k=k, v=v, scale=scale)
