"""The report of `bench serve-limits`: its table (the two comparisons) and its plot.

Both read only the result dict (the JSON's shape), so a notebook can redraw a committed result.
"""


def limits_table(result: dict):
    from stagewise.trace.fit import Col, FitTable

    s, v = result["stop_strings"], result["view"]

    def ms(x):
        return "-" if x is None else f"{x:.1f}"

    def times(x):
        return "-" if x is None else f"{x:.2f}x"

    rows = [
        [
            f"TBT p50 / p99 of {result['settings']['streams']} streams (ms)",
            f"{ms(s['tbt_ms_p50_alone'])} / {ms(s['tbt_ms_p99_alone'])}",
            f"{ms(s['tbt_ms_p50_beside'])} / {ms(s['tbt_ms_p99_beside'])}",
            f"{times(s['tbt_p50_ratio'])} (<= 2x)",
        ],
        [
            f"server's mean TBT of {result['settings']['view_streams']} streams (ms)",
            ms(v["server_tbt_ms_mean_unwatched"]),
            f"{ms(v['server_tbt_ms_mean_watched'])} ({v['accepted']} watching, {v['refused']} refused)",
            f"speed {times(v['speed_ratio'])} (>= 0.90x)",
        ],
    ]
    cols = [Col("measured"), Col("alone", "right"), Col("beside the cost", "right"), Col("ratio", "right")]
    title = (
        f"bench serve-limits — {result['settings']['model']}: {s['stop_list']['strings']} stop strings of "
        f"{s['stop_list']['characters_each']} chars; {v['subscribers_tried']} view watchers tried"
    )
    return FitTable(title, cols, rows, keys=1)


def plot_limits(result: dict, path) -> None:
    """Two panels: TBT p50 / p99 alone and beside the stop list; output tok/s unwatched and watched."""
    import matplotlib.pyplot as plt

    from stagewise.bench.harness.plots import save_figure

    s, v = result["stop_strings"], result["view"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    labels = ["p50", "p99"]
    alone = [s["tbt_ms_p50_alone"] or 0, s["tbt_ms_p99_alone"] or 0]
    beside = [s["tbt_ms_p50_beside"] or 0, s["tbt_ms_p99_beside"] or 0]
    xs = range(len(labels))
    left.bar([x - 0.2 for x in xs], alone, 0.4, label="alone", color="tab:blue")
    left.bar([x + 0.2 for x in xs], beside, 0.4, label="beside the largest stop list", color="tab:orange")
    left.set_xticks(list(xs), labels)
    left.set_ylabel("time between tokens (ms)")
    left.set_title(f"{result['settings']['streams']} streams: TBT")
    left.legend()
    speeds = [1e3 / t if t else 0 for t in (v["server_tbt_ms_mean_unwatched"], v["server_tbt_ms_mean_watched"])]
    right.bar([0, 1], speeds, color=["tab:blue", "tab:orange"])
    right.set_xticks([0, 1], ["no watcher", f"{v['accepted']} watching\n({v['refused']} refused)"])
    right.set_ylabel("tokens / s per stream (1 / server's mean TBT)")
    right.set_title(f"{result['settings']['view_streams']} streams: decoding speed")
    save_figure(fig, path)
