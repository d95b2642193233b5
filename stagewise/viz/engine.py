"""Pictures of the engine for notebooks 09, 10 and 16: the block pool, a trace's timeline, steps, timings.

Plotting only; the notebooks import these so their cells stay about the idea. matplotlib is
imported when a function is called, not when this module is. (Printing a trace's steps as
text: `viz/trace.py`.)
"""

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


# ---------------------------------------------------------------- notebook 10: batching measured


def work_and_latency(stats: dict, latencies: dict, request_labels: list[str]):
    """Left: rows computed per engine (real vs padding); right: each request's latency per engine.

    `stats`: engine name -> its `last_stats` (tokens_computed, padding_tokens);
    `latencies`: engine name -> seconds from arrival to last token, one per request.
    """
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 4.5), gridspec_kw={"width_ratios": [1, 3]})
    names, colors = list(stats), ["tab:blue", "tab:green"]
    real = [st.tokens_computed - st.padding_tokens for st in stats.values()]
    left.bar(names, real, color=colors, label="real tokens")
    left.bar(names, [st.padding_tokens for st in stats.values()], bottom=real, color="tab:red", label="padding")
    left.set_ylabel("rows pushed through the model")
    left.set_title("work done")
    left.legend()
    x = np.arange(len(request_labels))
    for offset, (name, lat), color in zip((-0.2, 0.2), latencies.items(), colors):
        right.bar(x + offset, lat, 0.4, color=color, label=name)
    right.set_xticks(x, request_labels, fontsize=8)
    right.set_ylabel("seconds from arrival to last token")
    right.set_title("latency per request (prompt + output tokens)")
    right.legend()
    plt.tight_layout()
    plt.show()


def step_time_and_throughput(step_ms: dict, model_name: str):
    """Left: decode step time against the batch B (with B x the B = 1 step); right: throughput against TBT."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    batch, ms = np.array(list(step_ms)), np.array(list(step_ms.values()))
    left.plot(batch, ms, "o-", color="tab:blue", label="measured decode step")
    left.plot(batch, ms[0] * batch / batch[0], ":", color="gray", label=f"B x the step at B={batch[0]} (no sharing)")
    left.set_xscale("log", base=2)
    left.set_xticks(batch, [str(b) for b in batch])
    left.set_ylim(0, max(ms) * 1.3)
    left.set_xlabel("running sequences B")
    left.set_ylabel("decode step time = TBT (ms)")
    left.set_title(f"{model_name}, float32: one step for B sequences")
    left.legend()
    right.plot(ms, batch / ms * 1e3, "o-", color="tab:green")
    for b, t in zip(batch, ms):
        right.annotate(f"B={b}", (t, b / t * 1e3), textcoords="offset points", xytext=(6, -4), fontsize=9)
    right.set_xlabel("TBT each user sees (ms)")
    right.set_ylabel("throughput (output tokens/s)")
    right.set_title("what a larger batch buys, and what it costs")
    plt.tight_layout()
    plt.show()


def gaps_while_prefilling(runs: dict, long_tokens: int):
    """Every gap one decoding request saw, per setting; shaded: the long prompt, arrival to first token.

    `runs`: setting name -> {"arrivals": request id -> token times, "decoders", "long", "long_arrival", "cap"}.
    """
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 4.5))
    for (name, run), color in zip(runs.items(), ("tab:red", "tab:blue")):
        times = run["arrivals"][run["decoders"][0]]
        ax.plot(
            times[1:],
            1e3 * np.diff(times),
            "o-",
            ms=3,
            color=color,
            label=f"prefill_beside_decodes={run['cap']} ({name})",
        )
        ax.axvspan(run["long_arrival"], run["arrivals"][run["long"]][0], color=color, alpha=0.12)
    ax.set_ylim(0, None)
    ax.set_xlabel("seconds since the decoders were submitted")
    ax.set_ylabel("gap before this token (ms)")
    ax.set_title(f"TBT of a decoding request while a {long_tokens}-token prompt is prefilled (shaded: the long prompt)")
    ax.legend()
    plt.tight_layout()
    plt.show()


# ---------------------------------------------------------------- notebook 09: the block pool

OWNER_COLORS = ["white", "tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]


def block_pool_over_time(owner: np.ndarray, legend: list[str], arrivals: dict, title: str):
    """One row per engine step, one column per physical block, coloured by its owner (0 = free).

    `owner [steps, num_blocks]`: 1 + the index of the owning request in `legend`;
    `arrivals`: legend index -> the step before which that request arrives (dashed line).
    """
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    num_steps, num_blocks = owner.shape
    colors = OWNER_COLORS[: len(legend) + 1]
    fig, ax = plt.subplots(figsize=(11, 7))
    ax.imshow(owner, cmap=ListedColormap(colors), vmin=0, vmax=len(colors) - 1, aspect="auto", interpolation="nearest")
    ax.set_xticks(range(num_blocks))
    ax.set_xticks(np.arange(-0.5, num_blocks), minor=True)
    ax.set_yticks(np.arange(-0.5, num_steps), minor=True)
    ax.grid(which="minor", color="lightgray", lw=0.5)
    ax.tick_params(which="minor", length=0)
    ax.set_xlabel("physical block id")
    ax.set_ylabel("engine step")
    for k, at in arrivals.items():
        ax.axhline(at - 0.5, color=colors[k + 1], lw=2, ls="--")
        ax.text(num_blocks - 0.4, at - 0.6, f"{legend[k].split(':')[0]} arrives", ha="right", va="bottom", fontsize=9)
    for k, text in enumerate(legend):
        ax.plot([], [], "s", color=colors[k + 1], ms=10, label=text)
    ax.plot([], [], "s", color="white", mec="gray", ms=10, label="free")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.set_title(title)
    plt.tight_layout()
    plt.show()


def block_table_board(rows: list[tuple], num_blocks: int, block_size: int, title: str):
    """Block-table rows (left) with an arrow from each entry to its physical block in the pool (right).

    `rows`: (label, color index, block-table row, tokens cached) per running request; each pool
    block is filled as far as it holds that request's tokens.
    """
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 6.5))
    pool_x, pool_w = 8.0, 3.0
    for b in range(num_blocks):
        ax.add_patch(plt.Rectangle((pool_x, num_blocks - 1 - b), pool_w, 0.85, fill=False, ec="gray"))
        ax.text(pool_x + pool_w + 0.1, num_blocks - 1 - b + 0.42, f"block {b}", va="center", fontsize=8)
    for (label, k, table, cached), y in zip(rows, np.linspace(num_blocks - 2, 1, len(rows))):
        color = OWNER_COLORS[k]
        ax.text(-0.2, y + 0.42, label, ha="right", va="center", fontsize=9)
        for i, b in enumerate(table):
            ax.add_patch(plt.Rectangle((i, y), 0.9, 0.85, color=color, zorder=2))
            ax.text(i + 0.45, y + 0.42, str(b), ha="center", va="center", color="white", fontsize=10, zorder=3)
            held = max(0, min(block_size, cached - i * block_size))
            ax.add_patch(plt.Rectangle((pool_x, num_blocks - 1 - b), pool_w * held / block_size, 0.85, color=color))
            arrow = dict(arrowstyle="->", color=color, lw=1.2, connectionstyle="arc3,rad=-0.1")
            ax.annotate("", xy=(pool_x, num_blocks - 1 - b + 0.42), xytext=(i + 0.45, y + 0.42), arrowprops=arrow)
    ax.set_xlim(-3, pool_x + pool_w + 1.2)
    ax.set_ylim(-0.5, num_blocks + 0.5)
    ax.axis("off")
    ax.set_title(title)
    plt.tight_layout()
    plt.show()


def shared_rows(rows: list[list[int]], labels: list[str], block_size: int):
    """Block-table rows side by side; a physical block that appears in more than one row is gold."""
    import matplotlib.pyplot as plt

    shared = set.intersection(*(set(r) for r in rows))
    width = max(len(r) for r in rows)
    fig, ax = plt.subplots(figsize=(1.0 * width + 3, 1.2 * len(rows)))
    for y, row in enumerate(rows):
        for x, b in enumerate(row):
            color = "gold" if b in shared else OWNER_COLORS[y + 1]
            ax.add_patch(plt.Rectangle((x, len(rows) - 1 - y), 0.95, 0.9, color=color))
            ax.text(x + 0.47, len(rows) - 1 - y + 0.45, str(b), ha="center", va="center", fontsize=11)
    ax.set_xlim(0, width)
    ax.set_ylim(0, len(rows))
    ax.set_yticks([len(rows) - 1 - y + 0.45 for y in range(len(rows))], labels)
    ax.set_xticks(np.arange(width) + 0.47, [f"logical\nblock {i}" for i in range(width)], fontsize=8)
    ax.set_title(
        f"block-table rows at admission: gold = the same physical block, shared ({len(shared) * block_size} tokens)"
    )
    for side in ("top", "right", "left", "bottom"):
        ax.spines[side].set_visible(False)
    plt.tight_layout()
    plt.show()


def memory_held(used: dict, paged: dict, static: int, block_size: int):
    """Bars per request: its tokens, the slots its paged blocks held, the slots a static row reserved.

    `used`: request -> prompt + output tokens; `paged`: request -> block_size * its blocks at peak;
    `static`: the slots each row of the contiguous cache reserved (the batch's worst case).
    """
    import matplotlib.pyplot as plt

    names = list(used)
    x = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.bar(x - 0.27, [used[n] for n in names], 0.27, label="tokens (prompt + output)", color="tab:gray")
    ax.bar(x, [paged[n] for n in names], 0.27, label=f"paged: ceil(tokens / {block_size}) blocks", color="tab:green")
    ax.bar(x + 0.27, [static] * len(names), 0.27, label="static: longest prompt + largest max_tokens", color="tab:blue")
    ax.set_xticks(x, names)
    ax.set_ylabel("KV slots (tokens)")
    ax.set_title(f"memory each request holds: paged wastes < {block_size} slots, static reserves for the worst case")
    ax.legend(fontsize=8)
    plt.tight_layout()
    plt.show()
