"""The table and the plot of `bench prefix` (stagewise/bench/commands/prefix.py)."""

from stagewise.bench.harness.plots import save_figure

COLORS = {"none": "#9e9e9e", "hash": "#1f77b4", "radix": "#d62728"}
PANELS = (
    ("reused_tokens", "tokens reused (prefix hits + shared by samples)"),
    ("ttft_ms", "mean time to first token (ms)"),
    ("peak_blocks_held", "most KV blocks requests held"),
    ("lookup_us_per_request", "lookup time per request (us)"),
)


def prefix_table(result: dict):
    """Per workload and cache: reuse, work, TTFT, blocks, lookup time, identical outputs."""
    from stagewise.trace.fit import Col, FitTable

    rows = []
    for workload, caches in result["results"].items():
        for cache, r in caches.items():
            share = r["reused_tokens"] / r["prompt_tokens"] if r["prompt_tokens"] else 0.0
            rows.append(
                [
                    workload,
                    cache,
                    f"{r['reused_tokens']} ({share:.0%})",
                    str(r["computed_tokens"]),
                    f"{r['ttft_ms']:.1f}",
                    f"{r['peak_blocks_held']} / {r['peak_blocks_used']}",
                    f"{r['lookup_us_per_request']:.1f}",
                    "yes" if r["identical"] else "NO",
                ]
            )
    cols = [
        Col("workload"),
        Col("prefix cache"),
        Col("tokens reused (of prompts)", "right"),
        Col("tokens computed", "right"),
        Col("TTFT ms", "right"),
        Col("peak blocks held / in use", "right"),
        Col("lookup us", "right"),
        Col("same bits", "right"),
    ]
    bs = result["settings"]["block_size"]
    return FitTable(f"bench prefix: none vs hash vs radix, block size {bs}", cols, rows, keys=2)


def plot_prefix(result: dict, path) -> None:
    """Four panels (reuse, TTFT, blocks held, lookup time), one group of bars per workload."""
    import matplotlib.pyplot as plt

    workloads = list(result["results"])
    caches = list(next(iter(result["results"].values())))
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    width = 0.8 / len(caches)
    for ax, (key, title) in zip(axes.flat, PANELS):
        for j, cache in enumerate(caches):
            xs = [i + (j - (len(caches) - 1) / 2) * width for i in range(len(workloads))]
            ys = [result["results"][w][cache][key] for w in workloads]
            ax.bar(xs, ys, width, label=cache, color=COLORS.get(cache))
        ax.set_xticks(range(len(workloads)), workloads)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes.flat[0].legend(title="prefix cache")
    model = result.get("model", {}).get("name", "")
    fig.suptitle(f"prefix caches on {model}: block size {result['settings']['block_size']}", fontsize=11)
    fig.tight_layout()
    save_figure(fig, path)
