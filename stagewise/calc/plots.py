"""Pictures of the calculator: the roofline, and KV-cache memory against context length.

Both functions draw on a bare `matplotlib.figure.Figure` (the Agg canvas, no
display, no pyplot state, no backend switch at import), write a PNG and return
the figure, so a notebook can show it and a script can just keep the file.

- `plot_roofline`: log-log attainable FLOP/s against arithmetic intensity
  (FLOP/B). The roof is `min(peak, intensity * bandwidth)`; it bends at the
  ridge point `peak / bandwidth`. A prefill sits far right on the flat part
  (compute-bound), a decode step far left on the slope (memory-bound).
- `plot_kv_memory`: KV bytes of one sequence against its length, with MHA
  (Hkv = H) dashed and the model's GQA solid, under the GPU's memory line.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from matplotlib.figure import Figure

from stagewise.calc.counts import kv_bytes, weight_bytes
from stagewise.calc.hardware import HARDWARE, Hardware
from stagewise.calc.steps import Step
from stagewise.config import ModelConfig
from stagewise.files import atomic_path


@dataclass(frozen=True)
class RooflinePoint:
    label: str  # e.g. "prefill N=100k"
    intensity: float  # FLOP per byte moved
    flops_per_s: float | None = None  # achieved FLOP/s; None = at the speed of light (on the roof)


def points_from_steps(steps: Sequence[Step], suffix: str = "") -> list[RooflinePoint]:
    """One point per calculator step, at its speed-of-light FLOP/s (FLOPs / time)."""
    return [RooflinePoint(f"{s.name}{suffix}", s.intensity.value, s.flops.value / s.time.value) for s in steps]


def _save(fig: Figure, path: str | Path | None) -> Figure:
    """Write a PNG when a path is given; return the figure (a notebook shows it as a cell's value)."""
    if path is None:
        return fig
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:  # an interrupted save leaves the old PNG as it was
        fig.savefig(tmp, dpi=120, bbox_inches="tight")
    return fig


def plot_roofline(
    hardware: Hardware,
    points: Sequence[RooflinePoint],
    path: str | Path | None = None,
    dtype: str = "bf16",
    title: str = "",
) -> Figure:
    """Log-log roofline of `hardware` for `dtype`, with labelled points; writes a PNG at `path` if given."""
    peak, bw = hardware.peak_flops(dtype), hardware.memory_bandwidth
    ridge = peak / bw
    xs = [p.intensity for p in points] + [ridge]
    lo, hi = min(xs) / 10, max(xs) * 10
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    fig = Figure(figsize=(8, 5.5))
    ax = fig.add_subplot()
    ax.loglog(grid, [min(peak, x * bw) for x in grid], color="black", lw=2, label="roof: min(peak, I x bandwidth)")
    ax.axvline(ridge, color="gray", ls=":", lw=1)
    ax.annotate(
        f"ridge {ridge:,.0f} FLOP/B",
        (ridge, peak),
        textcoords="offset points",
        xytext=(6, -14),
        fontsize=9,
        color="gray",
    )
    for i, p in enumerate(points):
        y = p.flops_per_s if p.flops_per_s is not None else min(peak, p.intensity * bw)
        bound = "compute-bound" if p.intensity > ridge else "memory-bound"
        marker = "os^Dv"[i % 5]  # distinct shapes: points on the roof can sit on top of each other
        ax.plot([p.intensity], [y], marker, ms=9, color=f"C{i}", label=f"{p.label}: {p.intensity:,.3g} FLOP/B, {bound}")
    ax.set_xlabel("arithmetic intensity (FLOP per byte moved)")
    ax.set_ylabel(f"attainable {dtype} FLOP/s")
    peak_t, bw_t = peak / 1e12, bw / 1e12
    ax.set_title(title or f"Roofline: {hardware.name} ({peak_t:,.4g} TFLOP/s {dtype}, {bw_t:.3g} TB/s)")
    ax.set_ylim(min(min(peak, x * bw) for x in grid) / 2, peak * 3)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(loc="lower right", fontsize=8)
    return _save(fig, path)


def plot_kv_memory(
    configs: Sequence[ModelConfig],
    contexts: Sequence[int],
    path: str | Path | None = None,
    dtype_bytes: int = 2,
    hardware: Hardware | None = None,
) -> Figure:
    """KV bytes of one sequence vs context length, MHA (dashed) vs GQA (solid), under the GPU's memory."""
    hw = hardware or HARDWARE["h100"]
    contexts = sorted(contexts)
    fig = Figure(figsize=(8, 5.5))
    ax = fig.add_subplot()
    for i, cfg in enumerate(configs):
        gqa = [kv_bytes(cfg, dtype_bytes, n).value / 1e9 for n in contexts]
        mha = [kv_bytes(cfg, dtype_bytes, n, mha=True).value / 1e9 for n in contexts]
        if cfg.num_kv_heads == cfg.num_heads:
            ax.loglog(contexts, gqa, color=f"C{i}", lw=2, label=f"{cfg.name}: MHA ({cfg.num_heads} KV heads)")
        else:
            ax.loglog(contexts, gqa, color=f"C{i}", lw=2, label=f"{cfg.name}: GQA ({cfg.num_kv_heads} KV heads)")
            ax.loglog(contexts, mha, color=f"C{i}", lw=1.5, ls="--", label=f"{cfg.name}: as MHA ({cfg.num_heads})")
        room = hw.memory_bytes - weight_bytes(cfg, dtype_bytes).value
        if room > 0:
            ax.axhline(room / 1e9, color=f"C{i}", ls=":", lw=1, label=f"{cfg.name}: memory left after weights")
    ax.axhline(hw.memory_bytes / 1e9, color="black", lw=2, label=f"{hw.name} memory ({hw.memory_bytes / 1e9:.0f} GB)")
    ax.set_xlabel("context length N (tokens of one sequence)")
    ax.set_ylabel(f"KV cache (GB, {dtype_bytes}-byte elements)")
    ax.set_title("KV-cache memory of one sequence: MHA vs GQA")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=8, loc="upper left")
    return _save(fig, path)
