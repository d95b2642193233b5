"""Notebook 09b's figures: a radix tree of token runs beside the hash chains of the same requests.

Both take plain values: the tree as `RadixCache.describe()` lists it (each node: id, parent,
tokens, start, blocks, lock), and per request the chain of its full blocks' digests with the
block each name points at. `label` turns a run of token ids into the text drawn in its box.
"""

import textwrap

PALETTE = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#ff9da6", "#9d755d"]


def _tree_layout(nodes: list[dict]) -> dict:
    """node id -> (depth, row): leaves on rows 0, 1, 2, ... in order; a parent at its children's mean."""
    children: dict = {}
    for n in nodes:
        children.setdefault(n["parent"], []).append(n["id"])
    pos, next_row = {}, [0]

    def place(node_id, depth):
        kids = children.get(node_id, [])
        if not kids:
            pos[node_id] = (depth, next_row[0])
            next_row[0] += 1
            return pos[node_id][1]
        rows = [place(k, depth + 1) for k in kids]
        pos[node_id] = (depth, sum(rows) / len(rows))
        return pos[node_id][1]

    for top in children.get(None, []):
        place(top, 1)
    return pos


def radix_tree(nodes: list[dict], label, title: str, ax=None, block_size: int | None = None):
    """The tree, root at the left: one box per node with its run's text, blocks and lock count
    (a locked node is drawn with a thick edge: a running request's path)."""
    import matplotlib.pyplot as plt

    pos = _tree_layout(nodes)
    rows = max((r for _, r in pos.values()), default=0) + 1
    depth = max((d for d, _ in pos.values()), default=0) + 1
    if ax is None:
        _, ax = plt.subplots(figsize=(3.2 * depth + 1, 0.9 * rows + 1))
    ax.text(0, (rows - 1) / 2, "root", ha="center", va="center", fontsize=9, bbox={"boxstyle": "circle", "fc": "w"})
    for n in nodes:
        d, r = pos[n["id"]]
        pd, pr = (0, (rows - 1) / 2) if n["parent"] is None else pos[n["parent"]]
        ax.annotate("", (d * 3 - 1.35, r), (pd * 3 + (1.35 if n["parent"] is not None else 0.4), pr),
                    arrowprops={"arrowstyle": "-|>", "color": "#888"})  # fmt: skip
        text = textwrap.shorten(repr(label(n["tokens"]))[1:-1], 40, placeholder="…")
        info = f"{len(n['tokens'])} tokens at {n['start']}\nblocks {n['blocks']}"
        if n["lock"]:
            info += f", lock {n['lock']}"
        info = "\n".join(textwrap.fill(line, 24) for line in info.split("\n"))
        box = {"boxstyle": "round", "fc": "#eef3fb", "ec": "#1d2330", "lw": 2.2 if n["lock"] else 0.8}
        ax.text(d * 3, r, f"{textwrap.fill(text, 24)}\n{info}", ha="center", va="center", fontsize=7, bbox=box)
    ax.set_xlim(-0.7, depth * 3 - 1.4)
    ax.set_ylim(rows - 0.4, -0.6)
    ax.axis("off")
    ax.set_title(title, fontsize=10)
    return ax.figure


def hash_chains(chains: dict, title: str, ax=None):
    """Each request's full blocks as a chain of digests, left to right; a name two requests share
    (the same digest: the same prefix) is drawn in one colour, with the block it points at."""
    import matplotlib.pyplot as plt

    width = max((len(c) for c in chains.values()), default=1)
    if ax is None:
        _, ax = plt.subplots(figsize=(1.3 * width + 2, 0.8 * len(chains) + 1))
    count: dict = {}
    for chain in chains.values():
        for digest, _ in chain:
            count[digest] = count.get(digest, 0) + 1
    colours = {d: PALETTE[i % len(PALETTE)] for i, d in enumerate(d for d, n in count.items() if n > 1)}
    for y, (name, chain) in enumerate(chains.items()):
        ax.text(-0.3, y, name, ha="right", va="center", fontsize=8)
        for x, (digest, block) in enumerate(chain):
            colour = colours.get(digest, "#dddddd")
            ax.add_patch(plt.Rectangle((x, y - 0.35), 0.9, 0.7, color=colour))
            ax.text(x + 0.45, y, f"{digest}\nblock {block}", ha="center", va="center", fontsize=7)
            if x:
                ax.annotate("", (x, y), (x - 0.1, y), arrowprops={"arrowstyle": "-|>", "color": "#888"})
    ax.set_xlim(-2.2, width)
    ax.set_ylim(len(chains) - 0.4, -0.6)
    ax.axis("off")
    ax.set_title(title, fontsize=10)
    return ax.figure


def radix_beside_hash(nodes: list[dict], chains: dict, label, title: str):
    """The two caches of the same requests, one figure: the tree above, the chains below."""
    import matplotlib.pyplot as plt

    pos = _tree_layout(nodes)
    rows = max((r for _, r in pos.values()), default=0) + 1
    depth = max((d for d, _ in pos.values()), default=0) + 1
    width = max((len(c) for c in chains.values()), default=1)
    heights = [0.9 * rows + 0.8, 0.8 * len(chains) + 0.8]
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(max(2.6 * depth, 1.2 * width + 2.5), sum(heights)), gridspec_kw={"height_ratios": heights}
    )
    radix_tree(nodes, label, "radix tree: runs of tokens, matched token by token", ax=top)
    hash_chains(chains, "hash chains: one digest per full block, matched block by block", ax=bottom)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig
