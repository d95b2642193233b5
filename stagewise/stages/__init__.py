"""The stage registry: every step of a Llama forward pass, in pipeline order.

`STAGES[name]` is a `Stage` with a naive PyTorch reference and an optimized
path of the same signature. Tests, the `stages` CLI command, benchmarks and
notebooks iterate this mapping, so a new stage is one module plus one line here.
"""

from stagewise.stages import (
    attention,
    embedding,
    ffn,
    kv_store,
    lm_head,
    o_proj,
    paged_attention,
    qkv_proj,
    rmsnorm,
    rope,
    sampling,
    tokenize,
)
from stagewise.stages.base import Stage

STAGES: dict[str, Stage] = {
    module.STAGE.name: module.STAGE
    for module in (
        tokenize,
        embedding,
        rmsnorm,
        qkv_proj,
        rope,
        kv_store,
        attention,
        paged_attention,
        o_proj,
        ffn,
        lm_head,
        sampling,
    )
}

__all__ = ["STAGES", "Stage"]
