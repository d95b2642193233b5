"""GGUF's quantized blocks -> `PackedWeight`, and the `quantization=` choice of a load.

A GGUF tensor of type Q4_0, Q4_1 or Q8_0 is a run of fixed-size blocks, one
per 32 consecutive weights of a row (llama.cpp's `block_q4_0` etc.):

    Q4_0   18 bytes: d (float16) | 16 bytes of codes (two per byte)
    Q4_1   20 bytes: d (float16) | m (float16) | 16 bytes of codes
    Q8_0   34 bytes: d (float16) | 32 signed codes (int8)

`packed_from_blocks` separates them, without changing a bit: the codes of all
blocks of a row side by side in one tensor, d (and m) in another, so a kernel
reads each with plain strides (`stages/packed_weight.py` draws the layout).
The K-quants Q4_K, Q5_K and Q6_K (super-blocks of 256) are expanded exactly to
groups with float32 scales (`models/gguf_kquants.py`). Every other type (F32,
F16, Q5_0, Q2_K, ...) is dequantized at load as before; a quantized one gets a
one-line notice.

Before a bit is read, every tensor's bytes must match its shape: rows of
whole blocks, and exactly the blocks' bytes (a truncated or corrupt file is
refused in one line); so must the scales be finite.
"""

import sys

import numpy as np
import torch

from stagewise.errors import StagewiseError
from stagewise.models.gguf_kquants import K_KEPT, SUPER_BLOCK, packed_from_k_blocks
from stagewise.stages.packed_weight import GROUP_SIZE, PackedWeight

# LLM(quantization=...): "auto" keeps a GGUF's types, "none" dequantizes all, "int8" / "int4"
# (optionally ":g64" etc.) quantize a float checkpoint at load (`models/quantize_at_load.py`)
QUANTIZATION = ("auto", "none", "int8", "int4")
SCHEME_GROUPS = (32, 64, 128)  # group sizes "int8:gN" / "int4:gN" take (default 32)
KEPT = {
    "Q4_0": ("q4_0", 18),
    "Q4_1": ("q4_1", 20),
    "Q8_0": ("q8_0", 34),
    **K_KEPT,
}  # -> kind, bytes
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
    if not (group.startswith("g") and size.isdigit() and int(size) in SCHEME_GROUPS):
        raise StagewiseError(
            f"quantization '{quantization}': the group size is written g32, g64 or g128"
        )
    return name, int(size)


def kept_kind(type_name: str, quantization: str) -> str | None:
    """The packed kind a GGUF tensor type is kept as under `quantization`, or None (dequantize)."""
    if quantization == "none" or type_name not in KEPT:
        return None
    return KEPT[type_name][0]


def packed_from_blocks(
    data: np.ndarray, type_name: str, shape: tuple[int, int], name: str
) -> PackedWeight:
    """A GGUF tensor's raw blocks (uint8) of an [out, in] matrix -> PackedWeight [in, out].

    Refuses, with one line, data whose size does not match the shape (a truncated or corrupt file).
    """
    kind, block_bytes = KEPT[type_name]
    out_f, in_f = shape
    block = SUPER_BLOCK if type_name in K_KEPT else GROUP_SIZE
    if in_f % block:
        raise StagewiseError(
            f"{name}: {type_name} rows of {in_f} values are not whole blocks of {block}"
        )
    blocks_per_row = in_f // block
    raw = np.asarray(data).reshape(-1)
    if raw.dtype != np.uint8:
        raise StagewiseError(f"{name}: {type_name} data must be raw bytes, got {raw.dtype}")
    expected = out_f * blocks_per_row * block_bytes
    if raw.size != expected:
        raise StagewiseError(
            f"{name}: {type_name} data holds {raw.size} bytes, a [{out_f}, {in_f}] matrix needs "
            f"{expected} (truncated or corrupt?)"
        )
    blocks = raw.reshape(out_f, blocks_per_row, block_bytes)  # [N, K/block, bytes per block]
    if type_name in K_KEPT:
        w = packed_from_k_blocks(blocks, type_name)
        _check_finite(w, name, type_name)
        return w

    def f16(start: int) -> torch.Tensor:  # [N, K/32] float16 from two bytes of every block
        return torch.from_numpy(
            np.ascontiguousarray(blocks[:, :, start : start + 2]).view(np.float16)[..., 0]
        )

    start = 4 if kind == "q4_1" else 2  # where the codes begin in a block
    codes = np.ascontiguousarray(blocks[:, :, start:]).reshape(out_f, -1)  # [N, K/2] or [N, K]
    codes = torch.from_numpy(codes.view(np.int8) if kind == "q8_0" else codes)
    scales, mins = f16(0), f16(2) if kind == "q4_1" else None
    w = PackedWeight(kind, codes, scales, mins)
    _check_finite(w, name, type_name)
    return w


def _check_finite(w: PackedWeight, name: str, type_name: str) -> None:
    for part, t in (("scales", w.scales), ("mins", w.mins)):
        if t is not None and not torch.isfinite(t).all():
            raise StagewiseError(f"{name}: {type_name} {part} hold NaN or infinite values")


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
    from stagewise.stages.packed_weight import is_packed

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


def prepare_for(weights, tiers: dict[str, str]) -> None:
    """Build the torch tier's forms at load (not on the first token) for the packed weights whose
    stage runs that tier on the CPU (`tiers`: stage -> tier, `StageOps.backends`).

    Building a form releases the file-layout codes (held once, `packed_weight.py`), so a weight
    another tier reads (a naive LM head beside torch projections, an untied table that is only
    gathered) is left as it is: that tier reads the file's codes, not codes rebuilt per call.
    """
    from stagewise.stages import dequant_gemm_torch
    from stagewise.stages.packed_parts import packed_leaves
    from stagewise.stages.packed_weight import is_packed

    stage_of = {"w_qkv": "qkv_proj", "w_o": "o_proj", "w_gate_up": "ffn", "w_down": "ffn"}
    torch_stages = {stage for stage, tier in tiers.items() if tier == "torch"}
    picked = [weights.lm_head] if "lm_head" in torch_stages else []
    for lw in weights.layers:
        picked += [getattr(lw, name) for name, stage in stage_of.items() if stage in torch_stages]
    for packed in {id(w): w for w in picked if is_packed(w)}.values():
        for w in packed_leaves(packed):  # a PackedParts: each part its own form
            if w.device.type == "cpu":
                dequant_gemm_torch.prepare(w)  # the form built, the file-layout codes released
    dequant_gemm_torch.return_freed_memory()
