"""Where a launch runs, and what that target allows: shared memory per block, dtypes, tile choices.

A kernel launch is a set of choices (tile sizes, warps, pipeline stages) that
must fit the GPU it runs on. The binding limit is usually shared memory: with
`num_stages` software pipelining Triton keeps about `num_stages - 1` copies of
each tile a loop loads, so a tile that fits an H100 (227 KB per block) can be
twice what an RTX 4090 offers (99 KB). Registers are the other limit: 255 per
thread; a bigger tile spills the rest to (slow) local memory.

`Target` names the machine a launcher plans for: Triton's CPU interpreter
(no shared memory, no warps: the plan only keeps the interpreter fast), or a
CUDA GPU by compute capability (80 = A100, 89 = RTX 4090 / L4, 90 = H100 / H200,
75 = T4). Launchers pass it to their `*_plan` functions, and the compile gate
(`stagewise.devtools.compile_gate`) passes each GPU target in turn, with no GPU
present, to compile exactly what a launcher would launch there.

Pre-Ampere (compute capability < 8.0): Triton supports 8.0+ officially, and
those GPUs have no bfloat16 tensor cores. A kernel the gate proves for sm_75
in float16 (`SM75_FP16`) runs there, best effort, with a warning; anything
else stops with one clear line instead of failing inside Triton.
"""

import functools
import sys
from dataclasses import dataclass

import torch
import triton

from stagewise.errors import StagewiseError

# Shared memory one block may opt in to, in bytes (CUDA programming guide, "compute capabilities"
# table).
SHARED_MEMORY_PER_BLOCK = {
    75: 65536,  # T4 (Turing): 64 KB
    80: 166912,  # A100: 163 KB
    86: 101376,  # RTX 30xx, A10: 99 KB
    87: 166912,  # Jetson Orin
    89: 101376,  # RTX 40xx, L4, L40: 99 KB
    90: 232448,  # H100, H200: 227 KB
    100: 232448,  # B200
    120: 101376,  # RTX 50xx
}
MIN_CAPABILITY = 80  # Triton's supported minimum
BEST_EFFORT_CAPABILITY = 75  # sm_75 in float16: only kernels the compile gate proves
# Kernels the compile gate compiles for sm_75 in float16 within 64 KB and without spilling
# (tests/devtools/test_compile_gate.py).
SM75_FP16 = frozenset(
    {
        "embedding",
        "rmsnorm",
        "rope",
        "kv_store",
        "silu_and_mul",
        "matmul",
        "flash_attention",
        "paged_attention",
    }
    | {"split_k_reduce"}
)


@dataclass(frozen=True)
class Target:
    interpreter: bool  # True: Triton's CPU interpreter (capability unused)
    # CUDA compute capability, 10 * major + minor (90 = H100); 0 under the interpreter
    capability: int = 0
    shared_memory: int = 0  # bytes of shared memory one block may use; 0 under the interpreter

    @property
    def name(self) -> str:
        return "interpreter" if self.interpreter else f"sm_{self.capability}"


INTERPRETER_TARGET = Target(interpreter=True)


@dataclass(frozen=True)
class LaunchPlan:
    """What a launcher decides from host values alone, before it launches (the compile gate compiles
    this)."""

    kernel: str  # the kernel family ("matmul", "paged_attention", ...): error messages, SM75_FP16
    constexprs: dict  # meta-parameters the launcher fixes: block sizes, flags
    # triton.Config tile choices: one = a fixed launch; several = what the GPU autotuner tries
    configs: tuple

    @property
    def autotuned(self) -> bool:
        return len(self.configs) > 1

    def launch_options(self) -> dict:
        """Keyword arguments of a fixed launch: the constexprs, the config's tiles, num_warps and
        num_stages."""
        (config,) = self.configs
        return {
            **self.constexprs,
            **config.kwargs,
            "num_warps": config.num_warps,
            "num_stages": config.num_stages,
        }


def fixed_plan(
    kernel: str, constexprs: dict, num_warps: int = 4, num_stages: int = 3
) -> LaunchPlan:
    """A plan with one config and no tile meta-parameters (row and element-wise kernels)."""
    return LaunchPlan(
        kernel, constexprs, (triton.Config({}, num_warps=num_warps, num_stages=num_stages),)
    )


def fma_dots(dtype: torch.dtype, target: Target) -> bool:
    """Whether tl.dot runs on FMA units, not tensor cores: fp32 (IEEE) dots, and any before sm_80.

    FMA dots keep whole operand rows per thread: such tiles must be smaller to stay in registers.
    """
    return dtype == torch.float32 or target.capability < 80


def gpu_target(capability: int) -> Target:
    """A GPU target by compute capability, with its shared memory from the table above."""
    if capability not in SHARED_MEMORY_PER_BLOCK:
        known = ", ".join(str(c) for c in SHARED_MEMORY_PER_BLOCK)
        raise StagewiseError(f"unknown compute capability {capability}; known: {known}")
    return Target(
        interpreter=False, capability=capability, shared_memory=SHARED_MEMORY_PER_BLOCK[capability]
    )


@functools.cache
def _cuda_target(index: int) -> Target:
    props = torch.cuda.get_device_properties(index)
    capability = 10 * props.major + props.minor
    nearest = max(
        (c for c in SHARED_MEMORY_PER_BLOCK if c <= capability),
        default=min(SHARED_MEMORY_PER_BLOCK),
    )
    shared = getattr(props, "shared_memory_per_block_optin", 0) or SHARED_MEMORY_PER_BLOCK[nearest]
    return Target(interpreter=False, capability=capability, shared_memory=shared)


def launch_target(device: torch.device) -> Target:
    """The target a launch on `device` plans for: the interpreter for CPU tensors, else the CUDA
    device."""
    if device.type != "cuda":
        return INTERPRETER_TARGET
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_target(index)


_warned: set[str] = set()


def checked_target(kernel: str, t: torch.Tensor) -> Target:
    """The target a launch on `t`'s device plans for, once the pre-Ampere policy allows `t`'s dtype
    there."""
    target = launch_target(t.device)
    check_target(kernel, target, t.dtype)
    return target


def check_target(kernel: str, target: Target, dtype: torch.dtype) -> None:
    """The pre-Ampere policy: sm_75 runs the gate-proven kernels in float16, best effort; else a
    clear error."""
    if target.interpreter or target.capability >= MIN_CAPABILITY:
        return
    where = f"compute capability {target.capability // 10}.{target.capability % 10}"
    if target.capability < BEST_EFFORT_CAPABILITY:
        raise StagewiseError(
            f"{kernel}: Triton kernels need compute capability 7.5+, this GPU has {where}"
        )
    if dtype != torch.float16 or kernel not in SM75_FP16:
        raise StagewiseError(
            f"{kernel}: on {where} the Triton kernels run in float16 only (no bfloat16 tensor "
            f"cores, and Triton supports 8.0+); got {str(dtype).removeprefix('torch.')}: "
            "use dtype=torch.float16 or backend='naive'"
        )
    if "sm75" not in _warned:
        _warned.add("sm75")
        print(
            f"stagewise: Triton on {where} is best effort (Triton supports 8.0+); float16 only",
            file=sys.stderr,
        )
