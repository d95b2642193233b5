"""What notebooks 12a and 12b print while reading kernels: a kernel's source, the committed GPU results,
the pictures of the attention kernels, and 12b's stage-by-stage comparison of the two tiers.

Only `compare_stage` runs a kernel (a stage's triton tier, beside its naive one).
"""

import inspect
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: kernels' files and committed results


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


# ---------------------------------------------------------------- the picture of notebook 12a


def online_softmax_state(row, block_n: int):
    """The online softmax's state along one row of scores, tile by tile: the running max m (it only
    grows), alpha = exp(m_old - m_new) (the rescale of everything summed so far) and the running sum l,
    which reaches the whole row's sum of exp(s - max) at the last tile.
    """
    import matplotlib.pyplot as plt
    import torch

    m_run, alphas, l_run = [], [], []
    m_cur, l_cur = float("-inf"), 0.0
    for start in range(0, row.numel(), block_n):
        tile = row[start : start + block_n]
        m_new = max(m_cur, float(tile.max()))
        alpha = float(torch.exp(torch.tensor(m_cur - m_new)))
        l_cur = l_cur * alpha + float(torch.exp(tile - m_new).sum())
        m_cur = m_new
        m_run.append(m_cur), alphas.append(alpha), l_run.append(l_cur)
    tiles = range(len(m_run))
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.2))
    axes[0].plot(row.numpy(), ".", color="gray")
    for t in tiles:
        axes[0].axvline(t * block_n - 0.5, color="black", lw=0.5)
    axes[0].set_title(f"one row of scores, tiles of {block_n} keys")
    axes[1].step(tiles, m_run, where="mid", color="tab:red", label="running max m")
    axes[1].bar(tiles, alphas, color="tab:purple", alpha=0.5, label="alpha: rescale of the sums so far")
    axes[1].legend(fontsize=8)
    axes[1].set_title("the max only grows; alpha < 1 when it does")
    axes[2].plot(tiles, l_run, "o-", color="tab:green")
    axes[2].axhline(float(torch.exp(row - row.max()).sum()), color="black", ls=":", label="sum exp(s - max), whole row")
    axes[2].legend(fontsize=8)
    axes[2].set_title("running sum l: the whole row's, at the last tile")
    for ax in axes[1:]:
        ax.set_xlabel("key tile")
    plt.tight_layout()
    plt.show()


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


def split_merge(m, l, ranges, title: str):  # noqa: E741
    """Split-K's merge for one head: each split's max m_s (base 2), its weight 2^(m_s - M), its share of the sum.

    `m`, `l`: `[S]` the splits' max score and sum; `ranges`: the S index tensors of their keys.
    """
    import matplotlib.pyplot as plt
    import torch

    w = torch.exp2(m - m.max())  # the split holding the largest score gets weight 1
    panels = [
        ("m_s: the split's max score (base 2)", m.tolist()),
        ("w_s = 2^(m_s - M)", w.tolist()),
        ("w_s l_s / sum: share of the denominator", (w * l / (w * l).sum()).tolist()),
    ]
    splits = [f"keys {int(r[0])}-{int(r[-1])}" for r in ranges]
    fig, axes = plt.subplots(1, len(panels), figsize=(13, 3.2))
    for ax, (name, values) in zip(axes, panels):
        ax.bar(splits, values, color="tab:purple")
        ax.set_title(name, fontsize=10)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(title)
    plt.tight_layout()
    plt.show()


def stage_errors(results: dict, eps: dict, title: str, floor: float = 1e-10):
    """Bars of relative error per stage, one colour per dtype (log scale); 0 is drawn at `floor`, "exact".

    `results`: (stage, dtype) -> (what is compared, error), as `compare_stage` returns; the stages
    compared exactly (ids, sets) are named in the title. `eps`: dtype -> its machine epsilon (dashed).
    """
    import matplotlib.pyplot as plt
    import numpy as np

    stages, dtypes = list(dict.fromkeys(s for s, _ in results)), list(eps)
    names = [n for n in stages if results[n, dtypes[0]][0] == "relative max error"]
    title += f"; exact matches also for: {', '.join(n for n in stages if n not in names)}"
    errors = {str(dt).removeprefix("torch."): {n: results[n, dt][1] for n in names} for dt in dtypes}
    eps = {str(dt).removeprefix("torch."): e for dt, e in eps.items()}
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


# ---------------------------------------------------------------- notebook 12b: every stage, both tiers


def compare_stage(name: str, config, num_tokens: int, dtype, device) -> tuple[str, float]:
    """(what is compared, error) for one stage's naive and triton tiers on the same seeded inputs.

    Tensors: the largest absolute difference over the largest magnitude of the reference (float32
    and bf16 on one scale). `kv_store` returns nothing: the caches it wrote are compared.
    `tokenize`: ids that differ. `sampling`: the kernel draws from its own random stream, so the
    *set of tokens each row may draw* is compared (`sample_with_mask` vs `processed_probs > 0`).
    """
    import torch

    from stagewise.kernels.sampling import sample_with_mask
    from stagewise.stages import STAGES
    from stagewise.stages.sampling import processed_probs

    stage = STAGES[name]
    ref_in = stage.example_inputs(config, num_tokens, device, dtype)  # seeded: two calls, identical inputs
    opt_in = stage.example_inputs(config, num_tokens, device, dtype)
    if name == "sampling":
        _, allowed = sample_with_mask(**opt_in)
        return "set mismatches", float((allowed != (processed_probs(**ref_in) > 0)).sum())
    ref, opt = stage.naive(**ref_in), stage.triton(**opt_in)
    if name == "tokenize":
        return "ids differing", float((ref != opt).sum())
    if stage.outputs:
        pairs = list(zip(*((x if isinstance(x, tuple) else (x,)) for x in (ref, opt))))
    else:  # writes in place: compare what it wrote
        written = [k for k, v in ref_in.items() if isinstance(v, torch.Tensor) and v.is_floating_point()]
        pairs = [(ref_in[k], opt_in[k]) for k in written]
    err = max(float((a.float() - b.float()).abs().max()) for a, b in pairs)
    scale = max(float(a.float().abs().max()) for a, _ in pairs)
    return "relative max error", err / max(scale, 1e-30)


def print_stage_bench(bench: dict) -> None:
    """The table of `stagewise.bench.commands.stages.run_stages`: naive vs Triton ms per stage and shape."""
    print(f"{'stage':>15} {'shape':>14} {'naive ms':>9} {'triton ms':>10} {'speed-up':>9}")
    for r in bench["rows"]:
        opt, up = r["optimized_ms"] or float("nan"), r["speedup"] or float("nan")
        print(f"{r['stage']:>15} {r['shape']:>14} {r['naive_ms']:>9.3f} {opt:>10.3f} {up:>8.2f}x")


def print_device_checks(runs: dict, on_gpu: bool) -> None:
    """Every kernel row of the committed device checks: share of the copy bandwidth, or speed vs the vendor's."""
    if not (on_gpu or runs):
        print("no GPU and no committed device check: the kernels are checked here, not timed")
    for name, run in runs.items():
        gpu = run["sections"]["env"].get("gpu", {}).get("name", name)
        print(f"committed device check: {gpu} (benchmarks/results/{name}), a reference run, not this machine")
        for row in run["sections"].get("kernels", {}).get("rows", []):
            if "share_of_copy" in row:
                print(f"  {row['kernel']:>17} {row['shape']:<58} {row['share_of_copy']:6.2f} of the copy bandwidth")
            elif "ratio_vs_stock" in row and row["kernel"] != "sampling":
                print(f"  {row['kernel']:>17} {row['shape']:<58} {row['ratio_vs_stock']:6.2f}x {row['stock']}'s speed")
