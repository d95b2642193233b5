"""The `quantization=` choice of a load: which GGUF types stay packed, and what was kept.

A GGUF's Q4_0, Q4_1, Q8_0 and K-quant tensors are kept packed under "auto" (the
default; the block readers are `quant/gguf_blocks.py` and `quant/gguf_kquants.py`);
"none" dequantizes every tensor; "int8" / "int4" quantize a float checkpoint at
load (`models/quantize_at_load.py`). Every other type (F32, F16, Q5_0, Q2_K, ...)
is dequantized at load; a quantized one gets a one-line notice.
"""

import sys

from stagewise.errors import StagewiseError
from stagewise.quant.gguf_blocks import KEPT
from stagewise.quant.packed_weight import GROUP_SIZE, is_packed

# LLM(quantization=...): "auto" keeps a GGUF's types, "none" dequantizes all, "int8" / "int4"
# (optionally ":g64" etc.) quantize a float checkpoint at load (`models/quantize_at_load.py`)
QUANTIZATION = ("auto", "none", "int8", "int4")
SCHEME_GROUPS = (32, 64, 128)  # group sizes "int8:gN" / "int4:gN" take (default 32)
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")  # plain numbers: loaded, no notice


def check_quantization(quantization: str) -> str:
    """The value of `quantization=` if it is one stagewise knows, else a one-line error."""
    parse_scheme(quantization)
    return quantization


def parse_scheme(quantization: str) -> tuple[str, int]:
    """ "auto" / "none" / "int8" / "int4" / "int4:g64" ... -> (name, group size; 32 when unsaid)."""
    if not isinstance(quantization, str):
        raise StagewiseError(f"quantization must be a string, got {quantization!r}")
    name, _, group = quantization.partition(":")
    if name not in QUANTIZATION or (group and name not in ("int8", "int4")):
        raise StagewiseError(
            f"unknown quantization '{quantization}'; use one of {', '.join(QUANTIZATION)} "
            "(int8 / int4 take a group size, e.g. int4:g64)"
        )
    if not group:
        return name, GROUP_SIZE
    size = group[1:]
    if not (group.startswith("g") and size in {str(g) for g in SCHEME_GROUPS}):  # "g064", "g٦٤": no
        raise StagewiseError(
            f"quantization '{quantization}': the group size is written g32, g64 or g128"
        )
    return name, int(size)


def kept_kind(type_name: str, quantization: str) -> str | None:
    """The packed kind a GGUF tensor type is kept as under `quantization`, or None (dequantize)."""
    if quantization == "none" or type_name not in KEPT:
        return None
    return KEPT[type_name][0]


def notice_dequantized(types: set[str], path, quantization: str = "auto") -> None:
    """One line for quantized tensors of a type stagewise cannot keep, expanded to floats."""
    if quantization == "none":
        return  # asked for: every tensor is dequantized
    others = sorted(t for t in types if t not in FLOAT_TYPES and t not in KEPT)
    if others:
        print(
            f"stagewise: {path}: {', '.join(others)} tensors are dequantized at load "
            f"(stagewise keeps {', '.join(KEPT)} packed)",
            file=sys.stderr,
        )


def weight_formats(weights) -> str:
    """What the weights are kept as, e.g. "q4_1 x 120, q8_0 x 1, float32 x 61" (distinct ones)."""
    seen: dict[int, str] = {}
    for t in [weights.embed, weights.lm_head, weights.final_norm]:
        seen.setdefault(id(t), t.kind if is_packed(t) else str(t.dtype).removeprefix("torch."))
    for lw in weights.layers:
        for t in vars(lw).values():
            seen.setdefault(id(t), t.kind if is_packed(t) else str(t.dtype).removeprefix("torch."))
    counts: dict[str, int] = {}
    for kind in seen.values():
        counts[kind] = counts.get(kind, 0) + 1
    return ", ".join(f"{k} x {n}" for k, n in counts.items())
