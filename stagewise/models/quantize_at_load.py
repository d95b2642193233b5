"""A float checkpoint quantized at load: `LLM(model_dir, quantization="int4" | "int8")`.

Weight-only, round-to-nearest, group by group along each matrix's input axis
(`quant/quantize.py` has the formulas, llama.cpp's reference quantizers):

    scheme     projections (qkv, o, gate_up, down)   embedding / LM head
    int8       q8_0: w = d * q, q in -127..127        q8_0
    int4       q4_1: w = d * q + m, q in 0..15        q8_0

int4 is asymmetric (q4_1, a scale and a minimum per group) rather than
symmetric (q4_0): a group's 16 levels then span its own [min, max] instead of
[-max|w|, max|w|], about half the rounding step for skewed groups, for 2 more
bytes per 32 weights; both run through the same int4 kernels. The embedding
table, which is also the tied LM head, stays 8-bit in both schemes (as in
llama.cpp's own Q4 files): its rows are read one token at a time, and the
logits are the last thing rounding should touch. Norms stay floats.

Groups are 32 values by default; "int4:g64" / "int8:g128" take 64 or 128
(fewer scales: 0.5 + 4/64 bytes per weight for int4:g64). Every matrix's
input size must be a whole number of groups, else a one-line error names it.
"""

import torch

from stagewise.errors import StagewiseError
from stagewise.models.quantized import parse_scheme
from stagewise.models.weights import LayerWeights, LlamaWeights
from stagewise.quant.packed_weight import PackedWeightError
from stagewise.quant.quantize import quantize

PROJECTION_KIND = {"int8": "q8_0", "int4": "q4_1"}  # scheme -> kind of the four projections
TABLE_KIND = "q8_0"  # the embedding / LM head, in either scheme


def quantize_weights(weights: LlamaWeights, quantization: str, where: str) -> LlamaWeights:
    """Float `weights` (projections [in, out]) -> the same model with packed projections.

    `quantization` "none" / "auto" return `weights` unchanged (nothing to keep from a float file).
    """
    scheme, group = parse_scheme(quantization)
    if scheme not in PROJECTION_KIND:
        return weights

    def pack(w: torch.Tensor, kind: str, name: str):
        try:
            packed = quantize(w, kind, group)  # [K, N] float -> packed [K, N]
        except PackedWeightError as exc:
            raise StagewiseError(f"{where}: {quantization}: {name}: {exc}") from None
        for part, t in (("scales", packed.scales), ("minimums", packed.mins)):
            if t is not None and not torch.isfinite(t).all():  # else NaN logits, without a word
                raise StagewiseError(
                    f"{where}: {quantization}: {name}: its float16 {part} hold NaN or infinite "
                    f"values (weights up to {float(w.abs().max()):.3g}; float16 ends at 65504): "
                    "load it with quantization='none'"
                )
        return packed

    kind = PROJECTION_KIND[scheme]
    layers = []
    for i, lw in enumerate(weights.layers):
        parts = {}
        for name, w in vars(lw).items():
            is_matrix = name.startswith("w_")
            parts[name] = pack(w, kind, f"layer {i} {name}") if is_matrix else w
        layers.append(LayerWeights(**parts))
    # the table [vocab, hidden] is the tied LM head [hidden, vocab]: one packed weight serves both
    embed = pack(weights.embed.t(), TABLE_KIND, "embedding")  # packed [hidden, vocab]
    lm_head = embed if weights.tied() else pack(weights.lm_head, TABLE_KIND, "lm_head")
    return LlamaWeights(embed=embed, layers=layers, final_norm=weights.final_norm, lm_head=lm_head)
