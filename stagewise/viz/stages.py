"""Figures of the stage notebooks 01, 02, 04, 06, 07, 14, 15: tokenizer to sampling, quantization, speculation.

Each function draws one figure from numbers the notebook computed (lists, dicts, tensors)
and returns it; the notebook's cell keeps the computation, so it reads as the idea.
matplotlib is imported only when a function runs (`stagewise.viz._plt`).
"""

import numpy as np

from stagewise.viz import _done, _plt

# ---------------------------------------------------------------- 01 tokenize


def tokenizer_pictures(merges: list[tuple[tuple[str, str], int]], per_piece: list[int], ratios: dict[str, float]):
    """Left: one word's merges in firing order with their ranks; middle: tokens per piece; right: chars per token.

    `merges`: ((left, right), rank) in the order BPE applied them; `per_piece`: the token count
    of every pre-tokenized piece of a corpus; `ratios`: kind of text -> characters per token.
    """
    plt = _plt()
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4.5))
    left.barh(range(len(merges)), [rank + 1 for _, rank in merges], color="tab:purple")
    left.set_yticks(range(len(merges)), [f"{a} + {b}" for (a, b), _ in merges], fontsize=8)
    left.invert_yaxis()
    left.set_xscale("log")
    left.set_xlabel("merge rank + 1 (log scale; lower = learned earlier)")
    left.set_title("merges of ' tokenization', in firing order")

    bins = np.arange(1, max(per_piece) + 2) - 0.5  # one bin per whole number of tokens
    middle.hist(per_piece, bins=bins, color="tab:blue", edgecolor="white")
    middle.set_yscale("log")
    middle.set(xlabel="tokens per pre-tokenized piece", ylabel="pieces (log scale)")
    middle.set_title(f"{len(per_piece):,} pieces of the docstring corpus")

    colours = ["tab:green", "tab:orange", "tab:gray", "tab:red"]
    right.bar(list(ratios), list(ratios.values()), color=colours[: len(ratios)])
    for i, r in enumerate(ratios.values()):
        right.text(i, r, f"{r:.2f}", ha="center", va="bottom")
    right.set(ylabel="characters per token", title="what one token buys, by kind of text")
    return _done(fig)


# ---------------------------------------------------------------- 02 embedding and RMSNorm


def rms_before_after(before, after, token_labels: list[str]):
    """Left: RMS of each RMSNorm call's input (residual stream) and output; right: the input's RMS as an image.

    `before`, `after`: torch tensors [num_calls, T], the RMS over the hidden axis of every norm
    call's input and output, two calls per layer and the final norm last (61 calls for 30 layers).
    """
    plt = _plt()
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5))
    calls = np.arange(len(before)) / 2  # two norms per layer: call i sits at layer i / 2
    last = (len(before) - 1) // 2  # the final norm's position on that axis: the number of layers
    for rms, name, colour in ((before, "residual stream", "tab:blue"), (after, "rmsnorm output", "tab:orange")):
        left.semilogy(calls, rms.median(dim=1).values, label=f"{name}, median token", color=colour)
        left.semilogy(calls, rms[:, 0], label=f"{name}, token 0", color=colour, linestyle="--")
    left.set_xlabel(f"layer (two norms per layer; {last} = the final norm)")
    left.set_ylabel("RMS over the hidden axis (log)")
    left.set_title("before vs after RMSNorm, SmolLM2, one prompt")
    left.legend(fontsize=8)
    left.grid(alpha=0.3)

    T = before.shape[1]
    im = right.imshow(before.T.log10(), aspect="auto", cmap="viridis", extent=(-0.25, last + 0.25, T - 0.5, -0.5))
    right.set_yticks(range(T), token_labels, fontsize=7)
    right.set(xlabel="layer", title="log10 RMS of the residual stream, per token")
    fig.colorbar(im, ax=right)
    return _done(fig)


# ---------------------------------------------------------------- 04 RoPE


def _score_grid(fig, ax, scores, title: str):
    """rot(q, m) . rot(k, n) for every (query position m, key position n), in a red-blue map."""
    im = ax.imshow(scores, cmap="RdBu_r")
    ax.set(xlabel="key position n", ylabel="query position m", title=title)
    fig.colorbar(im, ax=ax, fraction=0.046)


def rope_pictures(pairs: list[tuple], scores, cache, rotary_dim: int):
    """Left: one feature pair rotated at positions 0.. ; middle: scores by (m, n); right: cos_sin_cache[:512].

    `pairs`: (points [P, 2], label, colour) per feature pair; `scores`: [P, P] rotated q . k;
    `cache`: the [max_position, rotary_dim] table of cos then sin columns.
    """
    plt = _plt()
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 5))
    circle = np.linspace(0, 2 * np.pi, 200)
    left.plot(np.cos(circle), np.sin(circle), color="lightgray")
    for pair, name, colour in pairs:
        left.plot(pair[:, 0], pair[:, 1], "o", color=colour, ms=5, label=name)
        for p in (0, 1, 2, 3):
            left.annotate(str(p), pair[p].tolist(), textcoords="offset points", xytext=(4, 4), color=colour, fontsize=8)
    left.set_aspect("equal")
    left.set_title(f"a unit pair at positions 0..{len(pairs[0][0]) - 1} (labels: 0-3)")
    left.set(xlabel="first feature of the pair", ylabel="second feature of the pair")
    left.legend(loc="center")

    _score_grid(fig, middle, scores, "rot(q, m) . rot(k, n): constant along diagonals")

    d = rotary_dim
    im = right.imshow(cache[:512], aspect="auto", cmap="RdBu_r", vmin=-1, vmax=1)
    right.axvline(d // 2 - 0.5, color="black", lw=1)  # cos columns | sin columns
    right.set_xticks([0, d // 4, d // 2, 3 * d // 4], ["cos f_0", f"cos f_{d // 4}", "sin f_0", f"sin f_{d // 4}"])
    right.set(ylabel="position", title="cos_sin_cache[:512]  ([max_position, rotary_dim])")
    fig.colorbar(im, ax=right, fraction=0.046)
    return _done(fig)


def rope_scores(scores, title: str):
    """The middle panel of `rope_pictures` on its own: [P, P] scores by (query m, key n)."""
    fig, ax = _plt().subplots(figsize=(5, 4))
    _score_grid(fig, ax, scores, title)
    return _done(fig)


# ---------------------------------------------------------------- 06 FFN


def ffn_pictures(gates, contexts: list[int], flop_shares: list[dict], byte_shares: list[dict], layer: int):
    """Left: SiLU vs ReLU over a histogram of real gates; middle, right: the layer's FLOP and byte shares.

    `gates`: a layer's gate pre-activations (any shape, flattened); `flop_shares[i]`,
    `byte_shares[i]`: part ("QKV", "O", "attention", "FFN") -> share of the layer at `contexts[i]`.
    """
    plt = _plt()
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(17, 4.8))
    hist_ax = left.twinx()  # the histogram behind the curves, on its own (hidden) count axis
    hist_ax.hist(np.ravel(gates), bins=120, range=(-6, 4), color="lightgray")
    hist_ax.set_yticks([])
    left.set_zorder(hist_ax.get_zorder() + 1)
    left.patch.set_visible(False)
    g = np.linspace(-6, 4, 400)
    left.plot(g, np.maximum(g, 0), label="ReLU(g)", color="tab:gray", lw=2)
    left.plot(g, g / (1 + np.exp(-g)), label="SiLU(g) = g * sigmoid(g)", color="tab:red", lw=2)
    left.axhline(0, color="black", lw=0.5)
    left.set(xlabel="gate pre-activation g", title=f"SiLU vs ReLU (grey: real gates, layer {layer})")
    left.legend(loc="upper left")

    colours = {"QKV": "tab:blue", "O": "tab:cyan", "attention": "tab:orange", "FFN": "tab:green"}
    for ax, shares, title in [
        (middle, flop_shares, "share of prefill FLOPs per layer"),
        (right, byte_shares, "share of decode-step bytes per layer"),
    ]:
        bottom = np.zeros(len(contexts))  # stacked bars, in percent
        for part, colour in colours.items():
            vals = np.array([s[part] for s in shares])
            ax.bar(range(len(contexts)), vals * 100, bottom=bottom, color=colour, label=part)
            for i, val in enumerate(vals):
                if val > 0.06:  # label the slices wide enough to hold a number
                    ax.text(i, bottom[i] + val * 50, f"{val:.0%}", ha="center", va="center", color="white")
            bottom += vals * 100
        ax.set_xticks(range(len(contexts)), [f"context {n:,}" for n in contexts])
        ax.set(ylabel="%", ylim=(0, 115), yticks=range(0, 101, 20), title=f"SmolLM2: {title}")
        ax.legend(fontsize=8, loc="upper center", ncol=4)
    return _done(fig)


# ---------------------------------------------------------------- 07 LM head and sampling


def sampling_panels(penalty: tuple, temperatures: dict, filters: tuple, draw: tuple):
    """Four panels: repetition penalty, temperature, the three filters, the seeded draw against its law.

    penalty       (labels, seen, {name: probabilities of those tokens}) for two settings; `seen[i]`:
                  token i occurred before, so its bars are hatched
    temperatures  {name: the whole vocabulary's probabilities, sorted descending, first 200}
    filters       (labels, probabilities at T=1, {name: (probabilities after the filter, tokens kept)})
    draw          (labels, the processed probabilities, the measured frequencies, number of draws)
    """
    plt = _plt()
    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    ax = axes[0, 0]
    labels, seen, probs = penalty
    x = np.arange(len(labels))
    for offset, (name, p), color in zip((-0.2, 0.2), probs.items(), ("tab:gray", "tab:red")):
        bars = ax.bar(x + offset, np.asarray(p), 0.4, label=name, color=color)
        for b, was_seen in zip(bars, seen):
            if was_seen:
                b.set_hatch("//")
    ax.set_xticks(x, labels, rotation=45)
    ax.set_yscale("log")
    ax.set(title="repetition penalty: seen tokens (hatched) lose mass, the rest gain", ylabel="probability (log)")
    ax.legend()

    ax = axes[0, 1]
    for name, p in temperatures.items():
        ax.semilogy(np.arange(1, len(p) + 1), np.asarray(p), label=name)
    ax.set(xlabel="rank of the token", ylabel="probability (log)")
    ax.set_title("temperature: same ranking, sharper (T<1) or flatter (T>1)")
    ax.legend()

    ax = axes[1, 0]
    labels, before, after = filters
    x = np.arange(len(labels))
    ax.bar(x, np.asarray(before), 0.8, color="lightgray", label="before (T=1)")
    for k, (name, (p, n_kept)) in enumerate(after.items()):
        p = np.asarray(p)
        ax.plot(x + (k - 1) * 0.2, np.where(p > 0, p, np.nan), "o", ms=7, label=f"{name}: {n_kept} kept")
    ax.set_xticks(x, labels, rotation=45)
    ax.set(ylabel="probability after the filter (renormalized)")
    ax.set_title("min_p / top-k / top-p: cut the tail, renormalize the rest")
    ax.legend()

    ax = axes[1, 1]
    labels, target, freq, num_draws = draw
    x = np.arange(len(labels))
    ax.bar(x - 0.2, np.asarray(target), 0.4, label="processed_probs (top_k=5)", color="tab:blue")
    ax.bar(x + 0.2, freq, 0.4, label=f"frequency in {num_draws} seeded draws", color="tab:orange")
    ax.set_xticks(x, labels)
    ax.set_title("the draw follows the processed distribution")
    ax.legend()
    return _done(fig)


# ---------------------------------------------------------------- 14 quantization, 15 speculative decoding


def bars(values: dict, title: str, colors=None, xlabel: str = "", ylabel: str = "", horizontal=False, log=False,
         figsize=(7, 3.5)):  # fmt: skip
    """One bar per entry of `values` (label -> number); `horizontal` lays them out as rows, `log` a log axis."""
    fig, ax = _plt().subplots(figsize=figsize)
    (ax.barh if horizontal else ax.bar)(list(values), list(values.values()), color=colors)
    if log:
        (ax.set_xscale if horizontal else ax.set_yscale)("log")
    ax.set(xlabel=xlabel, ylabel=ylabel)
    ax.set_title(title, fontsize=10)
    return _done(fig)


def q4_1_code_bytes(codes):
    """The 16 code bytes [16] (uint8) of one Q4_1 block as bits (black = 1), each nibble's code written on it."""
    fig, ax = _plt().subplots(figsize=(9, 2.6))
    bits = np.unpackbits(np.asarray(codes, dtype=np.uint8)[:, None], axis=1)  # [16 bytes, 8 bits], MSB first
    ax.imshow(bits.T, cmap="Greys", aspect="auto")
    box = {"facecolor": "white", "edgecolor": "none", "pad": 1}
    for i, byte in enumerate(codes):
        ax.text(i, 1.5, str(byte >> 4), ha="center", va="center", color="tab:red", fontsize=9, bbox=box)
        ax.text(i, 5.5, str(byte & 0x0F), ha="center", va="center", color="tab:blue", fontsize=9, bbox=box)
    ax.set_yticks(range(8), [f"bit {7 - b}" for b in range(8)], fontsize=7)
    ax.set_xticks(range(len(codes)), [f"{i}" for i in range(len(codes))], fontsize=7)
    ax.set_xlabel("code byte i: high nibble = code i + 16 (red), low nibble = code i (blue)")
    ax.set_title("the 16 code bytes of one Q4_1 block (black = 1)", fontsize=10)
    return _done(fig)


def block_weights(w, m: float, d: float):
    """The 32 weights w_j = d * q_j + m of one block, between the lowest (code 0) and highest (code 15) level."""
    fig, ax = _plt().subplots(figsize=(7, 3))
    ax.bar(range(len(w)), w, color="tab:green")
    ax.axhline(m, color="gray", linestyle=":", label=f"m = {m:.4f} (code 0)")
    ax.axhline(m + 15 * d, color="gray", linestyle="--", label="m + 15 d (code 15)")
    ax.set(xlabel="weight j of the block", ylabel="w_j")
    ax.legend(fontsize=8)
    return _done(fig)


def step_cost(rows: list[int], costs: dict[int, float], title: str):
    """Measured ms of a step of n query rows against n decode steps (the dashed line), n = `rows`."""
    fig, ax = _plt().subplots(figsize=(6.5, 4))
    ax.plot(rows, [costs[n] for n in rows], marker="o", label="measured step")
    ax.plot(rows, [n * costs[1] for n in rows], linestyle="--", color="gray", label="n x decode step")
    ax.set(xlabel="query rows in the step (1 + k guesses)", ylabel="ms per step", title=title)
    ax.legend()
    return _done(fig)


def speculation_gain(expected: dict[float, list[float]], speedup: dict[float, tuple[list[int], list[float]]]):
    """Left: expected tokens per step E(a, k), k = 0, 1, ...; right: speed-up (k guesses, E / step cost) per a."""
    fig, (left, right) = _plt().subplots(1, 2, figsize=(11, 4))
    for a, tokens in expected.items():
        left.plot(range(len(tokens)), tokens, marker=".", label=f"a = {a}")
    for a, (ks, gains) in speedup.items():
        right.plot(ks, gains, marker="o", label=f"a = {a}")
    left.set(xlabel="k guesses per step", ylabel="expected tokens per step")
    left.legend()
    right.axhline(1.0, color="gray", linestyle=":")  # above it, speculation wins
    right.set(xlabel="k guesses per step", ylabel="speed-up over plain decoding")
    right.set_title("E(a, k) / measured step cost", fontsize=10)
    right.legend()
    return _done(fig)


def side_by_side(named: list[tuple[str, list[float], str]], xlabel: str, ylabel: str):
    """Grouped bars: per position on the x axis, one bar for each (label, values, colour), left to right."""
    fig, ax = _plt().subplots(figsize=(6.5, 3.8))
    width = 0.81 / len(named)
    for k, (label, values, colour) in enumerate(named):
        xs = [i + (k - (len(named) - 1) / 2) * width for i in range(len(values))]
        ax.bar(xs, values, width, label=label, color=colour)
    ax.set(xlabel=xlabel, ylabel=ylabel)
    ax.legend()
    return _done(fig)
