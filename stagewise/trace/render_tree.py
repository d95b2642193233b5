"""Render a trace as a rich tree that fits a projector: steps > stages > tensors.

By default the first layer of each expanded step is shown in full and the
others are summarised ("x29 more layers, same shapes"); the caller picks
which layers and steps to expand and can filter by stage.

`compact=True` keeps each stage on one line at 100 columns: bare sizes
(`[5,576]` instead of `[num_tokens=5, hidden=576]`), the step's metadata
tensors left out of the stage lines (the step's `batch` node lists them with
their values), the weights left out too (they never change shape: a `weights`
node lists them once, a packed quantized one as its format, the [K, N] matrix it stands
for, and its stored parts with their dtypes: `w_qkv q4_1 [K=576, N=960]: codes [960,288] uint8,
scales [960,18] float16, mins [960,18] float16`), K
and V of the same shape on one entry (`k/v_cache`), and `-> same` when every
output has the shape of the input it replaces.

A shape-only model (meta device) has no values: its sampled ids are
placeholders, so they are shown as such and never decoded into text.
Every string that is data (names, shapes, prompts) reaches Rich as `Text`
or escaped, never as markup: `[num_tokens]` would otherwise vanish.
"""

from rich.console import Group
from rich.markup import escape
from rich.text import Text
from rich.tree import Tree

from stagewise.trace.tracer import StageRecord, StepRecord, Tracer

MAX_LIST = 12  # longest id / position list printed in full
# tensors of the step's metadata: the `batch` node shows them with their values, compact stage lines leave them out
STEP_METADATA = {"positions", "slot_mapping", "cu_seqlens_q", "cu_seqlens_k", "seq_lens", "block_table"}
STEP_METADATA |= {"last_token_index"}
# the run summary's timing keys, each with what it means (the tree prints them on their own line)
TIMING_LABELS = {
    "ttft_ms": "TTFT (time to first token) ms",
    "tbt_ms": "TBT (time between tokens) ms",
    "tps": "TPS (1/TBT, one stream's decode speed)",
    "output_tokens_per_s": "output tokens/s (all requests' output tokens / run time)",
}
PLACEHOLDER = "placeholder id: shape only, not a model's output"


def short_list(values, limit: int = MAX_LIST) -> str:
    values = list(values)
    if len(values) <= limit:
        return "[" + ", ".join(str(v) for v in values) + "]"
    head = ", ".join(str(v) for v in values[: limit // 2])
    tail = ", ".join(str(v) for v in values[-(limit // 2) :])
    return f"[{head}, ... {tail}] ({len(values)} values)"


def _bare(t) -> str:
    """'[5,576]': the sizes alone (the compact label)."""
    return "[" + ",".join(str(n) for n in t.shape) + "]"


def _kv_pairs(tensors) -> list[tuple[str, str]]:
    """(name, label) with K and V of the same shape merged: k_cache, v_cache -> k/v_cache."""
    out: list[tuple[str, str]] = []
    for t in tensors:
        label = _bare(t)
        if out and t.name.startswith("v") and out[-1] == ("k" + t.name[1:], label):
            out[-1] = ("k/" + t.name, label)
        else:
            out.append((t.name, label))
    return out


def _same_shapes(rec: StageRecord) -> bool:
    """Every output has the shape of the input it replaces (`q_out` of `q`, `out` of the first input)."""
    shapes = {t.name: t.shape for t in rec.inputs}
    first = rec.inputs[0].shape if rec.inputs else None
    for t in rec.outputs:
        source = shapes.get(t.name.removesuffix("_out")) if t.name != "out" else first
        if source is None or source != t.shape:
            return False
    return bool(rec.outputs)


def is_weight(name: str) -> bool:
    """A model weight (or a packed weight's field, `w_qkv.codes`), or the RoPE table: fixed shapes.
    A fused kernel's weights keep the kernel's names (`norm_weight`, `w` of rmsnorm+qkv_proj)."""
    return name in ("weight", "norm_weight", "w", "cos_sin_cache") or name.startswith("w_") or "." in name


def tensor_lists(rec: StageRecord, compact: bool, sep: str = " ") -> tuple[str, str]:
    """(inputs, outputs) as text; `sep` joins a name and its shape (compact: bare sizes, no weights)."""
    inputs = [t for t in rec.inputs if not t.name.startswith("sampling.")]
    if not compact:
        ins = ", ".join(f"{t.name}{sep}{t.label()}" + (f" {t.dtype}" if t.packed else "") for t in inputs)
        return ins, ", ".join(f"{t.name}{sep}{t.label()}" for t in rec.outputs)
    shown = (t for t in inputs if t.name not in STEP_METADATA and not is_weight(t.name))
    ins = ", ".join(f"{n}{sep}{label}" for n, label in _kv_pairs(shown))
    if _same_shapes(rec):
        return ins, "same"
    return ins, ", ".join(f"{n}{sep}{label}" for n, label in _kv_pairs(rec.outputs))


def stage_line(rec: StageRecord, with_time: bool, compact: bool = False) -> Text:
    if rec.kind == "collective":
        return collective_line(rec, with_time)
    line = Text()
    line.append(f"{rec.stage:<9}" if compact else f"{rec.stage:<10}", style="bold cyan")
    line.append(f" {rec.backend:<5}" if compact else f" {rec.backend:<6}", style="dim")
    ins, outs = tensor_lists(rec, compact)
    if "text" in rec.scalars:  # tokenize: show the text it reads
        ins = f"text {rec.scalars['text']!r}" + (f", {ins}" if ins else "")
    line.append(f" {ins}")
    line.append(" -> ", style="bold")
    line.append(outs or "(in place)", style="green")
    if with_time and rec.dur_us is not None:
        line.append(f"{' ' if compact else '  '}{rec.dur_us / 1000:.2f} ms", style="dim")
    return line


COMPACT_LEGEND = (
    "compact lines (--full for everything on each line): bare sizes, '-> same' = outputs shaped like the "
    "inputs they replace, k/v = K and V of one shape; the weights are listed once (weights), the step's "
    "metadata tensors under its batch"
)


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
        moves.append(f"-{info.pop('blocks_freed_by_preemption', 0)} preempted")
        moves.append(f"-{info.pop('blocks_freed_by_finished_last_step', 0)} of finished requests")
        lines.append(f"KV blocks in use {used} of {total} ({', '.join(moves)})")
    if "block_copies" in info:
        pairs = ", ".join(f"{src} -> {dst}" for src, dst in info.pop("block_copies"))
        lines.append(f"copy-on-write (a shared block copied before it is written): {pairs}")
    lines += [f"{k}: {v}" for k, v in info.items()]
    return lines


def model_header(model: dict) -> Text:
    m = model
    e = {k: escape(str(v)) for k, v in m.items()}  # a model's name may be a file name with brackets
    return Text.from_markup(
        f"[bold]{e.get('name')}[/]: {e.get('num_layers')} layers, hidden {e.get('hidden_size')}, "
        f"{e.get('num_heads')} heads, {e.get('num_kv_heads')} KV heads (GQA group {e.get('group_size')}), "
        f"head_dim {e.get('head_dim')}, inter {e.get('intermediate_size')}, vocab {e.get('vocab_size')} "
        f"· RoPE {e.get('rope', 'plain')} "
        f"· mode [bold]{e.get('mode')}[/] · backend [bold]{e.get('backend')}[/] · {e.get('dtype')} on {e.get('device')}"
        + packed_weights(m)
        + invariance(m)
        + (f" · prefix cache [bold]{e['prefix_cache']}[/]" if m.get("prefix_cache") else "")
        + (f" · [bold]tensor parallel x{m['tensor_parallel_size']}[/]" if m.get("tensor_parallel_size", 1) > 1 else "")
        + (" · [bold]shape only[/] (no values)" if is_shape_only(m) else "")
        + (f" · [bold]random weights[/] ({RANDOM_WEIGHTS})" if m.get("random_weights") else "")
    )


RANDOM_WEIGHTS = "seeded: the text is noise, the shapes and times are real"


def invariance(model: dict) -> str:
    """' · batch-invariant' or ' · not batch-invariant' (describe()'s "batch_invariant"); '' if unknown."""
    if "batch_invariant" not in model:  # a trace recorded before the switch existed
        return ""
    return " · batch-invariant" if model["batch_invariant"] else " · [bold]not batch-invariant[/]"


def packed_weights(model: dict) -> str:
    """' · weights q4_1/q8_0 packed' when some weights are kept quantized (describe()'s "weights"), else ''."""
    kinds = [part.split(" x ")[0] for part in str(model.get("weights") or "").split(", ") if part]
    packed = [k for k in kinds if not k.startswith(("float", "bfloat"))]
    return f" · weights [bold]{'/'.join(packed)}[/] packed" if packed else ""


def is_shape_only(model: dict) -> bool:
    """A model on the meta device: shapes without values (its sampled ids are placeholders)."""
    return bool(model.get("shape_only")) or model.get("device") == "meta"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _step_title(step: StepRecord, with_time: bool = True) -> Text:
    phases = sorted({r["phase"] for r in step.requests if r["num_scheduled"]})
    return Text.from_markup(
        f"[bold magenta]step {step.index}[/] · {_count(step.num_tokens, 'token')} from "
        f"{_count(len(step.requests), 'request')} · {escape(', '.join(phases))}"
        + (f" · {step.dur_us / 1000:.1f} ms" if with_time else "")
    )


FIRST_CALL = (
    "the first step's times include each stage's first call: one-time set-up (memory, PyTorch's lazy "
    "initialisation, a kernel's first launch) that later steps no longer pay"
)


def _num_blocks(step: StepRecord, key: str, row: int, num_rows: int) -> int | None:
    """How many entries of a block-table row are the request's blocks (the rest is padding)."""
    if key != "block_table" or len(step.requests) != num_rows:
        return None
    blocks = step.requests[row].get("blocks")
    return len(blocks) if isinstance(blocks, list) else None


def table_row(row: list, num_blocks: int | None) -> str:
    """A block-table row; its padding (the rows of a step are as long as its longest) named as such:
    the entries past a request's blocks are never read, and their 0 is not block 0."""
    if num_blocks is None or num_blocks >= len(row):
        return short_list(row)
    pad = len(row) - num_blocks
    return f"{short_list(row[:num_blocks])} + padding {row[num_blocks]} x {pad} (past its blocks: never read)"


def _add_step(
    tree: Tree, step: StepRecord, layers, stages, with_time: bool, decode=None, compact=False, first=False
) -> None:
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
    if with_time and first:
        node.add(Text(FIRST_CALL, style="dim"))
    meta = node.add("[bold]batch[/]")
    for key, value in step.batch.items():
        if isinstance(value, list) and value and isinstance(value[0], list):
            rows = meta.add(Text(str(key)))
            for i, row in enumerate(value):
                rows.add(escape(f"row {i}: {table_row(row, _num_blocks(step, key, i, len(value)))}"))
        else:
            meta.add(escape(f"{key} {short_list(value) if isinstance(value, list) else value}"))
    num_layers = 1 + max((s.layer for s in step.stages if s.layer is not None), default=-1)
    shown = set(range(num_layers)) if layers == "all" else {i for i in layers if i < num_layers}
    ranks = sorted({rec.rank for rec in step.stages})
    if len(ranks) <= 1:
        _add_records(node, step.stages, shown, num_layers, stages, with_time, compact)
    else:  # tensor parallelism: each rank's shards and collectives, layer by layer
        for rank in ranks:
            role = "schedules, samples" if rank == 0 else "worker"
            sub = node.add(f"[bold blue]rank {rank}[/] [dim]({role})[/]")
            records = [rec for rec in step.stages if rec.rank == rank]
            _add_records(sub, records, shown, num_layers, stages, with_time, compact)
    for rid, tok in step.sampled.items():
        if decode is None:  # shape only: the id is a placeholder, there is no text to decode
            text = escape(f"sampled id {tok} ({PLACEHOLDER})")
        else:
            shown = decode([tok])  # a str, or bytes: a byte token that is part of a character
            part = " (bytes: part of a character)" if isinstance(shown, bytes) else ""
            text = escape(f"sampled token {tok} {shown!r}{part} · text so far: {step.text.get(rid, '')!r}")
        node.add(f"[bold green]{escape(rid)}[/] {text}")


def _add_records(node: Tree, records, shown: set, num_layers: int, stages, with_time: bool, compact=False) -> None:
    """Stage and collective lines under `node`: the shown layers in full, the others summarised once."""
    layer_nodes: dict[int, Tree] = {}
    summarised = False
    for rec in records:
        if stages and rec.stage not in stages:
            continue
        if rec.layer is None:
            label = stage_line(rec, with_time, compact)
            if rec.stage == "rmsnorm":
                label = Text("final ") + label
            node.add(label)
            continue
        if rec.layer in shown:
            if rec.layer not in layer_nodes:
                layer_nodes[rec.layer] = node.add(f"[bold yellow]layer {rec.layer}[/]")
            layer_nodes[rec.layer].add(stage_line(rec, with_time, compact))
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
    compact: bool = False,
) -> Group:
    """layers: "first", "all" or a list of indices; steps: None (all) or a list of indices.

    decode: ids -> text (the tokenizer's), or None for a shape-only model (placeholder ids, never decoded).
    """
    if is_shape_only(tracer.model):
        decode, with_time = None, False
    layer_sel = [0] if layers == "first" else layers
    header = model_header(tracer.model)
    if compact:
        header = Text.assemble(header, "\n", Text(COMPACT_LEGEND, style="dim"))
    tree = Tree(header)
    for rec in tracer.prelude:
        if not stages or rec.stage in stages:
            tree.add(Text("before step 0: ") + stage_line(rec, with_time, compact))
    if compact:
        _add_weights(tree, tracer)
    shown = [step for step in tracer.steps if steps is None or step.index in steps]
    for step in tracer.steps:
        if steps is None or step.index in steps:
            first = step is shown[0] and step.index == 0
            _add_step(tree, step, layer_sel, stages, with_time, decode, compact, first)
        else:
            tree.add(f"[dim]step {step.index} · {_count(step.num_tokens, 'token')} (not expanded)[/]")
    return Group(tree, *summary_lines(tracer.summary, with_time))


def _add_weights(tree: Tree, tracer: Tracer) -> None:
    """The weights once (compact lines leave them out): layer 0's, and those outside the blocks, of every
    step (a first step that is a prefill chunk runs no lm_head; a decode step may run other kernels)."""
    seen: dict[tuple[str, str], list[str]] = {}
    records = [rec for step in tracer.steps for rec in step.stages if rec.layer in (None, 0)]
    for rec in records:
        where = rec.stage if rec.layer is None else f"{rec.stage} (each layer)"
        for t in rec.inputs:
            if is_weight(t.name) and not t.name.startswith("sampling."):  # sampling's knobs are not weights
                name, _, part = t.name.partition(".")
                if t.packed:  # w_qkv q4_1 [K=576, N=960]: codes [960,288] uint8, scales [960,18] float16
                    name = f"{name} {t.packed}:"
                entry = seen.setdefault((where, name), [])
                label = f"{part} {_bare(t)}" if part else _bare(t)
                label += f" {t.dtype}" if t.packed else ""
                if label not in entry:
                    entry.append(label)
    if seen:
        node = tree.add("[bold]weights[/] [dim](every one the run used; the same at every step)[/]")
        for (where, name), labels in seen.items():
            node.add(Text(f"{where}: {name} " + ", ".join(labels)))


def token_decoder(tokenizer):
    """ids -> their text, or their bytes when those are not whole UTF-8 characters (a byte-level token
    can be half of 'é': decoded alone it would print as a replacement character)."""

    def decode(ids: list[int]) -> str | bytes:
        text = tokenizer.decode(ids)
        if "\ufffd" in text:
            raw = tokenizer.bytes_of(ids)
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                return raw
        return text

    return decode


def summary_lines(summary: dict, with_time: bool) -> list[Text]:
    """The run's counts on one line; its times on another, each named for what it measures."""
    counts = {k: v for k, v in summary.items() if k not in TIMING_LABELS}
    lines = [Text("summary: " + " · ".join(f"{k} {v}" for k, v in counts.items()), style="bold")] if counts else []
    times = [f"{label} {summary[k]}" for k, label in TIMING_LABELS.items() if summary.get(k) is not None]
    if with_time and times:
        lines.append(Text("timing: " + " · ".join(times), style="bold"))
    return lines
