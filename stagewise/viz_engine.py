"""Pictures of the engine (a trace's timeline) and the printouts notebooks 12a/12b read kernels with.

Plotting only; the notebooks import these so their cells stay about the idea. matplotlib is
imported when a function is called, not when this module is.
"""

import inspect
import json
from pathlib import Path

import numpy as np

PHASE_COLORS = {
    "waiting": "lightgray",
    "prefill chunk": "#9ecae1",
    "prefill": "#3182bd",
    "decode": "#31a354",
    "finished (padding row)": "#fcbba1",
    "preempted": "#de2d26",
}


def timeline(trace: dict, label: dict, title: str, budget: int | None = None, xmax: int | None = None):
    """Gantt of a trace: per request and step, what it did; below, the rows of each step (padding hatched).

    `trace`: `stagewise.trace.export.to_json` of a run; `label`: request id -> the name to show,
    in the order of the rows; `budget`: the token budget, drawn as a line under the bars.
    """
    import matplotlib.pyplot as plt

    ids = list(label)
    num_steps = len(trace["steps"])
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(12, 0.5 * len(ids) + 4.5), sharex=True, gridspec_kw={"height_ratios": [len(ids) + 1, 4]}
    )
    tokens = np.zeros((num_steps, len(ids)))
    padding = np.zeros(num_steps)
    started, any_waiting = set(), False
    for s in trace["steps"]:
        x = s["index"]
        for r in s["requests"]:
            y = ids.index(r["request_id"])
            top.barh(y, 1, left=x, color=PHASE_COLORS.get(r["phase"], "black"), edgecolor="white")
            if r["num_scheduled"] > 1:
                top.text(x + 0.5, y, str(r["num_scheduled"]), ha="center", va="center", fontsize=7, color="white")
            tokens[x, y] = r["num_scheduled"]
            padding[x] += r.get("padding", 0)  # static batching records its padding rows per request
        if "waiting" in s["scheduler"]:  # the paged engine records its queue
            waiting = [w for w in s["scheduler"]["waiting"] if w in label]
        else:  # static batching: every request arrived at the start; the ones not started yet wait
            started.update(r["request_id"] for r in s["requests"])
            waiting = [i for i in ids if i not in started]
        for w in waiting:
            top.barh(ids.index(w), 1, left=x, color=PHASE_COLORS["waiting"], edgecolor="white")
            any_waiting = True
        for p in s["scheduler"].get("preempted", []):
            top.plot(x + 0.5, ids.index(p), "X", color=PHASE_COLORS["preempted"], ms=12, mec="black")
        for rid in s["sampled"]:
            top.plot(x + 0.9, ids.index(rid), "|", color="black", ms=8)
    top.set_yticks(range(len(ids)), [label[i] for i in ids])
    top.invert_yaxis()
    shown = {r["phase"] for s in trace["steps"] for r in s["requests"]}
    shown |= {"waiting"} if any_waiting else set()
    shown |= {"preempted"} if any(s["scheduler"].get("preempted") for s in trace["steps"]) else set()
    for name, color in PHASE_COLORS.items():
        if name in shown:
            top.plot([], [], "X" if name == "preempted" else "s", color=color, ms=10, label=name)
    top.plot([], [], "|", color="black", ms=10, label="token sampled")
    top.legend(ncol=7, fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0))
    top.set_title(title, pad=28)
    below = np.zeros(num_steps)
    for y, rid in enumerate(ids):
        bottom.bar(np.arange(num_steps) + 0.5, tokens[:, y], 0.9, bottom=below, label=label[rid])
        below += tokens[:, y]
    if padding.any():
        bottom.bar(
            np.arange(num_steps) + 0.5,
            padding,
            0.9,
            bottom=below,
            color="white",
            edgecolor="black",
            hatch="//",
            label="padding",
        )
    if budget:
        bottom.axhline(budget, color="black", ls=":", label="token budget")
    bottom.set_yscale("symlog", linthresh=8)
    bottom.set_ylabel("rows in step")
    bottom.set_xlabel("engine step")
    bottom.set_xlim(0, xmax or num_steps)
    bottom.legend(ncol=len(ids) + 2, fontsize=7)
    plt.tight_layout()
    plt.show()


# ---------------------------------------------------------------- reading kernels (notebooks 12a, 12b)

ROOT = Path(__file__).resolve().parents[1]  # the repository: kernels' files and committed results


def show_source(fn, start: str | None = None, stop: str | None = None) -> None:
    """Print a kernel's source from its file, optionally from the line holding `start` to the one with `stop`."""
    fn = getattr(fn, "fn", fn)  # a Triton kernel object keeps the Python function it was made from in .fn
    lines, first = inspect.getsourcelines(fn)
    i = next(n for n, line in enumerate(lines) if start in line) if start else 0
    j = next(n for n, line in enumerate(lines) if n > i and stop in line) + 1 if stop else len(lines)
    print(f"# {Path(inspect.getsourcefile(fn)).relative_to(ROOT)}, lines {first + i}-{first + j - 1}")
    for n, line in enumerate(lines[i:j], start=first + i):
        print(f"{n:4d} {line}", end="")


def committed_device_checks() -> dict:
    """GPU folder name -> the committed `benchmarks/results/<gpu>/device_check.json`, for each one present."""
    files = sorted(ROOT.glob("benchmarks/results/*/device_check.json"))
    return {p.parent.name: json.loads(p.read_text()) for p in files}


def device_results(kernel: str, runs: dict, on_gpu: bool) -> None:
    """Print what the committed device checks measured for one kernel family (a reference run elsewhere)."""
    for name, run in runs.items():
        gpu = run["sections"]["env"].get("gpu", {}).get("name", name)
        print(f"reference run on another machine ({gpu}, benchmarks/results/{name}), not this one:")
        for row in run["sections"].get("kernels", {}).get("rows", []):
            if not row["kernel"].startswith(kernel) or "error" in row:
                continue
            if "share_of_copy" in row:
                share = row["share_of_copy"]
                what = f"{row['triton_value']:,.0f} {row['metric']} = {share:.0%} of the copy bandwidth"
            else:
                ratio = row["ratio_vs_stock"]
                what = f"{row['triton_ms']:.3f} ms vs {row['stock']} {row['stock_ms']:.3f} ms ({ratio:.2f}x its speed)"
            print(f"{gpu}, {row['dtype']}, {row['shape']}: {what}")
    if not runs:
        where = "time the kernel on this GPU" if on_gpu else "this machine can check the kernel, not time it"
        print("no device check committed: " + where)


def steps_chart(steps: list[list[tuple[str, int]]], title: str, budget: int | None = None):
    """Stacked bars: the tokens each request got in every engine step (`[(request id, tokens), ...]`)."""
    import matplotlib.pyplot as plt

    ids = sorted({rid for step in steps for rid, _ in step}, key=lambda r: (len(r), r))
    fig, ax = plt.subplots(figsize=(12, 3.8))
    below = np.zeros(len(steps))
    for rid in ids:
        tokens = np.array([dict(step).get(rid, 0) for step in steps])
        ax.bar(np.arange(len(steps)), tokens, bottom=below, label=rid)
        below += tokens
    if budget:
        ax.axhline(budget, color="black", ls=":", label="token budget")
    ax.set_xlabel("engine step")
    ax.set_ylabel("tokens scheduled")
    ax.set_title(title)
    ax.legend(ncol=len(ids) + 1, fontsize=8)
    plt.tight_layout()
    plt.show()
