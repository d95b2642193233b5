"""The device check's sections: each runs in its own child process and returns a JSON-able dict.

    env      the GPU, versions, the two ceilings: copy bandwidth (>= 1 GB) and the bf16 matmul rate
    kernels  every Triton kernel vs its naive stage and the stock alternative (devtools/gpu/kernel_bench.py)
    e2e      Llama-3-8B-shaped decode at batch 1 vs the weight-streaming limit (bf16 and 4-bit), a
             Llama-3.2-1B-shaped row held to 70% of HBM bandwidth; SmolLM2-shaped steps/s and host
             share; host syncs per step; Triton vs naive greedy tokens
    bench    `bench modes` and `bench batching` with the Triton backend on a synthetic SmolLM2
    tests    the engine's GPU claims, the whole-model Triton tests and the kernel tests, on CUDA

A dry run (`dry_run=True`) runs each on the CPU with tiny shapes. Every section also records the
autotuner's pick for each kernel it launched (`autotune_picks`): on a GPU that is the tile a
number was measured with; the interpreter autotunes nothing (one fixed tile per shape class).
"""

import json
import os
import sys
import time
from pathlib import Path

from stagewise.devtools.process_group import forward_terminate, run_in_group


def _device(dry_run: bool):
    import torch

    if dry_run:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("device_check: no CUDA device; use --dry-run on a CPU")
    return torch.device("cuda")


def autotune_picks() -> list[dict]:
    """Every `triton.autotune` wrapper alive in this process -> the config it chose for each key.

    Triton's Autotuner keeps `cache: {key tuple: Config}` (the key: the values of its `key=`
    arguments, then the argument dtypes); an autotuner that has run only one config keeps none."""
    import gc
    import warnings

    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:  # no triton here
        return []
    with warnings.catch_warnings():  # isinstance on every live object wakes deprecated modules' warnings
        warnings.simplefilter("ignore")
        tuners = [o for o in gc.get_objects() if isinstance(o, Autotuner)]
    picks = []
    for tuner in tuners:
        fn = getattr(tuner, "base_fn", None) or getattr(tuner, "fn", None)
        name = getattr(fn, "__name__", None) or getattr(getattr(fn, "fn", None), "__name__", "?")
        for key, config in dict(getattr(tuner, "cache", {})).items():
            picks.append({"kernel": name, "key_args": list(getattr(tuner, "keys", [])),
                          "key": [str(k) for k in key], "config": str(config),
                          "candidates": len(getattr(tuner, "configs", []))})  # fmt: skip
    return sorted(picks, key=lambda p: (p["kernel"], p["key"]))


def section_env(dry_run: bool, ctx: dict) -> dict:
    import torch

    from stagewise.bench.harness.machine import machine_info
    from stagewise.devtools.gpu.device_timer import copy_bandwidth, matmul_peak

    device = _device(dry_run)
    out = {"machine": machine_info()}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        out["gpu"] = {"name": p.name, "capability": f"{p.major}.{p.minor}", "sms": p.multi_processor_count,
                      "memory_GB": round(p.total_memory / 1e9, 1)}  # fmt: skip
    out["copy"] = copy_bandwidth(device, 2_000_000_000 if not dry_run else 1 << 20)
    out["matmul_bf16"] = matmul_peak(device, 8192 if not dry_run else 64)
    print(f"copy {out['copy']['gb_per_s']:,.0f} GB/s, bf16 matmul {out['matmul_bf16']['tflops']:,.0f} TFLOP/s")
    return out


def section_kernels(dry_run: bool, ctx: dict) -> dict:
    import torch

    from stagewise.devtools.gpu.decode_fusions import norm_matmul_cases, rope_kv_store_cases
    from stagewise.devtools.gpu.ffn_fusion import silu_down_cases
    from stagewise.devtools.gpu.invariance import invariance_cases
    from stagewise.devtools.gpu.kernel_bench import DRY_SIZES, GPU_SIZES, run_kernel_cases, summary_line
    from stagewise.devtools.gpu.quant_decode import quant_decode_cases

    device = _device(dry_run)
    sizes = DRY_SIZES if dry_run else GPU_SIZES
    dtype = torch.bfloat16 if not dry_run else torch.float32
    rows = run_kernel_cases(sizes, device, dtype, ctx["copy_gbs"])
    # the decode fusions against their two launches, the W4A16 decode GEMV against F.linear on the
    # dequantized weight, batch-invariant paths against the variant ones (a row's bits alone and
    # batched, and the cost): each family on its own, a failure is a row (as in kernel_bench)
    families = (
        ("silu_down", lambda: silu_down_cases(sizes, device, dtype)),
        ("norm_matmul", lambda: norm_matmul_cases(sizes, device, dtype)),
        ("rope_kv_store", lambda: rope_kv_store_cases(sizes, device, dtype)),
        ("dequant_matmul", lambda: quant_decode_cases(sizes, device, dtype, ctx["copy_gbs"])),
        ("invariance", lambda: invariance_cases(sizes, device, dtype)),
    )
    for kernel, cases in families:
        t0 = time.perf_counter()
        try:
            got = cases()
        except Exception as err:
            got = [{"kernel": kernel, "shape": "decode", "error": f"{type(err).__name__}: {err}"[:400]}]
        print("\n".join(summary_line(r) for r in got), f"\n[{kernel}: {time.perf_counter() - t0:.1f} s]", flush=True)
        rows += got
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"rows": rows, "dtype": str(dtype).removeprefix("torch.")}


def section_bench(dry_run: bool, ctx: dict) -> dict:
    from stagewise.bench.commands.batching import BatchingSettings, plot_batching, run_batching
    from stagewise.bench.commands.modes import ModesSettings, plot_modes, run_modes
    from stagewise.bench.harness.machine import write_result_json

    model = "random:tiny" if dry_run else "random:smollm2-135m"
    device = "cpu" if dry_run else "cuda"
    # the dry run proves this section's code with the PyTorch tier (the interpreter's Triton steps take
    # a second each; the kernels and e2e sections run those)
    backend = "torch" if dry_run else "triton"
    bench_dir = Path(ctx["out"]) / "bench"
    out = {}
    # float32 (TF32 off) so the modes should give identical greedy tokens; a near-tie on random
    # weights can still flip one between two correct kernels: it is recorded and timing goes on.
    # Sized for the section's limit on an H200: eager Triton steps are host-bound (~30 ms) and
    # every kernel configuration compiles on first use, so the cached modes only, one repeat each.
    modes = ModesSettings(
        model=model, backend=backend, device=device, dtype="float32", prompt_tokens=16 if dry_run else 32,
        output_lengths=(4, 6) if dry_run else (16, 48), repeats=1, modes=("kv", "paged"), on_mismatch="record",
    )  # fmt: skip
    result = run_modes(modes)
    write_result_json(result, bench_dir / "modes.json")
    plot_modes(result, bench_dir / "modes.png")
    out["modes"] = result.get("summary")
    out["mismatches"] = list(result.get("mismatches", []))
    batching = BatchingSettings(
        model=model, backend=backend, device=device, dtype="float32", num_requests=3 if dry_run else 8,
        prompt_tokens=(8, 16) if dry_run else (16, 256), output_tokens=(3, 5) if dry_run else (16, 48),
        max_num_seqs=2 if dry_run else 8, on_mismatch="record",
    )  # fmt: skip
    result = run_batching(batching)
    write_result_json(result, bench_dir / "batching.json")
    plot_batching(result, bench_dir / "batching.png")
    out["batching"] = result.get("summary")
    out["mismatches"] += list(result.get("mismatches", []))
    return out


# the GPU-only claims first (no sync in a step, graphs replay), then the model, then every kernel test
TEST_FILES = (
    "tests/engine/test_host_sync.py",
    "tests/engine/test_cuda_graphs.py",
    "tests/models/test_triton_model.py",
    "tests/kernels",
)


def section_tests(dry_run: bool, ctx: dict) -> dict:
    if dry_run:
        cmd = [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", *TEST_FILES]
    else:
        workers = ["-n", str(max(2, min(12, (os.cpu_count() or 4) - 2)))] if _has("xdist") else []
        # -v: one line per test as it ends, so a run cut short by the section's limit still names its failures
        cmd = [sys.executable, "-m", "pytest", "-v", "--tb=line", "-p", "no:cacheprovider", "-rfE",
               "-m", "not model and not oracle", *workers, *TEST_FILES]  # fmt: skip
    limit = ctx["remaining_s"] - 10  # leave the section time to write its result
    stdout, code = run_in_group(cmd, limit)  # on timeout pytest and its workers are killed together
    report = test_report(stdout)
    if code == "timeout":
        report["summary"] = f"cut after {limit:.0f} s: " + ", ".join(
            f"{n} {k.lower()}" for k, n in report["counts"].items()
        )
    print("\n".join(report["failures"]), "\n".join(stdout.splitlines()[-15:]), sep="\n")
    return {"command": " ".join(cmd), "returncode": code, **report}


def test_report(stdout: str) -> dict:
    """pytest's output -> {summary, counts, failures}: every failed or erroring test by name, cut short or not.

    With -v each test prints "[gw3] [ 12%] FAILED tests/x.py::test_y" (xdist) or "tests/x.py::test_y FAILED"
    as it ends; the -rfE summary at the end repeats them with a reason, when the run gets there.
    """
    lines = [ln.strip() for ln in stdout.splitlines() if ln.strip()]
    outcomes = {"PASSED": 0, "FAILED": 0, "ERROR": 0, "SKIPPED": 0}
    failures: dict[str, str] = {}  # test id -> its line (the summary's, with the reason, when there is one)
    for ln in lines:
        words = ln.split()
        if ln.startswith(("FAILED ", "ERROR ")):  # the -rfE summary: "FAILED tests/x.py::t - reason"
            failures[words[1]] = ln
            continue
        for outcome in outcomes:
            if outcome in words:
                test = next((w for w in words if "::" in w), None)
                if test is None:
                    break
                outcomes[outcome] += 1
                if outcome in ("FAILED", "ERROR"):
                    failures.setdefault(test, f"{outcome} {test}")
                break
    summary = lines[-1] if lines else ""
    return {"summary": summary, "counts": outcomes, "failures": list(failures.values())[:100]}


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def section_e2e(dry_run: bool, ctx: dict) -> dict:
    from stagewise.devtools.e2e_device import run_e2e

    return run_e2e(_device(dry_run), dry_run, ctx["copy_gbs"])


RUNNERS = {"env": section_env, "kernels": section_kernels, "e2e": section_e2e, "bench": section_bench,
           "tests": section_tests}  # fmt: skip


def run_section(name: str, dry_run: bool, ctx_path: Path, result_path: Path) -> None:
    """Child process: run one section, write its JSON (with the autotuner's picks)."""
    forward_terminate()  # killed on timeout: take the commands this section started along
    ctx = json.loads(ctx_path.read_text())
    t0 = time.perf_counter()
    result = RUNNERS[name](dry_run, ctx)
    if name in ("kernels", "e2e", "bench"):
        result["autotune"] = autotune_picks()
    result["seconds"] = time.perf_counter() - t0
    result_path.write_text(json.dumps(result, indent=1, default=str))
