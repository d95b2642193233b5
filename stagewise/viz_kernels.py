"""What notebooks 12a and 12b print while reading kernels: a kernel's source, the committed GPU results.

Printing only; nothing here runs a kernel.
"""

import inspect
import json
from pathlib import Path

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


# ---------------------------------------------------------------- pictures of notebook 12b


def tile_kinds(block_m: int, block_n: int, q_len: int, k_len: int, group: int):
    """0 = skipped, 1 = loaded with the causal mask, 2 = loaded whole: the kernel's bounds full / hi per row tile."""
    import numpy as np

    shift = k_len - q_len
    kinds = np.zeros((-(-q_len * group // block_m), -(-k_len // block_n)), dtype=int)
    for t in range(kinds.shape[0]):
        f0 = t * block_m
        last_query = (min(f0 + block_m, q_len * group) - 1) // group
        hi = max(min(k_len, last_query + shift + 1), 0)
        full = max(min(k_len, f0 // group + shift + 1), 0) // block_n * block_n
        kinds[t, : -(-hi // block_n)] = 1
        kinds[t, : full // block_n] = 2
    return kinds


def causal_tile_map(tiles: dict, q_len: int, group: int, num_kv_heads: int):
    """For each plan (name -> (BLOCK_M, BLOCK_N)): which K/V tiles one causal prefill program meets."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    fig, axes = plt.subplots(1, len(tiles), figsize=(14, 6))
    cmap = ListedColormap(["whitesmoke", "tab:orange", "tab:blue"])
    for ax, (name, (bm, bn)) in zip(axes, tiles.items()):
        kinds = tile_kinds(bm, bn, q_len, q_len, group)
        ax.imshow(kinds, cmap=cmap, vmin=0, vmax=2, aspect="auto", interpolation="nearest")
        loaded = (kinds > 0).sum()
        ax.set_title(
            f"{name}: BLOCK_M {bm}, BLOCK_N {bn}\n{loaded} of {kinds.size} K/V tiles loaded "
            f"({loaded / kinds.size:.0%}), {(kinds == 1).sum()} of them masked"
        )
        ax.set_xlabel(f"key tile ({bn} keys)")
        ax.set_ylabel(f"row tile ({bm} rows = {bm / group:.3g} queries x {group} heads)")
    for color, what in zip(
        cmap.colors, ("skipped: never loaded", "diagonal: loaded, masked", "below: loaded, no mask")
    ):
        axes[-1].plot([], [], "s", color=color, ms=10, label=what)
    axes[-1].legend(loc="upper right")
    fig.suptitle(
        f"causal FlashAttention, one KV head of a {q_len}-token prompt: grid (row tiles, sequences, KV heads) = "
        f"({kinds.shape[0]}, 1, {num_kv_heads}) on the right"
    )
    plt.tight_layout()
    plt.show()


def paged_keys(row: list[int], num_keys: int, block_size: int, block_n: int, pool_blocks: int):
    """One sequence's keys coloured by the physical block holding them, the kernel's key tiles below."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(13, 2.6))
    for pos in range(num_keys):
        block = row[pos // block_size]
        ax.add_patch(plt.Rectangle((pos, 0), 1, 1, color=plt.cm.tab10(block % 10), ec="white"))
        slot = block * block_size + pos % block_size
        ax.text(pos + 0.5, 0.5, slot, ha="center", va="center", fontsize=6, color="white")
    for b in range(-(-num_keys // block_size)):
        ax.text(b * block_size + block_size / 2, 1.15, f"block_table[0][{b}] = {row[b]}", ha="center", fontsize=8)
    for t, t0 in enumerate(range(0, num_keys, block_n)):
        width = min(block_n, num_keys - t0)
        ax.add_patch(plt.Rectangle((t0 + 0.1, -0.35), width - 0.2, 0.25, color=("dimgray", "darkgray")[t % 2]))
        ax.text(t0 + 0.5, -0.5, f"key tile {t}: positions {t0}-{t0 + width - 1}", fontsize=8, va="top")
    ax.set_xlim(0, num_keys)
    ax.set_ylim(-1, 1.5)
    ax.set_yticks([])
    ax.set_xlabel("key position in the sequence (the number in each cell: its slot in the pool)")
    ax.set_title(f"{num_keys} keys in blocks of {block_size}, scattered over a pool of {pool_blocks} blocks")
    plt.tight_layout()
    plt.show()


def split_merge(panels: list[tuple[str, list[float]]], splits: list[str], title: str):
    """One bar chart per quantity of split-K's merge (each split's max, weight, share of the sum)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(13, 3.2))
    for ax, (name, values) in zip(axes, panels):
        ax.bar(splits, values, color="tab:purple")
        ax.set_title(name, fontsize=10)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(title)
    plt.tight_layout()
    plt.show()


def stage_errors(errors: dict, eps: dict, title: str, floor: float = 1e-10):
    """Bars of relative error per stage, one colour per dtype (log scale); 0 is drawn at `floor`, "exact".

    `errors`: dtype name -> {stage: error}; `eps`: dtype name -> its machine epsilon (dashed line).
    """
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(next(iter(errors.values())))
    x = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(12, 5))
    for offset, (dtype, color) in zip((-0.2, 0.2), zip(errors, ("tab:blue", "tab:orange"))):
        errs = [errors[dtype][n] for n in names]
        bars = ax.bar(x + offset, [max(e, floor) for e in errs], 0.4, color=color, label=dtype)
        for b, e in zip(bars, errs):
            if e == 0:
                ax.text(b.get_x() + b.get_width() / 2, floor * 1.5, "exact", ha="center", va="bottom", rotation=90)
        ax.axhline(eps[dtype], color=color, ls="--", lw=1, label=f"{dtype} eps {eps[dtype]:.1e}")
    ax.set_yscale("log")
    ax.set_ylim(floor, 0.1)
    ax.set_xticks(x, names, rotation=30)
    ax.set_ylabel("max |triton - naive| / max |naive|")
    ax.set_title(title)
    ax.legend(fontsize=8, ncol=2)
    plt.tight_layout()
    plt.show()
