"""The PyTorch GEMM behind every projection stage: `x @ w`, laid out for the CPU's BLAS.

    x [M, K] @ w [K, N] -> [M, N]        (M = tokens in the step, K = in features, N = out features)

Mathematically this is one line, `x @ w`, and on a GPU (or for large M) that
is exactly what runs. On a CPU, decode makes M tiny (1 token per running
request), and how the BLAS library is asked matters more than the FLOPs:
measured on a 2-core AMD EPYC with torch 2.13 / MKL, reading all 538 MB of
SmolLM2-135M's weights once (30 layers + LM head, float32, cold caches):

    M   x @ w  (w row-major [K, N])    w_t @ x^T  (w_t row-major [N, K])
    1   30.8 ms   (17.5 GB/s)           16.6 ms  (32.5 GB/s) with M padded to 2
    2   47.6 ms                         15.9 ms
    8   82.8 ms                         43.0 ms
   64   ~same                           ~same;  M >= 128: x @ w is faster

The second form asks for the transposed product C^T = w_t @ x^T: a tall,
skinny GEMM (N rows of weights, M columns of activations) that streams every
weight row once. In this BLAS it runs at close to the machine's read
bandwidth (~32 GB/s for a plain `sum` over 512 MB), while the first form's
small-M path and the single-vector GEMV path (M = 1) reach about half of it.
A lone decode row is therefore duplicated into two columns: the extra column
costs arithmetic, not weight traffic. The product needs `w` stored
"out-major" ([N, K] row-major, the layout of PyTorch's nn.Linear, GGUF and
safetensors files) and seen as a [K, N] view; `LlamaWeights.to` stores
projections that way on the CPU (`models/weights.py`). These are measured
properties of one BLAS build, not laws: `stagewise bench modes` shows what
they buy end to end. For any other layout, device or M it is plain `x @ w`.
"""

import torch

SMALL_M = 64  # up to this many rows the transposed product wins on CPU (table above)


def gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [K, N] -> [M, N], contiguous."""
    m = x.shape[0]
    out_major = w.dim() == 2 and w.stride(0) == 1 and w.stride(1) == w.shape[0]  # w = w_t.t(), w_t [N, K] row-major
    if x.device.type != "cpu" or not out_major or m == 0 or m > SMALL_M:
        return x @ w  # [M, K] @ [K, N] -> [M, N]
    cols = torch.cat([x, x]) if m == 1 else x  # [max(M, 2), K]: one decode row becomes two columns
    out_t = w.t() @ cols.t()  # [N, K] @ [K, M'] -> [N, M']: C^T, the tall-skinny product
    return out_t[:, :m].t().contiguous()  # [N, M] -> [M, N]
