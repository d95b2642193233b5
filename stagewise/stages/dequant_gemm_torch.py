"""The torch tier of the dequantize-GEMM: compiled CPU kernels that read packed weights.

    x [M, K] @ packed w [K, N] -> [M, N]

Opt-in (STAGEWISE_CPU_KERNELS=1, where a C++ compiler is at hand; q4_0, q4_1, q8_0, q4_k,
q5_k): the integer-dot GEMM of `cpu/int8_dot.py` — llama.cpp's arithmetic (activations to int8
per block of 32, exact integer block sums, one float chain per output over the blocks), one
kernel for every M, built once per machine (`cpu/build.py`). It reads the "rows8" form
(`quant/rows8.py`), built here at load from the file's codes (which are then released). Every M
gives a row the same bits; its speed
against PyTorch's int4 kernel is in benchmarks/README.md (`python -m
stagewise.bench.scripts.packed_gemm` measures it). Its rounding is another one: activations to 8
bits per block instead of bfloat16, which moves greedy near-ties more often (`cpu/build.py`,
`bench perplexity`): that is why it is opt-in.

By default (and without a compiler, or for q6_k), PyTorch's stock kernels:

4-bit (q4_0, q4_1): `torch.ops.aten._weight_int4pack_mm_for_cpu`, the kernel
behind gpt-fast / torchao's int4 weight-only CPU path. It reads four-bit codes
from its own tiled layout (built once, `_convert_weight_to_int4pack_for_cpu`)
and per group a (scale, zero) pair in bfloat16, with the rule

    w = (q - 8) * scale + zero

which holds both GGUF 4-bit formats exactly: q4_0 (d * (q - 8)) is scale = d,
zero = 0; q4_1 (d * q + m) is scale = d, zero = m + 8 d. What changes is the
rounding: scale and zero are rounded to bfloat16 (8 bits of mantissa, the file
keeps d and m in float16 with 11) and so are the activations, and the kernel
accumulates in float32.

8-bit (q8_0): the stock int8 kernel (`_weight_int8pack_mm`) takes one scale
per *output row*, which cannot hold q8_0's scale per group of 32. Instead each
signed 8-bit code is split into two 4-bit ones, so the int4 kernel serves it:

    q = 16 * (h - 8) + l     with   h = (q >> 4) + 8,  l = q & 15   (both 0..15)
    d * q = (h - 8) * (16 d) + ((l - 8) * d + 8 d)

A matrix [K, N] becomes one of [2K, N]: the K high nibbles with scale 16 d and
zero 0, then the K low nibbles with scale d and zero 8 d; the activations are
repeated, x' = [x | x] [M, 2K], and x' @ w' = x @ w. The split is exact; the
rounding is the int4 kernel's (d to bfloat16). It holds 0.56 bytes per weight
(a bfloat16 copy would hold 2) and streamed them about twice as fast as
bfloat16 `F.linear` where it was measured; re-rounding to int8 with one scale
per row instead was slower and doubled the error (benchmarks/README.md, "CPU
tier notes", has the numbers). Where N is not a multiple of 16 the int4
kernel cannot take the matrix and the values are expanded once to a bfloat16
copy for `F.linear` instead.

Batch invariance (the project's design notes): the int4 kernel computes each output as one
float32 chain over K, so a row's bits are the same for every M (swept in
tests/stages/test_batch_invariance_ops.py, M = 1..2048, the LM head's width
too; a property of the pinned torch 2.13). oneDNN's bfloat16 `F.linear` is
not: from K = 2048 (at N = 3000, say) one row takes another kernel than two.
So a bfloat16 copy's rows are padded to a multiple of ROW_MULTIPLE (4), where
every M gives the same bits, and so are those of the float32 product that
serves a 4-bit weight the int4 kernel cannot take (N not a multiple of 16);
`gemm_variant` (`batch_invariant=False`) runs them as they are.

K-quants (`quant/packed_weight.py`): q4_k is q4_1's layout with float32 scales, so
int4pack holds it (scale and zero rounded to bfloat16, as for q4_1); q5_k's
codes 0..31 split into two nibbles like q8_0's, its minimum added to the low
half's zero; q6_k's groups of 16 are below the int4 kernel's smallest group
(32), so it is expanded once to a bfloat16 copy (2 bytes per weight held:
the speed of bf16 `F.linear`, not of 4-bit reads).

Why bfloat16 activations: with float32 activations both kernels take a slow
path, about ten times slower than with bfloat16 ones where it was measured
(benchmarks/README.md, "CPU tier notes").

The prepared forms live in `w.prepared` (built on the first call, or at load
by `prepare`); off the CPU, this tier is the naive one. An int4pack form (the
4-bit kinds, q8_0 and q5_k's two halves) holds every code exactly, so once it
is built the file-layout codes are released (`PackedWeight.release_codes`):
the weight is held once, in the layout this tier reads, and rebuilt from it
(`int4pack.unpack`) only if another tier asks. A bfloat16 copy (q6_k) rounds,
so there the codes stay beside it.
"""

import ctypes

import torch
import torch.nn.functional as F

from stagewise.cpu import int8_dot
from stagewise.quant import int4pack, rows8
from stagewise.quant.dequantize import dequantize, dequantize_rows, unpack_codes
from stagewise.quant.packed_weight import PackedWeight
from stagewise.tuning.gemm_forms import ROW_MULTIPLE, padded_rows


def _int4pack(w: PackedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes in the CPU kernel's layout [N, K/2] uint8, scale_and_zero [K/G, N, 2] bf16)."""
    q = unpack_codes(w).flatten(1)  # [N, K/G, G] -> [N, K] int32 codes 0..15
    packed = int4pack.pack(q)  # [N, K/2] uint8 in the kernel's order (quant/int4pack.py)
    d = w.scales.to(torch.float32)  # [N, K/G]
    zero = torch.zeros_like(d) if w.mins is None else w.mins.to(torch.float32) + 8 * d
    scale_zero = torch.stack([d, zero], dim=-1).transpose(0, 1)  # [N, K/G, 2] -> [K/G, N, 2]
    return packed, scale_zero.to(torch.bfloat16).contiguous()


def _q8_nibbles(w: PackedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """q8_0 [K, N] as the int4 kernel's [2K, N]: high nibbles (scale 16 d), then low (8 d zero).

    q5_k (codes 0..31 and a minimum m) splits the same way, with m added to the low half's zero.
    """
    q = w.codes.to(torch.int32)  # [N, K] signed codes -128..127 (q5_k: 0..31)
    high, low = (q >> 4) + 8, q & 15  # q = 16 * (high - 8) + low, both 0..15
    packed = int4pack.pack(torch.cat([high, low], dim=1))  # [N, 2K] codes -> [N, K] uint8
    d = w.scales.to(torch.float32)  # [N, K/G]
    scale = torch.cat([16 * d, d], dim=1)  # [N, 2K/G]: high groups, then low groups
    low_zero = 8 * d if w.mins is None else 8 * d + w.mins.to(torch.float32)
    zero = torch.cat([torch.zeros_like(d), low_zero], dim=1)
    scale_zero = torch.stack([scale, zero], dim=-1).transpose(0, 1)  # [2K/G, N, 2]
    return packed, scale_zero.to(torch.bfloat16).contiguous()


def _bf16_rows(w: PackedWeight) -> torch.Tensor:
    """The 8-bit weight expanded once to bfloat16, [N, K] row-major (F.linear's weight)."""
    return dequantize_rows(w).to(torch.bfloat16).contiguous()


def _rows8(w: PackedWeight) -> tuple[torch.Tensor]:
    """The integer-dot kernel's form: [ceil(N/8), K/32, chunk] uint8 (`quant/rows8.py`)."""
    return (rows8.pack(w),)


def supported(w: PackedWeight) -> bool:
    """The CPU kernels' shapes: any for the integer-dot kernel and for 8-bit (a bf16 copy where
    N % 16), N % 16 == 0 for 4-bit in PyTorch's int4 kernel."""
    return w.device.type == "cpu" and (w.bits == 8 or w.shape[1] % 16 == 0 or int8_dot.serves(w))


def form_name(w: PackedWeight) -> str:
    """Which form this tier uses for w: "rows8" (the integer-dot kernel), else "int4pack",
    "q8_nibbles" (int4pack of 2K) or "bf16"."""
    if int8_dot.serves(w):
        return "rows8"
    if w.shape[1] % 16 or w.group_size not in (32, 64, 128, 256):
        return "bf16"  # the int4 kernel's groups are 32..256 values: q6_k's 16 are not
    return "int4pack" if w.bits == 4 else "q8_nibbles"


def form_layout(w: PackedWeight) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The (shape, dtype) of each tensor of w's form, before it is built (a cached form is checked
    against it): int4pack [N, K/2] uint8 + [K/G, N, 2] bf16; q8_nibbles the same over 2K;
    bf16 [N, K]."""
    k, n, g = w.shape[0], w.shape[1], w.group_size
    name = form_name(w)
    if name == "rows8":
        return [((-(-n // rows8.ROWS), k // rows8.BLOCK, rows8.chunk_bytes(w)), torch.uint8)]
    if name == "bf16":
        return [((n, k), torch.bfloat16)]
    k_codes = k if name == "int4pack" else 2 * k  # two nibbles per 8-bit code
    return [((n, k_codes // 2), torch.uint8), ((k_codes // g, n, 2), torch.bfloat16)]


def prepare(w: PackedWeight) -> PackedWeight:
    """Build this tier's form of w once (kept in `w.prepared`), then drop the file-layout codes
    where the form holds them exactly (int4pack forms; a bf16 copy keeps them); returns w."""
    if not supported(w) or "torch" in w.prepared:
        return w
    build = {"rows8": _rows8, "int4pack": _int4pack, "q8_nibbles": _q8_nibbles, "bf16": _bf16_rows}
    w.prepared["torch"] = build[form_name(w)](w)
    w.release_codes()  # held once: `w.codes` is rebuilt from the form if another tier asks
    return w


def return_freed_memory() -> None:
    """Give the memory freed while building the forms back to the operating system.

    Building a form makes temporaries (the codes as int32, 4 bytes a code) and releases the
    file's codes; glibc's allocator keeps freed blocks below its mmap threshold (up to 32 MB) in
    its heap for reuse, so the process's resident memory would stay near its peak (SmolLM2:
    ~300 MB added by load instead of ~145). `malloc_trim(0)` hands the free pages back; without
    glibc it is skipped.
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim this way
        pass


def takes_bfloat16(w: PackedWeight) -> bool:
    """Whether this tier's kernel for w computes from bfloat16 activations (PyTorch's int4 and
    bf16 kernels, not the integer-dot one), so a caller may keep activations in bfloat16."""
    form = w.prepared.get("torch")
    if form is not None:
        return not (isinstance(form, tuple) and len(form) == 1)  # anything but rows8
    return supported(w) and form_name(w) != "rows8"


def gemm(x: torch.Tensor, w: PackedWeight, batch_invariant: bool = True) -> torch.Tensor:
    """x [M, K] @ packed w [K, N] -> [M, N] in x's dtype, by the CPU kernels."""
    form = w.prepared.get("torch")
    if form is None and (x.device.type != "cpu" or not supported(w)):
        rows = padded_rows(x, ROW_MULTIPLE) if batch_invariant else x  # [M', K]
        return (rows @ dequantize(w).to(x.dtype))[: x.shape[0]]  # dequantize, then [M, N]
    if form is None:
        form = prepare(w).prepared["torch"]
    if isinstance(form, tuple) and len(form) == 1:  # rows8: the integer-dot kernel, every M
        return int8_dot.gemm_form(x, form[0], w.kind, w.shape[1]).to(x.dtype)  # [M, N]
    xb = x.to(torch.bfloat16)  # [M, K]: the kernels' fast path takes bfloat16 activations
    if isinstance(form, tuple):  # an int4pack form: 4-bit codes, or q8_0 split in two nibbles
        packed, scale_zero = form
        if w.bits == 8:
            xb = torch.cat([xb, xb], dim=1)  # [M, K] -> [M, 2K]: once per nibble half
        # [M, K'] @ int4 [K', N] -> [M, N] bf16, float32 accumulation inside
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, w.group_size, scale_zero)
    elif batch_invariant:  # rows padded: oneDNN's many-row kernel for every M
        out = F.linear(padded_rows(xb, ROW_MULTIPLE), form)[: x.shape[0]]  # [M, K] -> [M, N] bf16
    else:
        out = F.linear(xb, form)  # [M, K] @ [N, K]^T -> [M, N] bf16
    return out.to(x.dtype)


def gemm_variant(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """`gemm` with `batch_invariant=False`: a bfloat16 copy's rows as they are."""
    return gemm(x, w, batch_invariant=False)
