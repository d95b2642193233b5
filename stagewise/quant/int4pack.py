"""PyTorch's CPU int4pack layout, and its exact inverse: packed bytes -> one code per number.

The torch tier's 4-bit kernel (`_weight_int4pack_mm_for_cpu`) reads its weight
in a layout of its own, built by `_convert_weight_to_int4pack_for_cpu` from
codes q [N, K] (int32, 0..15). The result is [N, K/2] uint8, the same bytes a
GGUF file's codes take, but in another order. Reading the kernel's source
(aten/src/ATen/native/cpu/int4mm_kernel.cpp) and packing known codes give it:

    the N rows are cut into blocks of B rows (B = 4 vector registers of
    float32: 64 with AVX-512, 32 with AVX2, 32 without vectors); the last
    block holds what is left (16, 32 or 48 rows: N must be a multiple of 16)

    block b (nb rows) is K x nb/2 bytes, k-major: for each input k, nb/2
    bytes hold the nb codes q[b B + r, k], two to a byte

    which two share a byte, inside one k: with AVX-512 and a full block,
    byte d (d < 16) holds rows d (low nibble) and d + 32 (high), byte
    16 + d holds rows 16 + d and 48 + d, so one 256-bit load and a shift
    yield 64 codes; otherwise (a short block, or no AVX-512/AVX2's own
    pairing) byte j holds rows 2j and 2j + 1 (AVX2's full block: j and j + 16)

So a row's K codes are spread out: row n's code for input k sits at byte
block_start + k * nb/2 + (its place in the k-slice) / 2, every nb/2 bytes.
Nothing is lost: each code keeps its 4 bits, so the inverse is exact.

Which pairing a machine uses depends on its CPU's vector width, so this file
does not hard-code it: `_slice_order(nb)` packs one probe (codes that name
their own row) and reads the order back, once per block size. That also makes
the inverse follow the kernel if it changes.
"""

import functools

import torch

INNER_K_TILES = 2  # the int4pack layout's K tiling (the CPU kernel accepts 1, 2, 4, 8: same bytes)
PROBE_K = 64  # the smallest K the packing takes (K must be a multiple of 32 x INNER_K_TILES)


def pack(q: torch.Tensor) -> torch.Tensor:
    """codes [N, K] 0..15 -> the CPU kernel's layout [N, K/2] uint8 (PyTorch's own packing)."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), INNER_K_TILES)


def block_rows() -> int:
    """B, this CPU's block of rows in the layout (64 with AVX-512, 32 otherwise): part of the key
    under which repacked weights are kept on disk (`tuning/packed_forms_cache.py`)."""
    return _block_rows()


@functools.cache
def _block_rows() -> int:
    """B, the rows of a full block: codes q[n, k] = k (k < 16) show where input 1 starts."""
    n = 256  # more rows than any vector width's block
    q = torch.arange(PROBE_K, dtype=torch.int32).clamp(max=15).expand(n, PROBE_K)
    first = pack(q).flatten()[: n // 2]  # bytes of block 0: k = 0 for B/2 bytes, then k = 1
    return 2 * int((first == 0).sum())  # bytes holding two codes of input 0, times 2


@functools.cache
def _slice_order(nb: int) -> torch.Tensor:
    """[nb] int64: which row of an nb-row block each nibble of one k-slice holds.

    Nibble 2j is byte j's low half, 2j + 1 its high half. Found by packing rows whose codes
    name them: once with the row number's low 4 bits, once with its high bits.
    """
    rows = torch.arange(nb, dtype=torch.int32)[:, None].expand(nb, PROBE_K)  # q[r, k] = r
    order = torch.zeros(nb, dtype=torch.int64)
    for shift in (0, 4):  # nb <= 256: two 4-bit digits name every row
        digit = pack((rows >> shift) & 15).flatten()[: nb // 2]  # [nb/2] bytes: block 0, k = 0
        nibbles = torch.stack([digit & 15, digit >> 4], dim=1).flatten()  # [nb]: low, high, ...
        order |= nibbles.to(torch.int64) << shift
    return order


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The exact inverse of `pack`: [N, K/2] uint8 -> codes [N, K] uint8, 0..15."""
    n, k = packed.shape[0], 2 * packed.shape[1]
    b = _block_rows()
    flat = packed.flatten()
    parts = []
    full, tail = divmod(n, b)  # full blocks of B rows, then one of `tail` rows (or none)
    for blocks, nb, start in ((full, b, 0), (1 if tail else 0, tail, full * b * k // 2)):
        if not blocks:
            continue
        block = flat[start : start + blocks * k * nb // 2].view(blocks, k, nb // 2)  # k-major
        nibbles = torch.stack([block & 15, block >> 4], dim=3).view(blocks, k, nb)  # slice order
        rows = nibbles[:, :, torch.argsort(_slice_order(nb))]  # [blocks, K, nb]: row order
        parts.append(rows.transpose(1, 2).reshape(blocks * nb, k))  # [blocks * nb, K]
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def unpack_rows(packed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Codes of some rows only: [N, K/2] packed, rows [T] -> [T, K] uint8 (T x K bytes read)."""
    n, k = packed.shape[0], 2 * packed.shape[1]
    b = _block_rows()
    rows = rows.to(torch.int64).flatten()
    block, local = rows // b, rows % b  # [T] each
    nb = torch.clamp(n - block * b, max=b)  # [T]: rows of each one's block
    place = torch.empty_like(rows)  # [T]: its nibble's place inside a k-slice
    for size in nb.unique().tolist():
        where = nb == size
        place[where] = torch.argsort(_slice_order(size))[local[where]]
    # byte of (row, k): its block's start + k * nb/2 + place/2, for every k
    ks = torch.arange(k, dtype=torch.int64)  # [K]
    at = (block * b * k // 2)[:, None] + ks[None, :] * (nb // 2)[:, None] + (place // 2)[:, None]
    byte = packed.flatten()[at]  # [T, K]
    return torch.where((place % 2 == 0)[:, None], byte & 15, byte >> 4)  # [T, K] codes
