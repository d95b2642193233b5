"""The "rows8" layout of a packed weight: 8 rows interleaved, codes and scales side by side.

The compiled integer-dot GEMM (`cpu/int8_dot.cpp`) reads its weight in this form, built once from
a `PackedWeight` (codes [N, K/2] or [N, K] bytes, scales and minimums [N, K/32]):

    form [ceil(N / 8), K / 32, chunk] uint8        octet o = rows 8o .. 8o + 7, block b
    chunk = codes of the 8 rows' block b, then their 8 scales, then their 8 minimums (if any)

    4-bit kinds (q4_0, q4_1, q4_k): codes 128 bytes = [t = 0..3][row j = 0..7][4 bytes], the
        block's bytes 4t .. 4t + 3 of row j (a GGUF block's byte i holds value i in its low
        nibble and value i + 16 in its high one, so those are values 4t..4t+3 and 16+4t..16+4t+3)
    8-bit kinds (q8_0, q5_k): codes 256 bytes = [t = 0..7][row j][4 bytes: values 4t..4t+3]
    scales, minimums: 8 numbers each in the weight's own dtype (float16, or float32 for K-quants)

Why: one 32-byte load gives 4 codes of each of 8 rows, one lane per row, so a dot-product
instruction against 4 activation codes broadcast to all lanes advances 8 outputs at once, and
a row's 8 scales are one load. Streaming the form is one sequential read per octet, the file's
own bytes per weight (q4_0: 8 x 18 bytes per octet and block, as in the file). Rows past N (when
N is not a multiple of 8) are zeros.

Nothing is rounded: `unpack_rows` gives back the file's codes exactly, so once the form is built
the file-layout codes are released (`PackedWeight.release_codes`) and rebuilt from it on demand.
"""

import torch

# `w` below is a `PackedWeight` (packed_weight.py, which reads this module back: no import here)

ROWS = 8  # weight rows per octet
BLOCK = 32  # values per block
KINDS = ("q4_0", "q4_1", "q8_0", "q4_k", "q5_k")  # group size 32, one code per byte or nibble


def code_bytes(bits: int) -> int:
    """Bytes of the 8 rows' codes of one block: 128 (4-bit) or 256 (8-bit)."""
    return ROWS * BLOCK * bits // 8


def chunk_bytes(w) -> int:
    """Bytes per (octet, block): codes, 8 scales, 8 minimums if the kind has them."""
    per_scale = w.scales.element_size()
    return code_bytes(w.bits) + ROWS * per_scale * (2 if w.mins is not None else 1)


def has_form(w) -> bool:
    """Whether w can be held in this form: its kind (below) and groups of 32."""
    return w.kind in KINDS and w.group_size == BLOCK


def _octets(t: torch.Tensor, octets: int) -> torch.Tensor:
    """[N, ...] -> [octets * 8, ...], zero rows appended."""
    missing = octets * ROWS - t.shape[0]
    if not missing:
        return t
    return torch.cat([t, t.new_zeros(missing, *t.shape[1:])])


def pack(w) -> torch.Tensor:
    """The rows8 form of w: [ceil(N / 8), K / 32, chunk] uint8 (the module docstring)."""
    if not has_form(w):
        raise ValueError(f"rows8: {w.kind} with groups of {w.group_size} has no rows8 form")
    k, n = w.shape
    blocks, octets = k // BLOCK, -(-n // ROWS)
    dwords = BLOCK * w.bits // 8 // 4  # per row and block: 4 (4-bit) or 8 (8-bit)
    codes = _octets(w.codes.view(torch.uint8), octets)  # [8 O, K/2 or K] bytes
    codes = codes.view(octets, ROWS, blocks, dwords, 4).permute(0, 2, 3, 1, 4)  # [O, B, t, j, 4]
    parts = [codes.reshape(octets, blocks, dwords * ROWS * 4)]  # [O, B, 128 or 256]
    for numbers in (w.scales, w.mins):
        if numbers is not None:
            per_row = _octets(numbers.contiguous(), octets).view(octets, ROWS, blocks)
            parts.append(per_row.transpose(1, 2).contiguous().view(torch.uint8))  # [O, B, 8 x size]
    return torch.cat(parts, dim=2).contiguous()  # [O, B, chunk]


def unpack_rows(form: torch.Tensor, bits: int, rows: torch.Tensor | None) -> torch.Tensor:
    """The file-layout codes of some rows (all when `rows` is None; then all 8 O rows, the caller
    cuts to N): [T, K/2] uint8 (4-bit) or [T, K] int8 (8-bit), exactly the codes packed."""
    octets, blocks = form.shape[0], form.shape[1]
    dwords = BLOCK * bits // 8 // 4
    codes = form[:, :, : code_bytes(bits)].view(octets, blocks, dwords, ROWS, 4)
    if rows is None:
        picked = codes.permute(0, 3, 1, 2, 4).reshape(octets * ROWS, blocks * dwords * 4)
    else:
        rows = rows.to(torch.int64).flatten()
        by_octet = codes[rows // ROWS]  # [T, B, t, 8, 4]: each row's octet
        picked = by_octet[torch.arange(len(rows)), :, :, rows % ROWS]  # [T, B, t, 4]
        picked = picked.reshape(len(rows), blocks * dwords * 4)
    return picked.contiguous() if bits == 4 else picked.contiguous().view(torch.int8)
