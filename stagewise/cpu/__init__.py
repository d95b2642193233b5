"""CPU kernels written in C++, for what PyTorch's stock CPU kernels do not do well.

    int8_dot.cpp   the source: a packed-weight GEMM by integer dot products (and a read probe)
    build.py       compiles it once per machine with the system's C++ compiler, keeps the
                   library in the cache folder, loads it with ctypes
    int8_dot.py    the Python side: the arithmetic stated, a plain-PyTorch reference of the same
                   bits, the launcher the torch tier calls (`stages/dequant_gemm_torch.py`)

Nothing here is needed to run stagewise, and nothing here runs unless asked
(STAGEWISE_CPU_KERNELS=1, `build.py` says why): by default, or without a compiler (one line says
so), the torch tier uses PyTorch's own kernels.
"""
