"""Which precision a kernel's `tl.dot` runs in (one policy for every kernel), and bf16 rounding.

The kernels with dots (matmul, flash_attention, paged_attention) all ask
`dot_policy(dtype)` at launch and pass its two answers as constexprs:

    inputs   on a GPU                                      in the CPU interpreter
    fp32     TF32 if PyTorch allows it for fp32 matmuls,    full fp32 (the interpreter has no TF32)
             else full fp32 ("ieee")
    fp16     fp16 tensor-core dots, fp32 accumulation        fp16 operands, fp32 accumulation
    bf16     bf16 tensor-core dots, fp32 accumulation        tiles upcast to fp32 after the load

The fp32 switch is PyTorch's own, `torch.backends.cuda.matmul.allow_tf32`
(`torch.set_float32_matmul_precision("high")` turns it on, "highest" — the
default — off), read at every launch: a Triton kernel's fp32 dots then round
like `torch.matmul` on the same tensors. TF32 keeps 10 of fp32's 23 mantissa
bits of each operand (a product is off by up to ~2^-10 relative; a dot of N(0, 1)
values by ~1e-3 of its size), IEEE keeps all 23.

Why bf16 is upcast in the interpreter and fp16 is not: the interpreter's bf16
arithmetic and bf16 `tl.dot` are wrong (numpy has no bf16), while its fp16 dot
multiplies the fp16 operands exactly and sums in fp32 like a tensor core. So the
16-bit dot branch of every kernel runs in CI through fp16 inputs. The interpreter's
fp32 -> bf16 cast also truncates instead of rounding to nearest even, so a kernel
storing bf16 there rounds by hand first (`round_to_bf16`).
"""

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from stagewise.kernels import INTERPRETER

# Triton's default input_precision; it changes nothing for 16-bit operands
DEFAULT_16BIT_PRECISION = "tf32"


@dataclass(frozen=True)
class DotPolicy:
    # the dots take fp32 tiles: fp32 inputs, or bf16 tiles upcast after the load (interpreter)
    fp32_dots: bool
    # tl.dot's input_precision: "ieee" or "tf32" for fp32 tiles (16-bit tiles ignore it)
    input_precision: str


def tf32_allowed() -> bool:
    """PyTorch's switch for fp32 matmuls on CUDA: True lets them use TF32 tensor cores."""
    return bool(torch.backends.cuda.matmul.allow_tf32)


def dot_policy(dtype: torch.dtype, interpreter: bool = INTERPRETER) -> DotPolicy:
    """The dot precision for inputs of `dtype` (fp32, bf16 or fp16), on a GPU or the interpreter.

    Every GEMM and attention launch asks, so the answer is kept per (dtype, interpreter, TF32
    switch); the switch is read on each call (a program may flip it), and only for fp32.
    """
    use_tf32 = dtype == torch.float32 and not interpreter and tf32_allowed()
    return _dot_policy(dtype, interpreter, use_tf32)


@functools.cache
def _dot_policy(dtype: torch.dtype, interpreter: bool, use_tf32: bool) -> DotPolicy:
    if dtype == torch.float32:  # the interpreter computes full fp32 whatever it is told
        return DotPolicy(fp32_dots=True, input_precision="tf32" if use_tf32 else "ieee")
    if dtype == torch.bfloat16 and interpreter:
        return DotPolicy(fp32_dots=True, input_precision="ieee")
    return DotPolicy(fp32_dots=False, input_precision=DEFAULT_16BIT_PRECISION)


@triton.jit
def round_to_bf16(x):
    """fp32 -> fp32 holding the nearest bf16 (ties to even), so a following truncating cast is
    exact.

    Only needed under the interpreter, whose fp32 -> bf16 cast drops the low bits instead of
    rounding.
    """
    bits = x.to(tl.uint32, bitcast=True)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.to(tl.float32, bitcast=True)
