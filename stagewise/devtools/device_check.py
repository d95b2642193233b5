"""The one-command device check: everything worth knowing about the Triton path on a GPU, in minutes.

    python -m stagewise.devtools.device_check --out DIR            # on a CUDA machine
    python -m stagewise.devtools.device_check --out DIR --dry-run  # on a CPU: every section, tiny shapes

Sections, each a subprocess with its own time limit (a hang or crash in one
is recorded and the others still run):

    env      the GPU, versions, the two ceilings: copy bandwidth (>= 1 GB) and the bf16 matmul rate
    kernels  every Triton kernel vs its naive stage and the stock alternative (bench/kernel_bench.py)
    e2e      Llama-3-8B-shaped decode at batch 1 vs the weight-streaming limit; SmolLM2-shaped
             steps/s and host share; host syncs per step; Triton vs naive greedy tokens
    bench    `bench modes` and `bench batching` with the Triton backend on a synthetic SmolLM2
    tests    the kernel tests and the whole-model Triton tests, on CUDA

Writes DIR/device_check.json (everything), DIR/device_check.md (the tables),
DIR/log.txt (every section's output) and DIR/bench/{modes,batching}.{json,png}.
The dry run does all of it on the CPU with tiny shapes (kernels in Triton's
interpreter, tests only collected), so a broken check is found before a GPU is spent on it.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SECTIONS = ("env", "kernels", "e2e", "bench", "tests")
LIMITS_S = {"env": 45, "kernels": 120, "e2e": 110, "bench": 75, "tests": 150}  # per section, at most


def _device(dry_run: bool):
    import torch

    if dry_run:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("device_check: no CUDA device; use --dry-run on a CPU")
    return torch.device("cuda")


def section_env(dry_run: bool, ctx: dict) -> dict:
    import torch

    from stagewise.bench.device_timer import copy_bandwidth, matmul_peak
    from stagewise.bench.machine import machine_info

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

    from stagewise.bench.kernel_bench import DRY_SIZES, GPU_SIZES, run_kernel_cases

    device = _device(dry_run)
    sizes = DRY_SIZES if dry_run else GPU_SIZES
    rows = run_kernel_cases(sizes, device, torch.bfloat16 if not dry_run else torch.float32, ctx["copy_gbs"])
    return {"rows": rows, "dtype": "bfloat16" if not dry_run else "float32"}


def section_e2e(dry_run: bool, ctx: dict) -> dict:
    import torch

    from stagewise.devtools.e2e_device import count_syncs, decode_speed, engine_config, greedy_agreement, step_profile
    from stagewise.engine.llm import LLM
    from stagewise.models.registry import load_model

    device = _device(dry_run)
    dev = device.type
    copy_gbs = ctx["copy_gbs"]
    big, small = ("random:tiny", "random:tiny") if dry_run else ("random:llama-3-8b", "random:smollm2-135m")
    new = 8 if dry_run else 64
    out = {"decode": [], "errors": {}}
    t0 = time.perf_counter()

    def attempt(label, fn, *args):
        try:
            value = fn(*args)
            print(f"[{time.perf_counter() - t0:5.1f} s] {label}: {json.dumps(value, default=str)[:400]}", flush=True)
            return value
        except Exception as err:  # record, go on
            out["errors"][label] = f"{type(err).__name__}: {err}"[:600]
            print(f"[{time.perf_counter() - t0:5.1f} s] {label}: ERROR {out['errors'][label]}", flush=True)
            return None

    for name in (big, small):
        loaded = load_model(name, dev, None)
        for backend, graphs in (("triton", True), ("triton", False), ("torch", False)):
            label = f"decode {name} {backend}{' +graphs' if graphs else ''}"
            row = attempt(label, decode_speed, name, backend, graphs, dev, None, new, copy_gbs, loaded)
            if row:
                out["decode"].append(row)
        if name == small:
            profiles = []
            for graphs in (True, False):
                for seqs in (1, 8):
                    llm = LLM(loaded, backend="triton", engine_config=engine_config(dev, graphs))
                    steps = 4 if dry_run else 20
                    prof = attempt(f"steps triton graphs={graphs} x{seqs}", step_profile, llm, seqs, steps, device)
                    if prof:
                        profiles.append({"backend": "triton", "cuda_graphs": graphs, **prof})
            out["step_profiles"] = profiles
            eager = LLM(loaded, "triton", engine_config=engine_config(dev))
            out["syncs"] = attempt("syncs triton", count_syncs, eager, device)
        loaded = None  # free the big model before the small one
        if dev == "cuda":
            torch.cuda.empty_cache()
    prompts = ["hello world", "the quick brown fox", "hello " * 9]
    if dev == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 for this check (the documented switch)
    out["greedy_fp32"] = attempt("greedy fp32", greedy_agreement, small, dev, torch.float32, prompts, new // 2)
    return out


def section_bench(dry_run: bool, ctx: dict) -> dict:
    from stagewise.bench.batching import BatchingSettings, plot_batching, run_batching
    from stagewise.bench.machine import write_result_json
    from stagewise.bench.modes import ModesSettings, plot_modes, run_modes

    model = "random:tiny" if dry_run else "random:smollm2-135m"
    device = "cpu" if dry_run else "cuda"
    bench_dir = Path(ctx["out"]) / "bench"
    out = {}
    # float32 (TF32 off): the modes must give identical greedy tokens before their timings are compared,
    # and in bf16 different kernels (flash vs paged attention) round differently.
    # Sized to finish inside the section's limit on the lent H200 (the first run there, with naive recompute,
    # 2 repeats and 16 batched requests, ran out of time before writing anything): the cached modes only, one
    # repeat each, and a smaller batching workload. Eager Triton steps are host-bound (~30 ms) and every
    # kernel configuration compiles on first use.
    modes = ModesSettings(
        model=model, backend="triton", device=device, dtype="float32", prompt_tokens=16 if dry_run else 32,
        output_lengths=(4, 8) if dry_run else (16, 64), repeats=1, modes=("kv", "paged"),
    )  # fmt: skip
    result = run_modes(modes)
    write_result_json(result, bench_dir / "modes.json")
    plot_modes(result, bench_dir / "modes.png")
    out["modes"] = result.get("summary")
    batching = BatchingSettings(
        model=model, backend="triton", device=device, dtype="float32", num_requests=4 if dry_run else 8,
        prompt_tokens=(8, 24) if dry_run else (16, 256), output_tokens=(4, 8) if dry_run else (16, 64),
        max_num_seqs=2 if dry_run else 8,
    )  # fmt: skip
    result = run_batching(batching)
    write_result_json(result, bench_dir / "batching.json")
    plot_batching(result, bench_dir / "batching.png")
    out["batching"] = result.get("summary")
    return out


def section_tests(dry_run: bool, ctx: dict) -> dict:
    # the GPU-only claims first (no sync in a step, graphs replay), then every kernel test
    files = [
        "tests/engine/test_host_sync.py",
        "tests/engine/test_cuda_graphs.py",
        "tests/models/test_triton_model.py",
        "tests/kernels",
    ]
    if dry_run:
        cmd = [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", *files]
    else:
        workers = ["-n", "8"] if _has("xdist") else []
        # -v: one line per test as it ends, so a run cut short by the section's limit still names its failures
        cmd = [sys.executable, "-m", "pytest", "-v", "--tb=line", "-p", "no:cacheprovider", "-rfE",
               "-m", "not model and not oracle", *workers, *files]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=ctx["remaining_s"] - 10)
        stdout, stderr, code = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exp:  # keep what ran: the failures so far are still news
        stdout = exp.stdout.decode(errors="replace") if isinstance(exp.stdout, bytes) else (exp.stdout or "")
        stderr, code = "", "timeout"
        stdout += f"\n[pytest stopped after {ctx['remaining_s'] - 10:.0f} s]"
    report = test_report(stdout)
    print("\n".join(report["failures"]), "\n".join(stdout.splitlines()[-15:]), stderr[-2000:], sep="\n")
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
    return {"summary": summary, "counts": outcomes, "failures": list(failures.values())[:60]}


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


RUNNERS = {"env": section_env, "kernels": section_kernels, "e2e": section_e2e, "bench": section_bench,
           "tests": section_tests}  # fmt: skip


def run_section(name: str, dry_run: bool, ctx_path: Path, result_path: Path) -> None:
    """Child process: run one section, write its JSON."""
    ctx = json.loads(ctx_path.read_text())
    t0 = time.perf_counter()
    result = RUNNERS[name](dry_run, ctx)
    result["seconds"] = time.perf_counter() - t0
    result_path.write_text(json.dumps(result, indent=1, default=str))


def orchestrate(out: Path, dry_run: bool, budget_s: float, sections: list[str], limits: dict | None = None) -> dict:
    """Parent: every section in a child process with a time limit; merge, write JSON + markdown + log."""
    from stagewise.devtools.device_report import render_markdown
    from stagewise.files import write_text_atomic

    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    results, log = {"dry_run": dry_run, "sections": {}}, []
    ctx = {"out": str(out), "copy_gbs": 1.0}
    with tempfile.TemporaryDirectory() as tmp:
        for name in sections:
            remaining = budget_s - (time.perf_counter() - start)
            if remaining < 15:
                results["sections"][name] = {"skipped": f"time budget spent ({budget_s:.0f} s)"}
                continue
            limit = min((limits or LIMITS_S)[name] if not dry_run else 600, remaining)
            ctx["remaining_s"] = limit
            ctx_path, res_path = Path(tmp) / "ctx.json", Path(tmp) / f"{name}.json"
            ctx_path.write_text(json.dumps(ctx))
            cmd = [sys.executable, "-m", "stagewise.devtools.device_check", "--section", name,
                   "--ctx", str(ctx_path), "--result", str(res_path)] + (["--dry-run"] if dry_run else [])  # fmt: skip
            t0 = time.perf_counter()
            print(f"== {name} (limit {limit:.0f} s)", flush=True)
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
                text, code = proc.stdout + proc.stderr, proc.returncode
            except subprocess.TimeoutExpired as exp:
                raw = exp.stdout or ""
                text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
                text += f"\n[timed out after {limit:.0f} s]"
                code = "timeout"
            print(text[-3000:], flush=True)
            log.append(f"== {name} (exit {code}, {time.perf_counter() - t0:.0f} s)\n{text}")
            if res_path.exists():
                results["sections"][name] = json.loads(res_path.read_text())
            else:
                results["sections"][name] = {"failed": f"exit {code}", "tail": text[-1500:]}
            write_text_atomic(out / "device_check.json", json.dumps(results, indent=1, default=str))  # so far
            if name == "env" and "copy" in results["sections"][name]:
                ctx["copy_gbs"] = results["sections"][name]["copy"]["gb_per_s"]
    results["total_seconds"] = time.perf_counter() - start
    write_text_atomic(out / "device_check.json", json.dumps(results, indent=1, default=str))
    write_text_atomic(out / "log.txt", "\n\n".join(log))
    md = render_markdown(results)
    write_text_atomic(out / "device_check.md", md)
    print(md)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/gpu/out", help="output folder")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, tests only collected")
    parser.add_argument("--budget-s", type=float, default=420.0, help="time for all sections together")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset")
    parser.add_argument("--limits", default="", help="per-section seconds, e.g. tests=90,kernels=100")
    parser.add_argument("--section", help=argparse.SUPPRESS)  # child mode
    parser.add_argument("--ctx", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.section:
        run_section(args.section, args.dry_run, Path(args.ctx), Path(args.result))
        return
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {', '.join(SECTIONS)}")
    limits = dict(LIMITS_S)
    for item in filter(None, args.limits.split(",")):
        key, _, value = item.partition("=")
        if key not in SECTIONS or not value.replace(".", "", 1).isdigit():
            parser.error(f"--limits takes name=seconds pairs for {', '.join(SECTIONS)}, got '{item}'")
        limits[key] = float(value)
    orchestrate(Path(args.out), args.dry_run, args.budget_s, sections, limits)


if __name__ == "__main__":
    main()
