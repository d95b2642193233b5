"""CPU kernels written in C++, for what PyTorch's stock CPU kernels do not do well.

    int8_dot.cpp   a packed-weight GEMM by integer dot products (and a read probe)
    attention.cpp  attention over the paged KV cache: every query row in one loop over its keys
    rows.cpp       RMSNorm (after the residual add) and RoPE, one call per step's rows
    build.py       compiles them into one library once per machine with the system's C++
                   compiler, keeps it in the cache folder, loads it with ctypes
    int8_dot.py, attention.py, rows.py
                   the Python side: the arithmetic stated, the launchers the torch tier calls
                   (`stages/dequant_gemm_torch.py`, `paged_attention_torch.py`,
                   `attention_torch.py`, `rmsnorm_torch.py`, `rope_torch.py`)

Nothing here is needed to run stagewise, and nothing here runs unless asked
(STAGEWISE_CPU_KERNELS=1, `build.py` says why): by default, or without a compiler (one line says
so), the torch tier uses PyTorch's own kernels.
"""
