"""The compile gate's child process: compile kernel launches for a GPU target, with no GPU present.

Run as `python -m stagewise.devtools.compile_worker` with `STAGEWISE_TRITON=compile`
and `TRITON_INTERPRET` unset (`compile_gate.worker_env` builds that environment).
It reads JSON lines from stdin, one job each, and writes one JSON line of
results per job to stdout:

    job:    {"id", "module", "kernel", "args": {name: value | {"ptr": "bfloat16"}},
             "num_warps", "num_stages", "capability"}
    result: {"id", "shared", "registers", "spills", "stack", "tensor_cores", "error", "seconds"}

Why a separate process: the CPU interpreter (`TRITON_INTERPRET=1`) replaces
every `@triton.jit` function — ours and Triton's own `tl.sum`, `tl.max`, ... —
by an interpreted one when Triton is imported, and that cannot be undone in a
running process. Here Triton is imported without it, so the kernels stay real
`JITFunction`s that `triton.compile` can lower to PTX and, through the `ptxas`
inside the triton wheel, to a cubin.

How a job is compiled mirrors a real launch: the kernel's own binder (the
function Triton generates to turn call arguments into a specialisation)
sees the same keyword arguments a launcher passes, with a `MockTensor` of the
right dtype (16-byte aligned, like every torch allocation) for each tensor, so
integers divisible by 16 and aligned pointers get the same `tt.divisibility`
hints as on a GPU. Then `ASTSource` + `triton.compile(target=GPUTarget(...))`.
`ptxas -v` reports registers and spills; `metadata.shared` is the shared memory.
"""

import contextlib
import importlib
import io
import json
import os
import re
import sys
import time
import traceback

WARP_SIZE = 32
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_STACK = re.compile(r"(\d+) bytes stack frame")
_TENSOR_CORE_OPS = re.compile(r"\b(wgmma|mma)\.")  # mma.sync (sm_80+), wgmma (sm_90a); absent: FMA dots


def _jit_function(obj):
    """The raw JITFunction under an autotuner or heuristics wrapper (each keeps the wrapped one in `.fn`)."""
    from triton.runtime.jit import JITFunction

    while not isinstance(obj, JITFunction):
        if not hasattr(obj, "fn"):
            raise TypeError(f"{obj!r} is not a @triton.jit function (is TRITON_INTERPRET set?)")
        obj = obj.fn
    return obj


def _arguments(args: dict) -> dict:
    import torch
    from triton.runtime.jit import MockTensor

    return {k: MockTensor(getattr(torch, v["ptr"])) if isinstance(v, dict) else v for k, v in args.items()}


def compile_job(job: dict) -> dict:
    """Compile one launch for one target; never raises (errors are part of the result)."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    start = time.perf_counter()
    result = {"id": job["id"], "shared": None, "registers": None, "spills": None, "stack": None}
    result.update(tensor_cores=None, error=None)
    log = io.StringIO()
    try:
        fn = _jit_function(getattr(importlib.import_module(job["module"]), job["kernel"]))
        target = GPUTarget("cuda", job["capability"], WARP_SIZE)
        backend = make_backend(target)
        kwargs = _arguments(job["args"])
        kwargs.update(num_warps=job["num_warps"], num_stages=job["num_stages"])
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        bound_args, specialization, options = binder(**kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, options)
        knobs.nvidia.dump_ptxas_log = True  # ptxas -v output goes to stdout: captured below
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(
                ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__
            )
        text = log.getvalue()
        if not _PTXAS_REGS.search(text):
            raise RuntimeError("no ptxas -v report (a Triton cache hit? set TRITON_ALWAYS_COMPILE=1)")
        spills = _PTXAS_SPILLS.search(text)
        result.update(
            shared=compiled.metadata.shared,
            registers=int(_PTXAS_REGS.search(text).group(1)),
            spills=int(spills.group(1)) + int(spills.group(2)) if spills else 0,
            stack=int(_PTXAS_STACK.search(text).group(1)) if _PTXAS_STACK.search(text) else 0,
            tensor_cores=bool(_TENSOR_CORE_OPS.search(compiled.asm["ptx"])),
        )
    except Exception as e:  # a compile error is a finding, not a crash of the gate
        lines = [ln for ln in f"{type(e).__name__}: {e}".splitlines() if ln.strip()]
        result["error"] = " | ".join(lines[-3:])[:400]
        if job.get("traceback"):
            result["error"] += "\n" + traceback.format_exc()
    result["seconds"] = round(time.perf_counter() - start, 3)
    return result


def main() -> None:
    import stagewise.kernels  # noqa: F401  (decides the mode: must say "compile" here)

    if stagewise.kernels.TRITON_MODE != "compile":
        raise SystemExit(
            f"compile_worker: Triton mode is {stagewise.kernels.TRITON_MODE}; set STAGEWISE_TRITON=compile"
        )
    parent = os.getppid()
    for line in sys.stdin:
        if os.getppid() != parent:
            return  # the gate is gone: stop instead of compiling for nobody
        if line.strip():
            print(json.dumps(compile_job(json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
