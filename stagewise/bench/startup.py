"""How long `trace "The capital of France is"` takes to start, on a first and a later run.

    python -m stagewise.bench.startup [--runs 2] [--prompt "..."] [--model smollm2-135m]
                                      [--quantization auto|none] [--json PATH]

Each run is the real command in a fresh process (Python start, imports, loading the model,
the traced run, rendering), timed from the start of the process to its first line on stdout
(the shape tree's first line) and to its end. The first run gets an empty cache folder
(`STAGEWISE_CACHE_DIR`), as on a machine that has never run stagewise: it measures the CPU GEMM
forms and stores them; the later runs read them back. Then one load in this process, with
every load phase timed (`runtime.load_phase`), shows where the loading time goes.
`--quantization none` dequantizes every weight to float32: the path whose projections run the
calibrated CPU GEMM forms (packed weights run the dequantize GEMM and need no calibration).

Saved to benchmarks/results/<machine-tag>/startup.json unless --json says otherwise.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stagewise.bench.machine import machine_info, machine_tag


def time_command(cmd: list[str], env: dict) -> dict:
    """Seconds to the first stdout line and to the exit of `cmd`, its exit status and line count."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    first, lines = None, 0
    for _ in proc.stdout:
        first = first if first is not None else time.perf_counter() - start
        lines += 1
    err = proc.stderr.read()
    code = proc.wait()
    total = time.perf_counter() - start
    return {"first_line_s": first, "total_s": total, "exit_status": code, "lines": lines, "stderr": err[-400:]}


def phase_times(model: str, quantization: str) -> dict[str, float]:
    """Load `model` in this process (an LLM, paged) and return seconds per load phase."""
    from stagewise.engine.llm import LLM
    from stagewise.runtime import listen_to_load_phases

    times: dict[str, float] = {}

    def record(text: str, seconds: float | None) -> None:
        if seconds is not None:
            times[text] = round(times.get(text, 0.0) + seconds, 3)

    start = time.perf_counter()
    with listen_to_load_phases(record):
        LLM(model, quantization=quantization)
    times["whole load (LLM(...))"] = round(time.perf_counter() - start, 3)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--quantization", default="none", choices=("auto", "none"))
    parser.add_argument("--runs", type=int, default=2, help="processes in a row (the first with an empty cache)")
    parser.add_argument("--json", default=None, help="output file (default benchmarks/results/<tag>/startup.json)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    trace = Path(sys.executable).with_name("trace")
    cmd = [str(trace)] if trace.exists() else [sys.executable, "-m", "stagewise.cli", "trace"]
    cmd += [args.prompt, "--model", args.model, "--quantization", args.quantization]
    runs = []
    with tempfile.TemporaryDirectory(prefix="stagewise-startup-cache-") as cache:
        env = {**os.environ, "STAGEWISE_CACHE_DIR": cache}
        env.pop("STAGEWISE_QUIET", None)
        for i in range(args.runs):
            got = time_command(cmd, env)
            got["cache"] = "empty (first run on this machine)" if i == 0 else "filled by the first run"
            runs.append(got)
            print(f"run {i + 1}: first line {got['first_line_s']:.1f} s, done {got['total_s']:.1f} s ({got['cache']})")
            if got["exit_status"] != 0:
                print(f"  exit status {got['exit_status']}: {got['stderr']}", file=sys.stderr)
        os.environ["STAGEWISE_CACHE_DIR"] = cache
        phases = phase_times(args.model, args.quantization)
    for text, seconds in phases.items():
        print(f"  {text}: {seconds:.2f} s")
    result = {
        "benchmark": "startup",
        "machine": machine_info(),
        "command": cmd,
        "runs": runs,
        "load_phases_s (in process, cache filled)": phases,
    }
    name = "startup.json" if args.quantization == "auto" else f"startup_{args.quantization}.json"
    path = Path(args.json) if args.json else Path("benchmarks") / "results" / machine_tag() / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
