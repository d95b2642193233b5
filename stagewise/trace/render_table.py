"""Flat renderings of a trace: a rich table (one row per stage call) and a markdown table.

At projector width (`compact=True`, chosen by `trace` below its compact width) the table uses the
compact tree's labels: bare sizes glued to their names (`x[5,576]`, one word each, so a cell wraps
between tensors and never inside a shape), weights and the step's metadata left out, and "same"
for outputs shaped like their inputs.
"""

from rich import box
from rich.table import Table
from rich.text import Text

from stagewise.trace.render_tree import tensor_lists
from stagewise.trace.tracer import StageRecord, Tracer


def _rows(tracer: Tracer, layers, steps, stages):
    """Yield (step label, layer label, StageRecord) for the selected stage calls."""
    for rec in tracer.prelude:
        if not stages or rec.stage in stages:
            yield "-", "-", rec
    for step in tracer.steps:
        if steps is not None and step.index not in steps:
            continue
        for rec in step.stages:
            if stages and rec.stage not in stages:
                continue
            if rec.layer is not None and layers != "all" and rec.layer not in layers:
                continue
            yield str(step.index), _layer_label(rec), rec


def _layer_label(rec: StageRecord) -> str:
    if rec.layer is not None:
        return str(rec.layer)
    return "-" if rec.stage == "embedding" else "final"


def _tensors(recs) -> str:
    shown = (t for t in recs if not t.name.startswith("sampling."))
    return ", ".join(f"{t.name} {t.label()}" + (f" {t.dtype}" if t.packed else "") for t in shown)


def _ms(rec: StageRecord) -> str:
    return "" if rec.dur_us is None else f"{rec.dur_us / 1000:.2f}"


def _cells(
    step_label: str, layer_label: str, rec: StageRecord, ranks: bool = False, compact: bool = False
) -> list[str]:
    """One row: step, layer, [rank,] stage, backend, inputs, outputs, ms."""
    if compact:
        inputs, outputs = tensor_lists(rec, compact=True, sep="")
    else:
        inputs, outputs = _tensors(rec.inputs), _tensors(rec.outputs)
    rank = [str(rec.rank)] if ranks else []
    return [step_label, layer_label, *rank, rec.stage, rec.backend, inputs, outputs or "(in place)", _ms(rec)]


def _has_ranks(tracer: Tracer) -> bool:
    """True for a tensor-parallel trace: then every row says which rank ran it."""
    return any(rec.rank for step in tracer.steps for rec in step.stages)


def render_table(tracer: Tracer, layers="first", steps=None, stages=None, compact: bool = False) -> Table:
    layer_sel = [0] if layers == "first" else layers
    title = f"stagewise trace · {tracer.model.get('name')} · mode {tracer.model.get('mode')}"
    ranks = _has_ranks(tracer)
    if compact:
        return _compact_table(tracer, layer_sel, steps, stages, ranks, title)
    table = Table(title=title)
    for col in ("step", "layer", *(["rank"] if ranks else []), "stage", "backend", "inputs", "outputs", "ms"):
        table.add_column(col, overflow="fold")
    for step_label, layer_label, rec in _rows(tracer, layer_sel, steps, stages):
        cells = _cells(step_label, layer_label, rec, ranks)
        table.add_row(*(Text(c) for c in cells))  # Text: shapes like [num_tokens=5] are not markup
    return table


def _compact_table(tracer: Tracer, layer_sel, steps, stages, ranks: bool, title: str) -> Table:
    """No vertical rules, and step / layer as a heading row over their stages: the columns left
    are wide enough at 80 columns for each tensor label to stay whole."""
    rows, heading = [], None
    for step_label, layer_label, rec in _rows(tracer, layer_sel, steps, stages):
        here = _heading(step_label, layer_label)
        if here != heading:
            heading = here
            rows.append([*([""] if ranks else []), here, "", "", "", ""])
        rows.append(_cells(step_label, layer_label, rec, ranks, compact=True)[2:])  # step, layer: in the heading
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    columns = (*(["rank"] if ranks else []), "stage", "tier", "in", "out", "ms")
    if not any(row[-1] for row in rows):  # untimed (--no-timing, a shape-only model): no empty ms column
        rows, columns = [row[:-1] for row in rows], columns[:-1]
    for i, col in enumerate(columns):
        wraps = col in ("in", "out")
        # a tensor label is one word: the column is at least as wide as the longest (up to a cap that
        # leaves room for the other columns at 80: a KV pool's label in "in", the hidden state in "out")
        widest = max((len(word) for row in rows for word in row[i].split()), default=0)
        cap = 24 if col == "in" else 22
        table.add_column(col, overflow="fold", no_wrap=not wraps, min_width=min(widest, cap) if wraps else len(col))
    for row in rows:
        style = "bold" if not row[-3] else ""  # a heading row (no tier)
        table.add_row(*(Text(c, style=style) for c in row))
    return table


def _heading(step_label: str, layer_label: str) -> str:
    step = "before step 0" if step_label == "-" else f"step {step_label}"
    if layer_label == "-":
        return step
    return f"{step} · {'final' if layer_label == 'final' else 'layer ' + layer_label}"


def render_markdown(tracer: Tracer, layers="first", steps=None, stages=None) -> str:
    layer_sel = [0] if layers == "first" else layers
    m = tracer.model
    lines = [
        f"# stagewise trace: {m.get('name')}",
        "",
        f"{m.get('num_layers')} layers, hidden {m.get('hidden_size')}, {m.get('num_heads')} heads, "
        f"{m.get('num_kv_heads')} KV heads, head_dim {m.get('head_dim')}, vocab {m.get('vocab_size')}; "
        f"mode {m.get('mode')}, backend {m.get('backend')}"
        + ("" if "batch_invariant" not in m else f", batch-invariant {'on' if m['batch_invariant'] else 'off'}")
        + (f", prefix cache {m['prefix_cache']}" if m.get("prefix_cache") else ""),
        "",
    ]
    ranks = _has_ranks(tracer)
    cols = ["step", "layer", *(["rank"] if ranks else []), "stage", "backend", "inputs", "outputs", "ms"]
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for step_label, layer_label, rec in _rows(tracer, layer_sel, steps, stages):
        cells = _cells(step_label, layer_label, rec, ranks)
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    if tracer.summary:
        lines += ["", "**summary:** " + ", ".join(f"{k} {v}" for k, v in tracer.summary.items())]
    return "\n".join(lines) + "\n"
