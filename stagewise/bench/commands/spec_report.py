"""The table and the plot of `bench spec` (stagewise/bench/commands/spec.py)."""

from stagewise.bench.harness.plots import save_figure


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def spec_table(result: dict):
    """Per format, workload and system: tokens/s (TTFT included) and decode tokens/s (after the
    first token), each with its speed-up, acceptance, guesses kept per verify step; then the
    verify step's cost against a decode step per format."""
    from rich.console import Group

    from stagewise.trace.fit import Col, FitTable

    k = result["settings"]["num_speculative_tokens"]
    rows = []
    for fmt, kinds in result["summary"].items():
        for kind, systems in kinds.items():
            for system, s in systems.items():
                rows.append(
                    [
                        f"{fmt} / {kind}",
                        system,
                        _num(s["tokens_per_s"], ".1f"),
                        _num(s["speedup"], ".2f") + "x",
                        _num(s["decode_tokens_per_s"], ".1f"),
                        _num(s["decode_speedup"], ".2f") + "x",
                        _num(s["acceptance_rate"], ".0%"),
                        _num(s["mean_accepted_per_step"], ".2f"),
                        "yes" if s["identical"] else "NO",
                    ]
                )
    cols = [
        Col("format / workload"),
        Col("speculation"),
        Col("tokens/s", "right"),
        Col("vs none", "right"),
        Col("decode tok/s", "right"),
        Col("vs none ", "right"),
        Col("accepted", "right"),
        Col(f"kept/step (of {k})", "right"),
        Col("same text", "right"),
    ]
    main = FitTable(f"bench spec: k = {k}, batch 1, greedy", cols, rows, keys=2)
    step_rows = [
        [
            fmt,
            str(s["context"]),
            _num(s["decode_ms"], ".1f"),
            _num(s["verify_ms"], ".1f"),
            _num(s["verify_over_decode"], ".2f") + "x",
        ]
        for fmt, s in result["verify_step"].items()
    ]
    step_cols = [
        Col("format"),
        Col("context", "right"),
        Col("decode step ms (1 row)", "right"),
        Col(f"verify step ms ({k + 1} rows)", "right"),
        Col("ratio", "right"),
    ]
    steps = FitTable("verify step vs decode step", step_cols, step_rows)
    return Group(main, steps)


def plot_spec(result: dict, path) -> None:
    """Left: decode tokens/s per format and workload, one bar per system, labelled with the
    speed-up over no speculation. Right: the two step costs per format."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5), gridspec_kw={"width_ratios": [3, 1]})
    groups = [(fmt, kind) for fmt, kinds in result["summary"].items() for kind in kinds]
    systems = list(next(iter(next(iter(result["summary"].values())).values())))
    width = 0.8 / len(systems)
    for j, system in enumerate(systems):
        xs = [i + (j - (len(systems) - 1) / 2) * width for i in range(len(groups))]
        ys = [result["summary"][fmt][kind][system]["decode_tokens_per_s"] for fmt, kind in groups]
        bars = left.bar(xs, ys, width, label=system, color=f"C{j}")
        for bar, (fmt, kind) in zip(bars, groups):
            speedup = result["summary"][fmt][kind][system]["decode_speedup"]
            left.annotate(f"{speedup:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                          ha="center", va="bottom", fontsize=7)  # fmt: skip
    left.set_xticks(range(len(groups)), [f"{fmt}\n{kind}" for fmt, kind in groups])
    left.set_ylabel("decode tokens/s (after the first token)")
    left.set_title(f"speculative decoding, k = {result['settings']['num_speculative_tokens']}")
    left.legend(fontsize=8)
    fmts = list(result["verify_step"])
    decode = [result["verify_step"][f]["decode_ms"] for f in fmts]
    verify = [result["verify_step"][f]["verify_ms"] for f in fmts]
    xs = range(len(fmts))
    right.bar([x - 0.2 for x in xs], decode, 0.4, label="decode (1 row)", color="gray")
    right.bar([x + 0.2 for x in xs], verify, 0.4, label="verify (k+1 rows)", color="tab:purple")
    right.set_xticks(list(xs), fmts)
    right.set_ylabel("ms per step")
    right.set_title("step cost", fontsize=10)
    right.legend(fontsize=7)
    save_figure(fig, path)
