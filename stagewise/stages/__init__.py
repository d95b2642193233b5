"""The stage registry: every step of a Llama forward pass, in pipeline order.

`STAGES[name]` is a `Stage` with three tiers of one signature: `naive` (the
textbook formula), `triton` and, where a CPU needs it, `torch` (a faster
PyTorch formulation in its own module beside the stage: `gemm_torch.py` for
the four projections, `rope_torch.py`, `paged_attention_torch.py`). Tests,
the `stages` CLI command, benchmarks and notebooks iterate this mapping, so a
new stage is one module plus one line here.
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
    rejection_sampling,
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
        rejection_sampling,
    )
}

__all__ = ["STAGES", "Stage"]
