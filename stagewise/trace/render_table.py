"""Flat renderings of a trace: a rich table (one row per stage call) and a markdown table."""

from rich.table import Table
from rich.text import Text

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
    return ", ".join(f"{t.name} {t.label()}" for t in recs if not t.name.startswith("sampling."))


def _ms(rec: StageRecord) -> str:
    return "" if rec.dur_us is None else f"{rec.dur_us / 1000:.2f}"


def _cells(step_label: str, layer_label: str, rec: StageRecord, ranks: bool = False) -> list[str]:
    """One row: step, layer, [rank,] stage, backend, inputs, outputs, ms."""
    outputs = _tensors(rec.outputs) or "(in place)"
    rank = [str(rec.rank)] if ranks else []
    return [step_label, layer_label, *rank, rec.stage, rec.backend, _tensors(rec.inputs), outputs, _ms(rec)]


def _has_ranks(tracer: Tracer) -> bool:
    """True for a tensor-parallel trace: then every row says which rank ran it."""
    return any(rec.rank for step in tracer.steps for rec in step.stages)


def render_table(tracer: Tracer, layers="first", steps=None, stages=None) -> Table:
    layer_sel = [0] if layers == "first" else layers
    table = Table(title=f"stagewise trace · {tracer.model.get('name')} · mode {tracer.model.get('mode')}")
    ranks = _has_ranks(tracer)
    for col in ("step", "layer", *(["rank"] if ranks else []), "stage", "backend", "inputs", "outputs", "ms"):
        table.add_column(col, overflow="fold")
    for step_label, layer_label, rec in _rows(tracer, layer_sel, steps, stages):
        cells = _cells(step_label, layer_label, rec, ranks)
        table.add_row(*(Text(c) for c in cells))  # Text: shapes like [num_tokens=5] are not markup
    return table


def render_markdown(tracer: Tracer, layers="first", steps=None, stages=None) -> str:
    layer_sel = [0] if layers == "first" else layers
    m = tracer.model
    lines = [
        f"# stagewise trace: {m.get('name')}",
        "",
        f"{m.get('num_layers')} layers, hidden {m.get('hidden_size')}, {m.get('num_heads')} heads, "
        f"{m.get('num_kv_heads')} KV heads, head_dim {m.get('head_dim')}, vocab {m.get('vocab_size')}; "
        f"mode {m.get('mode')}, backend {m.get('backend')}",
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
