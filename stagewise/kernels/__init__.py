"""Triton kernels, one module per kernel family; the stages import them lazily.

Importing this package first decides where Triton runs (`runtime.configure_triton`):
on a CUDA GPU, or — with no GPU — in Triton's CPU interpreter, which must be
switched on before any `@triton.jit` function is defined.
"""

from stagewise.runtime import configure_triton

# "cuda", "interpreter" or "compile" (ahead-of-time only: the compile gate)
TRITON_MODE = configure_triton()
INTERPRETER = TRITON_MODE == "interpreter"
