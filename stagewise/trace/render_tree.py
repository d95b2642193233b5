"""Render a trace as a rich tree that fits a projector: steps > stages > tensors.

By default the first layer of each expanded step is shown in full and the
others are summarised ("x29 more layers, same shapes"); the caller picks
which layers and steps to expand and can filter by stage.
"""

from rich.console import Group
from rich.markup import escape
from rich.text import Text
from rich.tree import Tree

from stagewise.trace.tracer import StageRecord, StepRecord, Tracer

MAX_LIST = 12  # longest id / position list printed in full


def short_list(values, limit: int = MAX_LIST) -> str:
    values = list(values)
    if len(values) <= limit:
        return "[" + ", ".join(str(v) for v in values) + "]"
    head = ", ".join(str(v) for v in values[: limit // 2])
    tail = ", ".join(str(v) for v in values[-(limit // 2) :])
    return f"[{head}, ... {tail}] ({len(values)} values)"


def stage_line(rec: StageRecord, with_time: bool) -> Text:
    if rec.kind == "collective":
        return collective_line(rec, with_time)
    line = Text()
    line.append(f"{rec.stage:<10}", style="bold cyan")
    line.append(f" {rec.backend:<6}", style="dim")
    ins = ", ".join(f"{t.name} {t.label()}" for t in rec.inputs if not t.name.startswith("sampling."))
    outs = ", ".join(f"{t.name} {t.label()}" for t in rec.outputs)
    if "text" in rec.scalars:  # tokenize: show the text it reads
        ins = f"text {rec.scalars['text']!r}" + (f", {ins}" if ins else "")
    line.append(f" {ins}")
    line.append(" -> ", style="bold")
    line.append(outs or "(in place)", style="green")
    if with_time and rec.dur_us is not None:
        line.append(f"  {rec.dur_us / 1000:.2f} ms", style="dim")
    return line


def collective_line(rec: StageRecord, with_time: bool) -> Text:
    """'all_reduce gloo  x [num_tokens=1, hidden=576] · 2.3 KB over 3 ranks  0.21 ms'."""
    line = Text()
    line.append(f"{rec.stage:<10}", style="bold red")
    line.append(f" {rec.backend:<6}", style="dim")
    tensor = rec.inputs[0]
    kib = rec.scalars.get("bytes", 0) / 1024
    line.append(f" {tensor.name} {tensor.label()} · {kib:.1f} KiB across {rec.scalars.get('world_size')} ranks")
    if with_time and rec.dur_us is not None:
        line.append(f"  {rec.dur_us / 1000:.2f} ms", style="dim")
    return line


def scheduler_lines(info: dict) -> list[str]:
    """The scheduler's decision in two short lines (queues, then KV blocks)."""
    info = dict(info)
    lines = []
    queues = [f"{k} {info.pop(k)}" for k in ("admitted", "preempted", "waiting") if k in info]
    if queues:
        lines.append("queues: " + " · ".join(queues))
    if "kv_blocks_in_use" in info:
        used, total = info.pop("kv_blocks_in_use"), info.pop("kv_blocks_total", "?")
        moves = [f"+{info.pop('blocks_allocated', 0)} allocated"]
        moves.append(f"-{info.pop('blocks_freed_by_preemption', 0)} freed by preemption")
        moves.append(f"-{info.pop('blocks_freed_by_finished_last_step', 0)} freed by requests finished last step")
        lines.append(f"KV blocks in use {used} of {total} ({', '.join(moves)})")
    lines += [f"{k}: {v}" for k, v in info.items()]
    return lines


def model_header(model: dict) -> Text:
    m = model
    return Text.from_markup(
        f"[bold]{m.get('name')}[/]: {m.get('num_layers')} layers, hidden {m.get('hidden_size')}, "
        f"{m.get('num_heads')} heads, {m.get('num_kv_heads')} KV heads (GQA group {m.get('group_size')}), "
        f"head_dim {m.get('head_dim')}, inter {m.get('intermediate_size')}, vocab {m.get('vocab_size')} "
        f"· RoPE {m.get('rope', 'plain')} "
        f"· mode [bold]{m.get('mode')}[/] · backend [bold]{m.get('backend')}[/] · {m.get('dtype')} on {m.get('device')}"
        + (f" · [bold]tensor parallel x{m['tensor_parallel_size']}[/]" if m.get("tensor_parallel_size", 1) > 1 else "")
    )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _step_title(step: StepRecord, with_time: bool = True) -> Text:
    phases = sorted({r["phase"] for r in step.requests if r["num_scheduled"]})
    return Text.from_markup(
        f"[bold magenta]step {step.index}[/] · {_count(step.num_tokens, 'token')} from "
        f"{_count(len(step.requests), 'request')} · {', '.join(phases)}"
        + (f" · {step.dur_us / 1000:.1f} ms" if with_time else "")
    )


def _add_step(tree: Tree, step: StepRecord, layers, stages, with_time: bool, decode=None) -> None:
    node = tree.add(_step_title(step, with_time))
    sched = node.add("[bold]scheduler[/]")
    for r in step.requests:
        extra = "".join(
            f", {k} {v}"
            for k, v in r.items()
            if k not in ("request_id", "num_computed_tokens", "num_tokens", "num_scheduled", "phase")
        )
        sched.add(
            escape(
                f"{r['request_id']}: {r['phase']} · num_computed_tokens {r['num_computed_tokens']} -> "
                f"{r['num_computed_tokens'] + r['num_scheduled']} of num_tokens {r['num_tokens']} "
                f"(+{r['num_scheduled']}){extra}"
            )
        )
    for line in scheduler_lines(step.scheduler):
        sched.add(escape(line))
    meta = node.add("[bold]batch[/]")
    for key, value in step.batch.items():
        if isinstance(value, list) and value and isinstance(value[0], list):
            rows = meta.add(f"{key}")
            for i, row in enumerate(value):
                rows.add(escape(f"row {i}: {short_list(row)}"))
        else:
            meta.add(escape(f"{key} {short_list(value) if isinstance(value, list) else value}"))
    num_layers = 1 + max((s.layer for s in step.stages if s.layer is not None), default=-1)
    shown = set(range(num_layers)) if layers == "all" else {i for i in layers if i < num_layers}
    ranks = sorted({rec.rank for rec in step.stages})
    if len(ranks) <= 1:
        _add_records(node, step.stages, shown, num_layers, stages, with_time)
    else:  # tensor parallelism: each rank's shards and collectives, layer by layer
        for rank in ranks:
            role = "schedules, samples" if rank == 0 else "worker"
            sub = node.add(f"[bold blue]rank {rank}[/] [dim]({role})[/]")
            records = [rec for rec in step.stages if rec.rank == rank]
            _add_records(sub, records, shown, num_layers, stages, with_time)
    for rid, tok in step.sampled.items():
        piece = repr(decode([tok])) if decode else ""
        text = escape(f"sampled token {tok} {piece} · text so far: {step.text.get(rid, '')!r}")
        node.add(f"[bold green]{escape(rid)}[/] {text}")


def _add_records(node: Tree, records, shown: set, num_layers: int, stages, with_time: bool) -> None:
    """Stage and collective lines under `node`: the shown layers in full, the others summarised once."""
    layer_nodes: dict[int, Tree] = {}
    summarised = False
    for rec in records:
        if stages and rec.stage not in stages:
            continue
        if rec.layer is None:
            label = stage_line(rec, with_time)
            if rec.stage == "rmsnorm":
                label = Text("final ") + label
            node.add(label)
            continue
        if rec.layer in shown:
            if rec.layer not in layer_nodes:
                layer_nodes[rec.layer] = node.add(f"[bold yellow]layer {rec.layer}[/]")
            layer_nodes[rec.layer].add(stage_line(rec, with_time))
        elif not summarised and num_layers - len(shown) > 0:
            hidden = num_layers - len(shown)
            node.add(f"[dim]x{hidden} more layers, same shapes (--layers all to expand)[/]")
            summarised = True


def render_tree(
    tracer: Tracer,
    layers="first",
    steps=None,
    stages=None,
    with_time: bool = True,
    decode=None,
) -> Group:
    """layers: "first", "all" or a list of indices; steps: None (all) or a list of indices."""
    layer_sel = [0] if layers == "first" else layers
    tree = Tree(model_header(tracer.model))
    for rec in tracer.prelude:
        if not stages or rec.stage in stages:
            tree.add(Text("before step 0: ") + stage_line(rec, with_time))
    for step in tracer.steps:
        if steps is None or step.index in steps:
            _add_step(tree, step, layer_sel, stages, with_time, decode)
        else:
            tree.add(f"[dim]step {step.index} · {step.num_tokens} tokens (not expanded)[/]")
    parts = [tree]
    if tracer.summary:
        parts.append(Text("summary: " + " · ".join(f"{k} {v}" for k, v in tracer.summary.items()), style="bold"))
    return Group(*parts)
