"""The one-command device check: everything worth knowing about the Triton path on a GPU, in minutes.

    python -m stagewise.devtools.device_check --out DIR            # on a CUDA machine
    python -m stagewise.devtools.device_check --out DIR --dry-run  # on a CPU: every section, tiny shapes

Sections (device_sections.py), each a child process in a process group of its own with its own
time limit: a hang or crash in one is recorded, the group is killed whole (no pytest worker is
left holding the GPU), and the others still run.

    env      the GPU, versions, the two ceilings: copy bandwidth (>= 1 GB) and the bf16 matmul rate
    kernels  every Triton kernel vs its naive stage and the stock alternative (devtools/gpu/kernel_bench.py)
    e2e      Llama-3-8B-shaped decode at batch 1 vs the weight-streaming limit (bf16 and 4-bit), a
             Llama-3.2-1B-shaped row held to 70% of HBM bandwidth; SmolLM2-shaped steps/s and host
             share; host syncs per step; Triton vs naive greedy tokens
    bench    `bench modes` and `bench batching` with the Triton backend on a synthetic SmolLM2
    tests    the engine's GPU claims, the whole-model Triton tests and the kernel tests, on CUDA

Writes DIR/device_check.json (everything), DIR/device_check.md (the tables),
DIR/log.txt (every section's output) and DIR/bench/{modes,batching}.{json,png}.
The dry run does all of it on the CPU with tiny shapes (kernels in Triton's
interpreter, tests only collected), so a broken check is found before a GPU is spent on it.

Sizing. The limits are what each section may take at most, each above what it needs on an H200;
the budget bounds them together: 330 s, so that with the machine's start (a minute or two) the
whole check takes about 8 minutes, and a rerun on the warm machine fits the same 15-minute lease.
The tests come last and take what is left (they have not finished inside their share yet: they
name the failures seen so far). The estimate, section by section, is in benchmarks/gpu/README.md.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from stagewise.devtools.device_sections import run_section
from stagewise.devtools.process_group import run_in_group

SECTIONS = ("env", "kernels", "e2e", "bench", "tests")
LIMITS_S = {"env": 30, "kernels": 115, "e2e": 140, "bench": 75, "tests": 120}  # per section on a GPU, at most
BUDGET_S = 330.0  # all sections together on a GPU: about 8 minutes with the machine's start
# the dry run: Triton's interpreter on a shared CPU (3.5 to 5 minutes in all on 2 busy cores)
DRY_LIMITS_S = {"env": 60, "kernels": 150, "e2e": 240, "bench": 120, "tests": 90}
DRY_BUDGET_S = 540.0


def orchestrate(
    out: Path, dry_run: bool, budget_s: float | None = None, sections=SECTIONS, limits: dict | None = None
) -> dict:
    """Parent: every section in a child process with a time limit; merge, write JSON + markdown + log."""
    from stagewise.devtools.device_report import render_markdown
    from stagewise.files import write_text_atomic

    budget_s = budget_s or (DRY_BUDGET_S if dry_run else BUDGET_S)
    limits = {**(DRY_LIMITS_S if dry_run else LIMITS_S), **(limits or {})}
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    results = {"dry_run": dry_run, "budget_s": budget_s, "limits_s": limits, "sections": {}}
    log, ctx = [], {"out": str(out), "copy_gbs": 1.0}
    with tempfile.TemporaryDirectory() as tmp:
        for name in sections:
            remaining = budget_s - (time.perf_counter() - start)
            if remaining < 15:
                results["sections"][name] = {"skipped": f"time budget spent ({budget_s:.0f} s)"}
                continue
            limit = min(limits[name], remaining)
            ctx["remaining_s"] = limit
            ctx_path, res_path = Path(tmp) / "ctx.json", Path(tmp) / f"{name}.json"
            ctx_path.write_text(json.dumps(ctx))
            cmd = [sys.executable, "-m", "stagewise.devtools.device_check", "--section", name,
                   "--ctx", str(ctx_path), "--result", str(res_path)] + (["--dry-run"] if dry_run else [])  # fmt: skip
            t0 = time.perf_counter()
            print(f"== {name} (limit {limit:.0f} s)", flush=True)
            text, code = run_in_group(cmd, limit)
            took = time.perf_counter() - t0
            print(text[-3000:], flush=True)
            log.append(f"== {name} (exit {code}, {took:.0f} s)\n{text}")
            if res_path.exists():
                sec = json.loads(res_path.read_text())
            else:
                sec = {"failed": f"exit {code}", "tail": text[-1500:]}
            results["sections"][name] = {**sec, "limit_s": limit, "wall_s": took}
            write_text_atomic(out / "device_check.json", json.dumps(results, indent=1, default=str))  # so far
            if name == "env" and "copy" in sec:
                ctx["copy_gbs"] = sec["copy"]["gb_per_s"]
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
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help=f"time for all sections together (default {BUDGET_S:.0f}, dry run {DRY_BUDGET_S:.0f})",
    )
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
    limits = {}
    for item in filter(None, args.limits.split(",")):
        key, _, value = item.partition("=")
        if key not in SECTIONS or not value.replace(".", "", 1).isdigit():
            parser.error(f"--limits takes name=seconds pairs for {', '.join(SECTIONS)}, got '{item}'")
        limits[key] = float(value)
    orchestrate(Path(args.out), args.dry_run, args.budget_s, sections, limits)


if __name__ == "__main__":
    main()
