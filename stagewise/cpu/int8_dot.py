"""The packed-weight GEMM by integer dot products: llama.cpp's arithmetic, one kernel for every M.

    x [M, K] float @ packed w [K, N] -> [M, N] float32

A GGUF weight is blocks of 32 small integer codes q with a float scale d (and a minimum m):
w = d (q - 8) for q4_0, d q + m for q4_1 (`quant/packed_weight.py`). Multiplying by it in floats
means turning every code back into a float first. llama.cpp does the other thing: it turns the
*activations* into blocks of small integers too, and then a block's dot product is integer
arithmetic, which the CPU does 32 products at a time (AVX2's `vpmaddubsw`, VNNI's `vpdpbusd`):

    1. each block of 32 activations, x[m, 32b : 32b + 32], becomes int8 codes and one scale:
           amax = max |x|,   dx = amax / 127,   xq = round_half_even(x * (127 / amax))
       (|xq| <= 127; a block of zeros has dx = 0), and s = sum(xq);
    2. the block's dot product with the weight's codes is an int32, *exact*:
           isum[b] = sum_j q_j xq_j            (q4_0: minus 8 s, the codes' offset)
    3. the float part, one chain per output over the blocks in order, whatever M, the threads or
       the instruction set:
           t_b = float(isum[b]) * (d_w[b] * dx[b])  (+ m_w[b] * (dx[b] * s[b]) with minimums)
           acc = acc + t_b        for b = 0, 1, 2, ...,  out = acc

Why the result is batch-invariant (DESIGN.md): step 1 is per row; step 2 is exact, so it may be
computed in any order, by any instructions, in any tiling over rows and columns — that is where
all the speed is; step 3 is the same float operations in the same order for every output, written
once per path in C++ and compiled without fused multiply-adds. A row's bits are the same for M = 1
(decode) and M = 2048 (a prefill chunk), at any slot and any thread count, and equal to
`reference` below, which computes steps 1-3 with plain PyTorch ops (the tests compare them with
`torch.equal`, for every build: AVX-512 VNNI, AVX2 and plain C).

What it changes against the float formula: the activations are rounded to 8 bits per block (an
error of up to dx / 2 per number) where PyTorch's int4 kernel rounds them to bfloat16 (8 bits of
mantissa per number). `stagewise bench perplexity` measures what that does to a model; llama.cpp
has shipped this arithmetic for years.

The kernel (`int8_dot.cpp`) reads the weight in the "rows8" form (`quant/rows8.py`: 8 rows
interleaved, so one instruction advances 8 outputs; the file's codes, moved, not rounded), built
once at load by the torch tier (`stages/dequant_gemm_torch.py`) and kept on disk with the other
repacked forms. Kinds: q4_0, q4_1, q8_0 and the K-quants q4_k and q5_k (groups of 32); q6_k's
groups of 16 keep PyTorch's kernels. `build.py` says where the library is built and kept.
"""

import time

import torch

from stagewise.cpu import build
from stagewise.errors import StagewiseError
from stagewise.quant import rows8
from stagewise.quant.dequantize import unpack_codes
from stagewise.quant.packed_weight import PackedWeight

BLOCK = 32  # activations per int8 block (and the weights' group size this kernel reads)
KIND_IDS = {"q4_0": 0, "q4_1": 1, "q8_0": 2, "q4_k": 3, "q5_k": 4}  # int8_dot.cpp's `Kind`


def available(variant: str = "native") -> bool:
    """Whether the compiled kernel can run here (built now if need be)."""
    return build.library(variant) is not None


def serves(w: PackedWeight) -> bool:
    """Whether this kernel multiplies by w: its kind, groups of 32, on the CPU, and built."""
    if getattr(w, "kind", None) not in KIND_IDS or not rows8.has_form(w):
        return False
    return w.device.type == "cpu" and available()


def gemm(x: torch.Tensor, w: PackedWeight, variant: str = "native") -> torch.Tensor:
    """x [M, K] @ packed w [K, N] -> [M, N] float32 (steps 1-3 above); the rows8 form is the one
    the torch tier built (`w.prepared`), or packed now for this call."""
    form = w.prepared.get("torch")
    form = form[0] if isinstance(form, tuple) and len(form) == 1 else rows8.pack(w)
    return gemm_form(x, form, w.kind, w.shape[1], variant)


def gemm_form(
    x: torch.Tensor, form: torch.Tensor, kind: str, n: int, variant: str = "native"
) -> torch.Tensor:
    """x [M, K] @ a weight [K, N] in rows8 form [ceil(N/8), K/32, chunk] -> [M, N] float32."""
    lib = build.loaded(variant)  # a rows8 form was built while the switch was on: keep using it
    if lib is None:
        raise StagewiseError(f"the int8-dot kernel is not built here ({build.describe(variant)})")
    if kind not in KIND_IDS:
        raise StagewiseError(f"int8_dot: {kind} is not served; served: {', '.join(KIND_IDS)}")
    k = form.shape[1] * BLOCK
    expected = (-(-n // rows8.ROWS), k // BLOCK, _chunk_bytes(lib, kind))
    if form.dtype != torch.uint8 or form.shape != expected or not form.is_contiguous():
        raise StagewiseError(
            f"int8_dot: a {kind} rows8 form for N = {n} must be contiguous uint8 {list(expected)}, "
            f"got {form.dtype} {list(form.shape)}"
        )
    if x.dim() != 2 or x.shape[1] != k:
        raise StagewiseError(f"int8_dot: x must be [M, {k}], got {list(x.shape)}")
    if x.dtype != torch.float32 or not x.is_contiguous():  # (a call saved where it already is)
        x = x.to(torch.float32).contiguous()  # [M, K]
    out = torch.empty(x.shape[0], n, dtype=torch.float32)  # [M, N]
    status = lib.sw_int8_gemm(
        KIND_IDS[kind],
        x.shape[0],
        n,
        k,
        x.data_ptr(),  # [M, K] float32
        form.data_ptr(),  # [ceil(N/8), K/32, chunk] uint8
        out.data_ptr(),  # [M, N] float32
        torch.get_num_threads(),
    )
    if status:
        raise StagewiseError(f"int8_dot failed ({'out of memory' if status == -2 else status})")
    return out


_CHUNKS: dict[tuple[int, str], int] = {}  # (library, kind) -> bytes per rows8 chunk


def _chunk_bytes(lib, kind: str) -> int:
    key = (id(lib), kind)
    if key not in _CHUNKS:
        _CHUNKS[key] = lib.sw_rows8_chunk_bytes(KIND_IDS[kind])
    return _CHUNKS[key]


# ---- the same bits with plain PyTorch ops: the definition, for reading and for the tests ----


def quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 1. x [M, K] float32 -> codes xq [M, K/32, 32] int32, dx [M, K/32], s [M, K/32] int32."""
    blocks = x.to(torch.float32).reshape(x.shape[0], -1, BLOCK)  # [M, K/32, 32]
    amax = blocks.abs().amax(dim=-1)  # [M, K/32]
    dx = amax / 127.0
    inv = torch.where(amax != 0, 127.0 / amax, torch.zeros_like(amax))
    xq = torch.round(blocks * inv[..., None]).to(torch.int32)  # half to even, like the kernel
    return xq, dx, xq.sum(dim=-1)


def reference(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """x [M, K] @ packed w [K, N] -> [M, N] float32: steps 1-3, the kernel's exact bits."""
    xq, dx, s = quantize_blocks(x)  # [M, B, 32], [M, B], [M, B]
    q = unpack_codes(w).to(torch.int64)  # [N, B, 32] codes as stored (q4_0: 0..15)
    isum = torch.einsum("mbj,nbj->mnb", xq.to(torch.int64), q)  # [M, N, B], exact
    if w.kind == "q4_0":
        isum = isum - 8 * s[:, None, :]  # the offset: sum (q - 8) xq = sum q xq - 8 s
    dw = w.scales.to(torch.float32)  # [N, B]
    t = isum.to(torch.float32) * (dw[None] * dx[:, None])  # [M, N, B]
    if w.mins is not None:
        t = t + w.mins.to(torch.float32)[None] * (dx * s.to(torch.float32))[:, None]
    acc = torch.zeros(t.shape[:2])  # [M, N]
    for b in range(t.shape[-1]):  # one chain over the blocks, in order
        acc = acc + t[:, :, b]
    return acc


# ---- how fast memory can be read, the way a decode step reads packed weights ----


def stream_read_bandwidth(nbytes: int, threads: int, repeats: int = 5) -> float | None:
    """Bytes/s of `threads` threads each streaming its share of an nbytes buffer with 32-byte
    loads (the compiled probe; the median of `repeats` after one warm-up), None without it."""
    lib = build.library()
    if lib is None:
        return None
    buffer = torch.ones(nbytes, dtype=torch.uint8)
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        lib.sw_stream_read(buffer.data_ptr(), nbytes, threads)
        if i:
            times.append(time.perf_counter() - start)
    return nbytes / sorted(times)[len(times) // 2]
