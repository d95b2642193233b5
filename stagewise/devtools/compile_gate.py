"""The compile gate: every kernel launch, compiled for every GPU target, with no GPU present.

The CPU interpreter proves the kernels compute the right thing; it does not
prove they build for a GPU, fit its shared memory or keep their data in
registers. This gate takes the launches the launchers would make
(`compile_specs.launches`: their own plans, for SmolLM2-135M and Llama-3-8B,
decode and prefill, bf16 / fp16 / fp32), compiles each for sm_80, sm_89 and
sm_90 (and sm_75 in fp16) in child processes (`compile_worker`), and judges:

- a compile error fails;
- a fixed configuration over the target's shared memory, or spilling, fails;
- an autotuned launch fails if a configuration its prune keeps does not fit
  the shared memory (the prune's estimate was wrong), or if none of them
  runs without spilling;
- sm_75 is best effort: only the kernels in `targets.SM75_FP16` must pass there;
- Hopper's attention tiles (`hopper_attention_findings`): on sm_90, 16-bit attention at
  head_dim 128 must offer a tile of >= 64 keys that compiles clean (there wgmma keeps the K/V
  tiles in shared memory; a register rule written for sm_80 offers only 32-key tiles).

Identical compilations (same kernel, argument specialisation, constexprs,
warps, stages and target) are compiled once. Nothing is cached across runs.
"""

import inspect
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from stagewise.devtools import compile_specs
from stagewise.kernels.targets import SM75_FP16, gpu_target

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODELS = ("smollm2-135m", "llama-3-8b")


@dataclass(frozen=True)
class Case:
    model: str
    phase: str  # "decode" | "prefill"
    dtype: str  # "bf16" | "fp16" | "fp32"
    capability: int  # 75, 80, 89, 90
    k_kinds: tuple[str, ...] | None = None  # K-quant dequantize-GEMMs to compile (None: all; CI: fewer)


def full_sweep() -> list[Case]:
    """The whole matrix: both models and phases, sm_80/89/90 in every dtype, sm_75 in fp16."""
    cases = []
    for model, phase in itertools.product(MODELS, compile_specs.PHASES):
        cases += [Case(model, phase, d, c) for c, d in itertools.product((80, 89, 90), DTYPES)]
        cases.append(Case(model, phase, "fp16", 75))
    return cases


@dataclass
class Row:
    case: Case
    kernel: str  # kernel family
    label: str  # which call
    config: str  # tiles, warps, stages
    autotuned: bool  # one of several candidates the autotuner tries
    limit: int  # the target's shared memory per block
    tiles: dict = field(default_factory=dict)  # the config's meta-parameters (BLOCK_M, ...)
    result: dict = field(default_factory=dict)  # from compile_worker

    @property
    def fits(self) -> bool:
        r = self.result
        return not r.get("error") and r["shared"] <= self.limit

    @property
    def clean(self) -> bool:
        return self.fits and self.result["spills"] == 0


def _argument_kinds(module: str, function: str) -> tuple[set[str], set[str]]:
    """(constexpr names, do_not_specialize names) of a kernel: how Triton keys its compilations."""
    import importlib

    fn, unspecialized = getattr(importlib.import_module(module), function), set()
    while not inspect.isfunction(fn):
        unspecialized |= set(getattr(fn, "kwargs", {}).get("do_not_specialize") or ())  # InterpretedFunction
        unspecialized |= {p.name for p in getattr(fn, "params", []) if getattr(p, "do_not_specialize", False)}
        fn = fn.fn  # autotuner / JITFunction / InterpretedFunction -> the Python function
    params = inspect.signature(fn).parameters.values()
    return {p.name for p in params if "constexpr" in str(p.annotation)}, unspecialized


def _spec_key(value):
    """How Triton specialises a runtime argument: 1, divisible by 16, or neither (and 32 vs 64 bit)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return value
    return "one" if value == 1 else ("d16" if value % 16 == 0 else "i64" if abs(value) >= 2**31 else "i32")


def build_jobs(cases: list[Case], kernels=None) -> tuple[list[Row], list[dict], list[int]]:
    """Rows (one per launch and config) and the distinct compile jobs; row_job[i] = job id of row i.

    kernels: only these kernel families (None: all).
    """
    rows, jobs, row_job, seen, constexprs, shown = [], [], [], {}, {}, set()
    for case in cases:
        target = gpu_target(case.capability)
        phase = compile_specs.PHASES[case.phase]
        for launch in compile_specs.launches(case.model, phase, DTYPES[case.dtype], target, case.k_kinds):
            if kernels is not None and launch.kernel not in kernels:
                continue
            names, free = constexprs.setdefault(launch.function, _argument_kinds(launch.module, launch.function))
            for config in launch.plan.configs:
                args = {**launch.args, **config.kwargs}
                key_args = {k: v if k in names else "any" if k in free else _spec_key(v) for k, v in args.items()}
                key = json.dumps([launch.function, key_args, config.num_warps, config.num_stages, case.capability])
                if key not in seen:
                    seen[key] = len(jobs)
                    jobs.append(dict(id=len(jobs), module=launch.module, kernel=launch.function, args=args))
                    jobs[-1].update(num_warps=config.num_warps, num_stages=config.num_stages)
                    jobs[-1].update(capability=case.capability)
                tiles = " ".join(f"{k.removeprefix('BLOCK_')}{v}" for k, v in config.kwargs.items())
                desc = f"{tiles} w{config.num_warps} s{config.num_stages}".strip()
                if (case, launch.label, desc) in shown:
                    continue  # e.g. split-K candidates that differ only in their grid
                shown.add((case, launch.label, desc))
                tuned = launch.plan.autotuned or launch.tuned
                row = Row(case, launch.kernel, launch.label, desc, tuned, target.shared_memory)
                row.tiles = dict(config.kwargs)
                rows.append(row)
                row_job.append(seen[key])
    return rows, jobs, row_job


def worker_env(cache_dir: str) -> dict:
    """A child environment that compiles for a GPU: interpreter off, compile mode on, a fresh Triton cache."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(Path(__file__).resolve().parents[2])
    env.update(STAGEWISE_TRITON="compile", STAGEWISE_QUIET="1", TRITON_DEFAULT_FP_FUSION="1")
    env["TRITON_ALWAYS_COMPILE"] = "1"  # a cache hit would skip ptxas, and with it the register report
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    env["TRITON_CACHE_DIR"] = cache_dir
    return env


def run_jobs(jobs: list[dict], workers: int = 2, on_result=None) -> dict[int, dict]:
    """Compile the jobs in `workers` child processes; calls on_result(result) as each finishes."""
    results, lock = {}, threading.Lock()
    chunks = [jobs[i::workers] for i in range(workers)]
    cache = tempfile.TemporaryDirectory(prefix="stagewise-gate-")  # nothing cached across runs

    def work(chunk):
        errors = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a chatty worker cannot block on it
        proc = subprocess.Popen(
            [sys.executable, "-m", "stagewise.devtools.compile_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errors,
            env=worker_env(cache.name),
            text=True,
        )
        feeder = threading.Thread(
            target=lambda: (proc.stdin.write("".join(json.dumps(j) + "\n" for j in chunk)), proc.stdin.close())
        )
        feeder.start()
        for line in proc.stdout:
            result = json.loads(line)
            with lock:
                results[result["id"]] = result
                if on_result:
                    on_result(result)
        feeder.join()
        if proc.wait() != 0:
            errors.seek(0)
            raise RuntimeError(f"compile worker failed: {errors.read()[-2000:]}")

    threads = [threading.Thread(target=work, args=(c,)) for c in chunks if c]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cache.cleanup()
    missing = [j["id"] for j in jobs if j["id"] not in results]
    if missing:
        raise RuntimeError(f"compile gate: {len(missing)} jobs got no result (a worker died)")
    return results


def run_gate(cases: list[Case], workers: int = 2, on_result=None, on_start=None, kernels=None) -> list[Row]:
    rows, jobs, row_job = build_jobs(cases, kernels)
    if on_start:
        on_start(len(jobs))
    results = run_jobs(jobs, workers, on_result)
    for row, job in zip(rows, row_job):
        row.result = results[job]
    return rows


def findings(rows: list[Row]) -> list[str]:
    """What fails the gate, one line each (empty: the gate passes)."""
    out = []
    launches = {}
    for row in rows:
        launches.setdefault((row.case, row.label), []).append(row)
    for (case, label), group in launches.items():
        if case.capability < 80 and group[0].kernel not in SM75_FP16:
            continue  # best effort: not claimed for sm_75, so refused at run time
        where = f"{label} {case.model} {case.phase} {case.dtype} sm_{case.capability}"
        for row in group:
            r = row.result
            if r.get("error"):
                out.append(f"{where} [{row.config}]: compile error: {r['error'].splitlines()[0]}")
            elif r["shared"] > row.limit:
                out.append(f"{where} [{row.config}]: {r['shared']} B shared memory > {row.limit} B")
            elif not row.autotuned and r["spills"]:
                out.append(f"{where} [{row.config}]: spills {r['spills']} B/thread ({r['registers']} registers)")
        if group[0].autotuned and not any(row.clean for row in group):
            out.append(f"{where}: no autotune configuration fits without spilling")
    return out + hopper_attention_findings(rows)


HOPPER_ATTENTION_KERNELS = ("flash_attention", "paged_attention")
HOPPER_MIN_KEYS = 64  # keys per tile sm_90 must offer for 16-bit attention at head_dim 128


def _invariant(row: Row) -> bool:
    """A batch-invariant launch (compile_specs labels them so)."""
    return "batch-invariant" in row.label


def hopper_attention_findings(rows: list[Row]) -> list[str]:
    """sm_90, 16-bit, head_dim 128, prefill: each attention kernel offers a clean >= 64-key tile.

    A tile of 32 keys halves the work per K/V load; that was the regression of a register rule
    that counted K/V as registers on sm_90 (kernels/attention_common.tile_fits).
    """
    from stagewise.config import PRESETS

    out = []
    cases = {r.case for r in rows}
    for case in sorted(cases, key=lambda c: (c.model, c.phase, c.dtype, c.capability)):
        if case.capability != 90 or case.dtype == "fp32" or case.phase != "prefill":
            continue
        if PRESETS[case.model].head_dim != 128:
            continue
        # the variant launches and the batch-invariant ones (their own fixed tile) each on their own
        for kernel, invariant in itertools.product(HOPPER_ATTENTION_KERNELS, (False, True)):
            mine = [r for r in rows if r.case == case and r.kernel == kernel and _invariant(r) == invariant]
            if not mine:
                continue  # a filtered run (build_jobs(kernels=...)) that left this kernel out
            wide = [r for r in mine if r.tiles.get("BLOCK_N", 0) >= HOPPER_MIN_KEYS]
            where = f"{kernel}{' batch-invariant' if invariant else ''} {case.model} {case.phase} {case.dtype} sm_90"
            if not wide:
                offered = ", ".join(r.config for r in mine)
                out.append(f"{where}: no tile of >= {HOPPER_MIN_KEYS} keys offered (only {offered})")
            elif not any(r.clean for r in wide):
                out.append(f"{where}: no tile of >= {HOPPER_MIN_KEYS} keys compiles clean")
    return out


def markdown(rows: list[Row]) -> str:
    """The table: kernel x target x dtype x shape -> shared KB, registers, spills, tensor cores."""
    lines = [
        "| model | phase | kernel | dtype | target | config | shared KB (limit) | regs | spills B | tensor cores |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = sorted(rows, key=lambda r: (r.case.model, r.case.phase, r.label, r.case.dtype, r.case.capability))
    for row in order:
        c, r = row.case, row.result
        config = row.config + (" (autotune)" if row.autotuned else "")
        if r.get("error"):
            cells = ["error: " + r["error"].splitlines()[0][:80], "", "", ""]
        else:
            flag = "" if r["shared"] <= row.limit else " **over**"
            cells = [f"{r['shared'] / 1024:.1f} ({row.limit // 1024}){flag}", str(r["registers"])]
            cells += [f"**{r['spills']}**" if r["spills"] else "0", "yes" if r["tensor_cores"] else "no"]
        cells = [c.model, c.phase, row.label, c.dtype, f"sm_{c.capability}", config, *cells]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def merge_markdown(old: str, rows: list[Row], problems: list[str], stamp: str, seconds: float, workers: int) -> str:
    """benchmarks/compile_gate.md with the rows of `rows`' kernel families replaced by `rows`.

    A partial sweep (run_gate(kernels=...)) regenerates some families; every other row, and the
    findings about them, stay as the previous run wrote them. The header records the partial run.
    """
    families = sorted({r.kernel for r in rows})
    labels = {r.label for r in rows}
    head, _, table = old.partition("## Launches")
    table_lines = [ln for ln in table.splitlines() if ln.startswith("| ") and not ln.startswith("| model")]
    kept = [ln for ln in table_lines if ln.split(" | ")[2] not in labels]
    new = markdown(rows).splitlines()[2:]
    key = lambda ln: tuple(ln.split(" | ")[i] for i in (0, 1, 2, 3, 4))  # model, phase, label, dtype, target
    intro, _, old_findings = head.partition("## Findings")
    old_findings = [ln for ln in old_findings.splitlines() if ln.startswith("- ") and not any(
        ln.startswith(f"- {label} ") for label in labels)]  # fmt: skip
    note = (
        f"Partial run ({stamp}): the rows of {', '.join(families)} regenerated, {len(rows)} launches in "
        f"{seconds:.0f} s on {workers} processes; the other rows are from the run described above, "
        "and a kernel family missing from it was added this way."
    )
    lines = [intro.rstrip(), "", note, "", "## Findings", ""]
    lines += [*old_findings, *(f"- {p}" for p in problems)] or ["None: every launch fits its target without spilling."]
    lines += ["", "## Launches", "", *markdown([]).splitlines()[:2], *sorted(kept + new, key=key)]
    return "\n".join(lines) + "\n"
