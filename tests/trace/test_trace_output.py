"""What the trace and the stages table print: every registry shape and every traced shape survives Rich
(brackets are data, not markup), one line per stage at 100 columns, and an untimed or shape-only trace is
the same bytes in every format, run after run, with no decoded text for placeholder ids."""

import io
import json

import pytest
from rich.console import Console

from stagewise import LLM, SamplingParams
from stagewise.cli.main import stages_table
from stagewise.cli.trace import FORMATS, render
from stagewise.config import EngineConfig
from stagewise.stages import STAGES
from stagewise.trace.export import drop_times, mark_shape_only
from stagewise.trace.render_tree import render_tree
from stagewise.trace.tracer import Tracer


def printed(renderable, width: int) -> str:
    console = Console(file=io.StringIO(), width=width, no_color=True)
    console.print(renderable)
    return console.file.getvalue()


def test_stages_table_keeps_every_registry_shape():
    wide = printed(stages_table(), 300)
    for stage in STAGES.values():
        assert stage.shapes in wide, stage.shapes  # [num_tokens], [num_slots, Hkv, d], [num_seqs, vocab] ...
        assert stage.summary in wide
    narrow = printed(stages_table(), 80)
    assert "…" not in narrow and max(map(len, narrow.splitlines())) <= 80
    words = narrow.split()
    for stage in STAGES.values():
        for word in stage.shapes.split():
            assert word in words, word


def table_cells(text: str) -> list[list[str]]:
    """The rows of a printed boxed table, each cell's wrapped lines joined back: with a space, or with
    nothing after a line that ends in '/' or '-' (where FitTable may break inside a long word)."""
    rows: list[list[list[str]]] = []
    for line in text.splitlines():
        if not line.startswith("│"):
            continue
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if cells[0] or not rows:
            rows.append([[] for _ in cells])
        for parts, cell in zip(rows[-1], cells):
            if cell:
                parts.append(cell)

    def join(parts: list[str]) -> str:
        out = ""
        for part in parts:
            out += part if not out or out.endswith(("/", "-")) else " " + part
        return out

    return [[join(parts) for parts in row] for row in rows]


def test_stages_table_at_80_columns_cuts_no_word():
    """Each cell read back from the 80-column table is its registry text: lines break between words, or
    after a '/' or '-' inside a long one ('position-' / 'dependent'), never in a word's middle."""
    rows = table_cells(printed(stages_table(), 80))
    want = [[s.name, s.shapes, s.summary, s.triton_kind] for s in STAGES.values()]
    assert rows == [[" ".join(cell.split()) for cell in row] for row in want]


def trace_of(llm, timing: bool = True, prompts=("Hello there", "A second prompt")) -> Tracer:
    with Tracer(timing=timing) as tracer:
        llm.generate(list(prompts), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    if llm.weightless:
        mark_shape_only(tracer)
    if not timing or llm.weightless:
        drop_times(tracer)
    return tracer


def test_tree_keeps_every_traced_shape_and_compact_stays_on_one_line(tiny):
    tracer = trace_of(LLM(tiny))
    full = printed(render_tree(tracer, layers="all", decode=None), 400)
    tensors = [t for step in tracer.steps for rec in step.stages for t in rec.inputs + rec.outputs]
    labels = {t.label() for t in tensors if not t.name.startswith("sampling.")}  # sampling's knobs are not shown
    for label in labels:
        assert label in full, label  # [num_tokens=2, hidden=96] ... never eaten as markup
    compact = printed(render_tree(tracer, layers="all", decode=str, compact=True), 100)
    assert (
        "weights (every one the run used; the same at every step)" in compact
        and "qkv_proj (each layer): w_qkv" in compact
    )
    lines = compact.splitlines()
    assert max(map(len, lines)) <= 100
    records = sum(len(step.stages) for step in tracer.steps) + len(tracer.prelude)
    arrows = [line for line in lines if " -> " in line and " ms" in line]
    assert len(arrows) == records - sum(1 for s in tracer.steps for r in s.stages if r.stage == "tokenize")


def renders(tracer, decode) -> dict[str, str]:
    out = {}
    for fmt in FORMATS:
        out[fmt] = render(tracer, fmt, "first", None, set(), False, decode, 100, to_file=True)
    return out


def test_no_timing_is_byte_identical_in_every_format(tiny):
    ecfg = EngineConfig(num_kv_blocks=64)
    first, second = (renders(trace_of(LLM(tiny, engine_config=ecfg), timing=False), str) for _ in range(2))
    for fmt in FORMATS:
        assert first[fmt] == second[fmt], fmt
    assert " ms" not in first["tree"] and "TTFT" not in first["tree"]
    assert not timed_values(json.loads(first["json"])), "an untimed trace carries a measured time"


TIME_KEYS = ("ttft_ms", "tbt_ms", "tps", "output_tokens_per_s", "latency_s")


def timed_values(doc) -> list:
    """(key, value) of every measured time in a JSON document: a time key whose value is not null.
    (A step's `dur_us` untimed counts stage calls, and `start_us` numbers them: not times.)"""
    found = []
    if isinstance(doc, dict):
        for key, value in doc.items():
            if key in TIME_KEYS and value is not None:
                found.append((key, value))
            found += timed_values(value)
    elif isinstance(doc, list):
        for item in doc:
            found += timed_values(item)
    return found


@pytest.mark.parametrize("preset", ["llama-3.2-1b"])
def test_shape_only_trace_has_no_text_and_no_time(preset):
    ecfg = EngineConfig(num_kv_blocks=64)  # a fixed pool, as `trace` has (the default follows free memory)
    first, second = (renders(trace_of(LLM(preset, engine_config=ecfg), timing=True), None) for _ in range(2))
    for fmt in FORMATS:
        assert first[fmt] == second[fmt], fmt
    tree = first["tree"]
    assert "placeholder id: shape only, not a model's output" in tree
    assert "text so far" not in tree and "endoftext" not in tree and " ms" not in tree
    assert not timed_values(json.loads(first["json"])) and "placeholders" in first["json"]


@pytest.mark.parametrize("preset", ["tiny", "llama-3.2-1b"])  # 1B: shape-only, vocab 128256
def test_table_at_80_columns_keeps_every_shape_whole(tiny, preset):
    """`trace --format table` on a projector: compact labels, each tensor's shape on one line, no number cut."""
    from stagewise.trace.render_table import render_table
    from stagewise.trace.render_tree import tensor_lists

    llm = LLM(tiny) if preset == "tiny" else LLM(preset, engine_config=EngineConfig(num_kv_blocks=64))
    tracer = trace_of(llm)
    text = printed(render_table(tracer, layers="all", compact=True), 80)
    lines = text.splitlines()
    assert max(map(len, lines)) <= 80
    records = [r for s in tracer.steps for r in s.stages] + list(tracer.prelude)
    for rec in records:
        ins, outs = tensor_lists(rec, compact=True, sep="")
        for label in (ins + ", " + outs).split(", "):
            if label:
                assert any(label.rstrip(",") in line for line in lines), label  # whole, never folded
    assert ("ms" in lines[2]) == (preset == "tiny")  # the untimed shape-only table has no empty ms column
    for word in ("step 0 · layer 0", "step 1 · final"):
        assert word in text
    wide = printed(render_table(tracer, layers="all"), 400)  # the full table is unchanged: axis names shown
    assert "[num_tokens=" in wide
