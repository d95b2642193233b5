"""The notebooks' figures: each function draws one picture from numbers the notebook computed.

A notebook cell then reads as the idea (compute, then `viz.gqa_map(...)`), and
the matplotlib calls live here. Every function takes plain data (lists, dicts of
the tracer's JSON, tensors) and returns the figure it drew; matplotlib is
imported only when a function runs, so importing `stagewise.viz` costs nothing.

This module holds the figures of notebooks 00, 03, 05, 11 and 13 (the pipeline, GQA,
attention, the roofline, tensor parallelism); the others live beside it:

- `viz.stages`    the stage notebooks 01, 02, 04, 06, 07, 14, 15 (tokenizer to sampling, quantization, speculation)
- `viz.engine`    the engine notebooks 09, 10, 16 (the block pool, a trace's timeline, steps)
- `viz.trace`     a trace's steps as text (notebook 10)
- `viz.kernels`   what notebooks 12a and 12b print while reading kernels, and their pictures
"""

import math


def _plt():
    import matplotlib.pyplot as plt

    return plt


def _done(fig):
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- 00 the pipeline


def layer_board(recs: list[dict], tokens: int, hidden: int, title: str):
    """One decoder layer as a teacher draws it: the traced stage calls of a layer, top to bottom.

    `recs` are one layer's stage records of a traced step (`to_json(tracer)["steps"][i]["stages"]`):
    each box names the stage and the weight it reads, each arrow the shape that flows out;
    the residual stream runs down the left, read and added where an RMSNorm takes `residual`.
    """
    plt = _plt()

    def weight_of(rec):
        weights = [t for t in rec["inputs"] if t["name"].startswith("w") or t["name"] == "weight"]
        return " ".join(f"{t['name']} {t['shape']}" for t in weights)

    def flows_out(rec):
        out = [t for t in rec["outputs"] if t["name"] not in ("k_cache", "v_cache")]
        return ", ".join(f"{t['name']} {t['shape']}" for t in out[:2]) or "K, V -> cache slots"  # in place

    fig, ax = plt.subplots(figsize=(12, 0.95 * len(recs) + 1.8))
    top = len(recs) + 0.6
    ax.text(2.5, top + 0.35, f"h: [{tokens}, {hidden}]  (embedding output, T = {tokens} prompt tokens)", ha="center")
    for i, rec in enumerate(recs):
        y = len(recs) - i - 0.5
        add = any(t["name"] == "residual" for t in rec["inputs"])
        color = {"rmsnorm": "#c6dbef", "ffn": "#c7e9c0", "kv_store": "#fdd0a2"}.get(rec["stage"], "#dadaeb")
        ax.add_patch(plt.Rectangle((1, y), 3, 0.6, color=color, ec="black"))
        ax.text(2.5, y + 0.3, rec["stage"] + ("  (+ residual)" if add else ""), ha="center", va="center")
        ax.text(4.2, y + 0.3, weight_of(rec), va="center", fontsize=8, color="dimgray")
        ax.annotate("", xy=(2.5, y + 0.6), xytext=(2.5, y + 1.0), arrowprops=dict(arrowstyle="->"))
        ax.text(2.6, y - 0.2, flows_out(rec), fontsize=8, va="center")
        if rec["stage"] == "rmsnorm":  # the residual stream: read and added here (<->), or started here (<-)
            style = "<->" if add else "<-"
            ax.annotate("", xy=(1, y + 0.3), xytext=(0.2, y + 0.3), arrowprops=dict(arrowstyle=style, color="tab:red"))
    ax.plot([0.2, 0.2], [len(recs) - 0.2, -0.6], color="tab:red", lw=2)
    ax.text(0.1, len(recs) / 2, "residual stream [T, hidden]", rotation=90, ha="right", va="center", color="tab:red")
    ax.text(2.5, -0.7, "-> next layer (its first RMSNorm adds this FFN output to the residual stream)", ha="center")
    ax.set(xlim=(-0.5, 9.5), ylim=(-1, top + 0.8), title=title)
    ax.axis("off")
    return _done(fig)


def shape_flow_and_time(prefill: dict, decode: dict):
    """Left: numbers per row of each stage's output (layer 0 + head) in prefill; right: time per stage.

    `prefill` and `decode` are two steps of the tracer's JSON export; the time per stage is
    summed over the layers and shown as a share of the step's stage time.
    """
    plt = _plt()
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5))
    flow = [s for s in prefill["stages"] if s["layer"] in (0, None) and s["outputs"]]
    labels = [s["stage"] + (" L0" if s["layer"] is not None else " (final)" * (s["stage"] == "rmsnorm")) for s in flow]
    widths = [math.prod(s["outputs"][0]["shape"][1:]) for s in flow]  # numbers per token (or per sequence)
    left.barh(range(len(flow)), widths, color="tab:blue")
    for i, s in enumerate(flow):
        left.text(widths[i], i, f" {s['outputs'][0]['shape']}", va="center", fontsize=8)
    left.set_yticks(range(len(flow)), labels)
    left.invert_yaxis()
    left.set(xscale="log", xlim=(0.8, max(widths) * 20), title="shape flow of the prefill step (layer 0 + head)")
    left.set_xlabel("numbers per row of the stage's first output (log scale)")

    def per_stage(step):
        totals: dict[str, float] = {}
        for s in step["stages"]:
            totals[s["stage"]] = totals.get(s["stage"], 0.0) + (s["dur_us"] or 0.0)
        return {k: 100 * v / sum(totals.values()) for k, v in totals.items()}

    pre, dec = per_stage(prefill), per_stage(decode)
    names = sorted(pre, key=pre.get)
    right.barh([i + 0.2 for i in range(len(names))], [pre[n] for n in names], 0.4, label="prefill")
    right.barh([i - 0.2 for i in range(len(names))], [dec.get(n, 0) for n in names], 0.4, label="decode")
    right.set_yticks(range(len(names)), names)
    right.set_xlabel("% of the step's stage time (summed over layers)")
    right.set_title(f"prefill ({prefill['dur_us'] / 1e3:.0f} ms) vs one decode step ({decode['dur_us'] / 1e3:.0f} ms)")
    right.legend()
    return _done(fig)


# ---------------------------------------------------------------- 03 GQA


def gqa_map(configs: list[tuple[int, int, str]]):
    """One row per (num_heads, num_kv_heads, title): query heads above, the KV head each one reads below."""
    plt = _plt()
    fig, axes = plt.subplots(len(configs), 1, figsize=(13, 3 * len(configs)), squeeze=False)
    colours = plt.cm.tab10.colors
    for ax, (num_heads, num_kv_heads, title) in zip(axes[:, 0], configs):
        group, qw, kw = num_heads // num_kv_heads, 1.0 / num_heads, 1.0 / num_kv_heads  # box widths (axes fraction)
        for hq in range(num_heads):
            c = colours[(hq // group) % 10]
            ax.add_patch(plt.Rectangle((hq * qw, 0.65), qw * 0.9, 0.25, facecolor=c, edgecolor="white", lw=0.5))
            ax.plot([(hq + 0.45) * qw, (hq // group + 0.45) * kw], [0.65, 0.35], color=c, lw=0.6, alpha=0.6)
            if num_heads <= 16:
                ax.text((hq + 0.45) * qw, 0.775, f"q{hq}", ha="center", va="center", color="white", fontsize=9)
        for kv in range(num_kv_heads):
            ax.add_patch(plt.Rectangle((kv * kw, 0.1), kw * 0.9, 0.25, color=colours[kv % 10]))
            ax.text((kv + 0.45) * kw, 0.225, f"kv{kv}", ha="center", va="center", color="white", fontsize=9)
        ax.text(0, 0.95, "query heads", fontsize=9, va="bottom")
        ax.text(0, 0.02, "KV heads (what the cache stores)", fontsize=9, va="bottom")
        ax.set(xlim=(0, 1), ylim=(0, 1.05), title=title)
        ax.axis("off")
    return _done(fig)


def kv_per_token(rows: list[tuple[str, float, float, int]]):
    """Per model (name, MHA bytes, GQA bytes, group size): its KV cache per token, both ways, log scale.

    The factor written over each GQA bar is the group size H / Hkv, the saving.
    """
    fig, ax = _plt().subplots(figsize=(10, 4.5))
    xs = range(len(rows))
    ax.bar([i - 0.2 for i in xs], [mha / 1e3 for _, mha, _, _ in rows], 0.4, label="MHA (Hkv = H)", color="tab:gray")
    ax.bar([i + 0.2 for i in xs], [gqa / 1e3 for _, _, gqa, _ in rows], 0.4, label="GQA (the real models)",
           color="tab:green")  # fmt: skip
    for i, (_, _, gqa, group) in enumerate(rows):
        ax.text(i + 0.2, gqa / 1e3, f"/{group}", ha="center", va="bottom")
    ax.set_xticks(list(xs), [name for name, *_ in rows])
    ax.set_yscale("log")
    ax.set(ylabel="KV cache per token, kB (bf16, all layers)", title="GQA shrinks the KV cache by H / Hkv")
    ax.legend()
    return _done(fig)


# ---------------------------------------------------------------- 05 attention


def attention_probs(p, labels: list[str], title: str):
    """The probabilities P [L, L] of one head as a heat map, tokens on both axes."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 5.5))
    im = ax.imshow(p, cmap="magma", vmax=min(1.0, float(p.max())))
    ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=6)
    ax.set_yticks(range(len(labels)), labels, fontsize=6)
    ax.set(title=title, xlabel="key", ylabel="query")
    fig.colorbar(im, ax=ax, fraction=0.046)
    return _done(fig)


def online_softmax_tiles(scores: list[float], m_hist: list[float], l_hist: list[float], block_n: int, title: str):
    """Left: a row's scores by tile with the running max m and sum l; right: how each tile's l is made.

    `m_hist[j]`, `l_hist[j]` are the state after tile j. Each bar on the right stacks the old
    sum rescaled by alpha = exp(m_old - m_new) and the tile's own terms, labelled with alpha.
    """
    plt = _plt()
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 4.5))
    tiles = list(range(len(m_hist)))
    key_x = [j / block_n - 0.5 + 0.5 / block_n for j in range(len(scores))]  # key j inside its tile's slot
    left.bar(key_x, scores, width=0.9 / block_n, color="lightgray", label="scores s, per key")
    left.step(tiles, m_hist, where="mid", color="tab:red", lw=2, label="running max m")
    left.set_xlabel(f"tile (BLOCK_N = {block_n} keys)")
    left.set_ylabel("score", color="tab:red")
    left.legend(loc="lower right", fontsize=8)
    twin = left.twinx()
    twin.plot(tiles, l_hist, "o-", color="tab:blue")
    twin.set_ylabel("running sum l = sum exp(s - m)", color="tab:blue")
    left.set_title(title)
    alphas = [1.0] + [math.exp(m_hist[j - 1] - m_hist[j]) for j in tiles[1:]]
    carried = [0.0] + [l_hist[j - 1] * alphas[j] for j in tiles[1:]]  # alpha * l_old
    right.bar(tiles, carried, color="lightgray", label="alpha * l_old (rescaled old sum)")
    right.bar(tiles, [l_hist[j] - carried[j] for j in tiles], bottom=carried, color="tab:blue",
              label="this tile: sum exp(s_j - m_new)")  # fmt: skip
    for j in tiles[1:]:
        right.text(j, l_hist[j], f"alpha={alphas[j]:.2f}", ha="center", va="bottom", fontsize=8)
    right.set(xlabel="tile", ylabel="l after the tile", title="l = alpha * l_old + this tile's terms")
    right.legend(fontsize=8)
    return _done(fig)


def visible_keys(visible, cu_q: list[int], cu_k: list[int], title: str):
    """The [Tq, Tk] mask of which packed key rows each packed query row may see, sequences ruled off."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.imshow(visible, cmap="Greens", aspect="auto", interpolation="nearest")
    for c in cu_q[1:-1]:
        ax.axhline(c - 0.5, color="gray", lw=0.8)
    for c in cu_k[1:-1]:
        ax.axvline(c - 0.5, color="gray", lw=0.8)
    ax.set(xlabel="key row (packed, cu_seqlens_k)", ylabel="query row (packed, cu_seqlens_q)", title=title)
    return _done(fig)


def loglog_panels(panels: list[dict], width: float = 5.7):
    """Side-by-side log-log plots; each panel: title, xlabel, ylabel, curves [(x, y, style, color, label)], hline.

    `hline` is an optional (y, label): a dashed horizontal reference such as "all the model's weights".
    """
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(width * len(panels), 4.5), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for x, y, style, color, label in panel["curves"]:
            ax.loglog(x, y, style, color=color, label=label)
        if panel.get("hline"):
            ax.axhline(panel["hline"][0], color="gray", ls="--", lw=1, label=panel["hline"][1])
        ax.set(xlabel=panel["xlabel"], ylabel=panel["ylabel"], title=panel["title"])
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, which="both")
    return _done(fig)


# ---------------------------------------------------------------- 13 tensor parallelism


def matrix_splits(panels: list[tuple[str, int, int, list[tuple[int, int, int]], bool]], ranks: int, title: str):
    """One panel per weight: (title, width, height, spans, by_columns), each span (start, stop, rank) coloured."""
    plt = _plt()
    colors = plt.cm.tab10.colors
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 3.6))
    for ax, (name, width, height, spans, by_columns) in zip(axes, panels):
        for start, stop, rank in spans:
            xy, w, h = ((start, 0), stop - start, height) if by_columns else ((0, height - stop), width, stop - start)
            ax.add_patch(plt.Rectangle(xy, w, h, color=colors[rank], alpha=0.8, ec="white"))
        ax.set(xlim=(0, width), ylim=(0, height), xticks=[], yticks=[])
        ax.set_title(name, fontsize=10)
    for r in range(ranks):
        axes[-1].plot([], [], color=colors[r], lw=8, label=f"rank {r}")
    axes[-1].legend(loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.suptitle(title)
    return _done(fig)


def per_rank_times(kinds: list[str], ms_by_rank: dict[int, list[float]], title: str):
    """One bar per (stage kind, rank): ms of that rank's calls of that kind in a step, ranks side by side."""
    fig, ax = _plt().subplots(figsize=(10, 3.5))
    height = 0.8 / len(ms_by_rank)
    for k, (rank, ms) in enumerate(ms_by_rank.items()):
        ax.barh([i + height * k for i in range(len(kinds))], ms, height=height, label=f"rank {rank}")
    ax.set_yticks([i + height * (len(ms_by_rank) - 1) / 2 for i in range(len(kinds))], kinds)
    ax.set(xlabel="ms in the last step", title=title)
    ax.legend()
    return _done(fig)


def stacked_rows(names: list[str], parts: list[tuple[str, list[float]]], xlabel: str, title: str):
    """One horizontal bar per name, its parts (label, values) stacked left to right."""
    fig, ax = _plt().subplots(figsize=(9, 3))
    left = [0.0] * len(names)
    for label, values in parts:
        ax.barh(names, values, left=left, label=label)
        left = [a + b for a, b in zip(left, values)]
    ax.set(xlabel=xlabel, title=title)
    ax.legend(loc="lower right")
    return _done(fig)
