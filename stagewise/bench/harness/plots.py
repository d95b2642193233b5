"""Plots of benchmark results (matplotlib), for the benchmarks and the notebooks.

Every function draws on a given `ax` (or a new figure when `ax` is None) and
returns the axes, so a benchmark can compose several panels into one PNG and
a notebook can show one panel inline. Inputs are plain dicts and lists, the
same shapes the result JSON files hold, so a notebook can plot a committed
result without re-running anything.
"""

from pathlib import Path

# No backend is forced here: matplotlib picks a non-interactive one on a machine without a display,
# and a notebook keeps its inline backend.
import matplotlib.pyplot as plt

from stagewise.files import atomic_path

COLORS = {
    "naive": "tab:red",
    "kv": "tab:blue",
    "paged": "tab:green",
    "static": "tab:blue",
    "continuous": "tab:green",
    "transformers": "tab:orange",
    "optimized": "tab:green",
}


def _axes(ax):
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4.5))
    return ax


def _color(name: str, index: int):
    return COLORS.get(name, f"C{index % 10}")


def save_figure(fig, path: str | Path) -> Path:
    """Write `fig` as a PNG (parent folders created) and close it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    try:
        with atomic_path(path) as tmp:  # an interrupted save leaves the old PNG as it was
            fig.savefig(tmp, dpi=120)
    finally:
        plt.close(fig)
    return path


def plot_time_per_token(
    series: dict[str, tuple[list[int], list[float]]],
    fits: dict[str, tuple[list[int], list[float], str]] | None = None,
    ax=None,
    log_y: bool = True,
):
    """Milliseconds per output token against the context length N, one line per mode.

    `series`: mode -> (context lengths, measured ms per token);
    `fits`: mode -> (context lengths, fitted ms, label), drawn dashed (the seeds' cost curves:
    naive ~ a + b*N + c*N^2 per step, cached ~ a + b*N).
    """
    ax = _axes(ax)
    for i, (name, (context, ms)) in enumerate(series.items()):
        ax.plot(context, ms, ".", markersize=3, alpha=0.5, color=_color(name, i), label=f"{name} (measured)")
    for i, (name, (context, ms, label)) in enumerate((fits or {}).items()):
        ax.plot(context, ms, "--", linewidth=2, color=_color(name, i), label=f"{name} fit: {label}")
    ax.set_xlabel("context length N (tokens)")
    ax.set_ylabel("time per output token (ms)")
    if log_y:
        ax.set_yscale("log")
    ax.set_title("time per token as the context grows")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    return ax


def plot_throughput(
    values: dict[str, dict[str, float]],
    ylabel: str = "tokens/s",
    title: str = "throughput",
    ax=None,
    log_y: bool = False,
):
    """Grouped bars: `values[group][series]` (e.g. output length -> mode -> tokens/s)."""
    ax = _axes(ax)
    groups = list(values)
    names = list(dict.fromkeys(name for group in groups for name in values[group]))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        xs = [g + (i - (len(names) - 1) / 2) * width for g in range(len(groups))]
        ys = [values[group].get(name, 0.0) or 0.0 for group in groups]
        bars = ax.bar(xs, ys, width, label=name, color=_color(name, i))
        ax.bar_label(bars, fmt="%.3g", fontsize=7)
    ax.set_xticks(range(len(groups)), [str(g) for g in groups])
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if log_y:
        ax.set_yscale("log")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    return ax


def plot_latency_percentiles(data: dict[str, dict[str, dict[str, float]]], ax=None):
    """p50 (solid) and p99 (pale) bars: `data[system][metric] = {"p50": ms, "p99": ms}`, log scale.

    Metrics are the seeds' chapter 4: TTFT (the prefill), TBT (each decode step), latency (whole request).
    """
    ax = _axes(ax)
    systems = list(data)
    metrics = list(dict.fromkeys(m for s in systems for m in data[s]))
    width = 0.8 / max(1, len(systems))
    for i, system in enumerate(systems):
        xs = [m + (i - (len(systems) - 1) / 2) * width for m in range(len(metrics))]
        p99 = [data[system].get(metric, {}).get("p99") or 0.0 for metric in metrics]
        p50 = [data[system].get(metric, {}).get("p50") or 0.0 for metric in metrics]
        color = _color(system, i)
        ax.bar(xs, p99, width, color=color, alpha=0.35)
        ax.bar(xs, p50, width, color=color, label=f"{system} (p50 solid, p99 pale)")
    ax.set_xticks(range(len(metrics)), metrics)
    ax.set_ylabel("milliseconds (log)")
    ax.set_yscale("log")
    ax.set_title("latency percentiles")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=7)
    return ax


def plot_kv_over_time(
    series: dict[str, tuple[list[float], list[float]]],
    capacity: dict[str, float] | None = None,
    ax=None,
):
    """KV-cache bytes (as MiB) against seconds since the run started, one step line per system.

    `capacity`: system -> bytes allocated up front (drawn as a dotted horizontal line).
    """
    ax = _axes(ax)
    for i, (name, (times_s, num_bytes)) in enumerate(series.items()):
        ax.step(times_s, [b / 2**20 for b in num_bytes], where="post", color=_color(name, i), label=name)
    for i, (name, num_bytes) in enumerate((capacity or {}).items()):
        ax.axhline(num_bytes / 2**20, linestyle=":", color=_color(name, i), label=f"{name}: allocated")
    ax.set_xlabel("time since the requests arrived (s)")
    ax.set_ylabel("KV cache (MiB)")
    ax.set_title("KV memory over time (paged: blocks in use; static: reserved)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return ax


def plot_tbt_over_time(series: dict[str, tuple[list[float], list[float]]], ax=None):
    """Each gap between two tokens of one request (ms, log scale) at the time its second token arrived.

    A step that also prefills a long prompt chunk shows up as a column of tall gaps: every request that
    decoded in that step waited for the chunk. The dashed lines are each system's TBT p50 and p99.
    """
    import numpy as np

    ax = _axes(ax)
    for i, (name, (times_s, gaps_ms)) in enumerate(series.items()):
        color = _color(name, i)
        ax.scatter(times_s, gaps_ms, s=4, alpha=0.5, color=color, label=name)
        if gaps_ms:
            p50, p99 = np.percentile(gaps_ms, [50, 99])
            ax.axhline(p50, color=color, linestyle="--", linewidth=0.8)
            ax.axhline(p99, color=color, linestyle=":", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("time since the requests arrived (s)")
    ax.set_ylabel("time between tokens (ms)")
    ax.set_title("TBT over time (dashed: p50, dotted: p99)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, markerscale=3)
    return ax


def plot_stage_times(rows: list[dict], ax=None, note: str | None = None):
    """Bars of milliseconds per stage and shape, naive vs optimized, log scale.

    `rows`: dicts with "stage", "shape" (e.g. "prefill T=128"), "naive_ms", "optimized_ms".
    """
    ax = _axes(ax)
    labels = [f"{r['stage']}\n{r['shape']}" for r in rows]
    xs = range(len(rows))
    for offset, key, name, color in (
        (-0.2, "naive_ms", "naive", "tab:blue"),
        (0.2, "optimized_ms", "optimized", "tab:green"),
    ):
        ys = [r.get(key) or 0.0 for r in rows]
        ax.bar([x + offset for x in xs], ys, 0.4, label=name, color=color)
    ax.set_xticks(list(xs), labels, rotation=90, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("ms per call (median, log)")
    ax.set_title("per-stage time: naive PyTorch vs optimized" + (f"\n{note}" if note else ""), fontsize=9)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=7)
    return ax
