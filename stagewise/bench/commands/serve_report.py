"""The report of `bench serve`: its table (one row per mode and rate) and its plot (metrics against the rate).

Both read only the result dict (the JSON's shape), so a notebook can redraw a committed result.
"""


def _ms(value) -> str:
    return "-" if value is None else f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def serve_table(result: dict):
    """One row per mode and rate (FitTable: columns split onto more tables at a narrow terminal, never cut)."""
    from stagewise.trace.fit import Col, FitTable

    s = result["settings"]
    title = (
        f"bench serve — {s['model']}, {s['num_prompts']} requests per rate, Poisson arrivals, prompts "
        f"{s['prompt_tokens'][0]}-{s['prompt_tokens'][1]} tokens, outputs {s['output_tokens'][0]}-"
        f"{s['output_tokens'][1]}, {s['max_num_seqs']} seats"
    )
    cols = [Col("batching"), Col("rate (req/s)", "right"), Col("ok / failed / lost", "right")]
    cols += [Col(h, "right") for h in ("TTFT p50 / p99 (ms)", "TTFT p99 ÷ p50", "TBT p50 / p99 (ms)")]
    cols += [Col(h, "right") for h in ("latency p50 / p99 (ms)", "requests/s", "output tok/s")]
    rows = []
    for run in result["runs"]:
        m = run["summary"]
        ratio = "-" if m["ttft_p99_over_p50"] is None else f"{m['ttft_p99_over_p50']:.1f}x"
        rows.append(
            [
                f"{run['system']} ({run['mode']})",
                run["rate"],
                f"{m['completed']} / {m['failed']} / {m['lost']}",
                f"{_ms(m['ttft_ms_p50'])} / {_ms(m['ttft_ms_p99'])}",
                ratio,
                f"{_ms(m['tbt_ms_p50'])} / {_ms(m['tbt_ms_p99'])}",
                f"{_ms(m['latency_ms_p50'])} / {_ms(m['latency_ms_p99'])}",
                f"{m['request_throughput']:.2f}",
                f"{m['output_tok_per_s']:.1f}",
            ]
        )
    return FitTable(title, cols, rows, keys=2, caption=result["static_batching"])


def plot_serve(result: dict, path) -> None:
    """Four panels against the request rate: TTFT and TBT p50 (solid) / p99 (dashed), TTFT p99 ÷ p50, throughput."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    from stagewise.bench.harness.plots import COLORS, save_figure

    rates = list(result["settings"]["request_rates"])
    xs = range(len(rates))
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    panels = (("ttft", "TTFT (ms, log)"), ("tbt", "TBT (ms, log)"))
    for ax, (metric, label) in zip(axes.flat, panels):
        for system, by_rate in result["summary"].items():
            for q, style in (("p50", "-o"), ("p99", "--s")):
                ys = [by_rate[r][f"{metric}_ms_{q}"] if r in by_rate else None for r in rates]
                ax.plot(xs, ys, style, color=COLORS.get(system), label=f"{system} {q}")
        ax.set_yscale("log")
        ax.set_ylabel(label)
    ratio, tput = axes.flat[2], axes.flat[3]
    for system, by_rate in result["summary"].items():
        ys = [by_rate[r]["ttft_p99_over_p50"] if r in by_rate else None for r in rates]
        ratio.plot(xs, ys, "-o", color=COLORS.get(system), label=system)
        ys = [by_rate[r]["output_tok_per_s"] if r in by_rate else None for r in rates]
        tput.plot(xs, ys, "-o", color=COLORS.get(system), label=system)
    for level, text in ((10, "10x"), (3, "3x")):
        ratio.axhline(level, color="gray", linestyle=":", linewidth=1)
        ratio.annotate(text, (0, level), xytext=(2, 2), textcoords="offset points", fontsize=7, color="gray")
    ratio.set_yscale("log")
    ratio.set_ylabel("TTFT p99 ÷ p50 (log)")
    tput.set_ylabel("output tokens/s")
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    for ax in axes.flat:
        ax.set_xticks(list(xs), rates)
        ax.set_xlabel("request rate (req/s, Poisson; inf = all at t = 0)")
        ax.grid(True, which="both", alpha=0.3)
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
        ax.tick_params(axis="y", which="minor", labelsize=6)
        ax.legend(fontsize=7)
    s = result["settings"]
    fig.suptitle(
        f"bench serve — {s['model']}, {s['num_prompts']} requests per rate, {s['max_num_seqs']} seats\n"
        "static: a batch of the requests waiting when it starts, run to completion",
        fontsize=10,
    )
    save_figure(fig, path)
