"""`KVAccess`: what the forward pass asks of a step's KV layout, one call per layer.

Every engine mode hands `LlamaModel.forward` an object with this one method: `NoKVCache`
(`kv/none.py`), a contiguous cache's step (`kv/contiguous.py`) or a paged cache's step
(`kv/paged.py`). Each stores the new K/V (or not) and runs the attention stage over what it holds.
"""

from typing import Protocol

import torch


class KVAccess(Protocol):
    def attend(
        self, ops, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q [T, H, d], new k/v [T, Hkv, d] -> attention output [T, H, d]."""
        ...
