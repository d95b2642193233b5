"""The tracer, its renderers and exports, and the `trace` CLI — checked on content, not exit codes."""

import json
import os
import subprocess
import sys

import jsonschema
import pytest

from stagewise import LLM, SamplingParams
from stagewise.config import EngineConfig
from stagewise.serve.replay import load_run
from stagewise.trace.export import TRACE_SCHEMA, to_chrome, to_json
from stagewise.trace.render_table import render_markdown
from stagewise.trace.tracer import Tracer

ENV = {**os.environ, "STAGEWISE_QUIET": "1", "NO_COLOR": "1", "HF_HUB_OFFLINE": "1"}
LAYER_STAGES = {
    "paged": ["rmsnorm", "qkv_proj", "rope", "kv_store", "paged_attention", "o_proj", "rmsnorm", "ffn"],
    "kv": ["rmsnorm", "qkv_proj", "rope", "kv_store", "attention", "o_proj", "rmsnorm", "ffn"],
    "naive": ["rmsnorm", "qkv_proj", "rope", "attention", "o_proj", "rmsnorm", "ffn"],
}
AXES = {
    "hidden": "hidden_size",
    "heads": "num_heads",
    "kv_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "vocab": "vocab_size",
}


def run_cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "stagewise.cli", "trace", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)


def traced(tiny, mode: str, prompts, ecfg=None, max_tokens=4) -> dict:
    llm = LLM(tiny, mode=mode, engine_config=ecfg)
    with Tracer() as tracer:
        llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return to_json(tracer)


def check_trace(doc: dict, config) -> None:
    """The invariants every trace must satisfy, whatever the mode."""
    jsonschema.validate(doc, TRACE_SCHEMA)
    mode = doc["model"]["mode"]
    for step in doc["steps"]:
        # every layer runs the mode's stages in order
        layers = {}
        for rec in step["stages"]:
            if rec["layer"] is not None:
                layers.setdefault(rec["layer"], []).append(rec["stage"])
        assert sorted(layers) == list(range(config.num_layers))
        assert all(names == LAYER_STAGES[mode] for names in layers.values()), layers
        outside = [r["stage"] for r in step["stages"] if r["layer"] is None]
        assert outside == ["embedding", "rmsnorm", "lm_head", "sampling"] or outside == ["embedding", "rmsnorm"]
        # num_tokens of the step == the tokens scheduled per request
        num_tokens = sum(r["num_scheduled"] for r in step["requests"])
        emb = next(r for r in step["stages"] if r["stage"] == "embedding")
        assert emb["inputs"][0]["shape"] == [num_tokens if mode != "kv" else emb["inputs"][0]["shape"][0]]
        if mode == "paged":
            assert emb["inputs"][0]["shape"] == [num_tokens]
            assert len(step["batch"]["positions"]) == num_tokens
        # axis names agree with the model config
        for rec in step["stages"]:
            for t in rec["inputs"] + rec["outputs"]:
                for axis, size in zip(t["axes"] or [], t["shape"]):
                    if axis in AXES:
                        assert size == getattr(config, AXES[axis]), (rec["stage"], t)
                    if axis == "qkv_size":
                        assert size == config.qkv_size
        if mode == "paged":
            # slot_mapping == block_id * block_size + offset, read from the block table rows
            batch = step["batch"]
            block_size = next(r for r in step["stages"] if r["stage"] == "paged_attention")["inputs"][1]["shape"][1]
            slots = iter(batch["slot_mapping"])
            positions = iter(batch["positions"])
            for row, req in zip(batch["block_table"], step["requests"]):
                for _ in range(req["num_scheduled"]):
                    pos, slot = next(positions), next(slots)
                    assert slot == row[pos // block_size] * block_size + pos % block_size


@pytest.mark.parametrize("mode", ["paged", "kv", "naive"])
def test_trace_invariants_on_tiny(tiny, mode):
    doc = traced(tiny, mode, ["Hello there", "A somewhat longer second prompt for the trace"])
    check_trace(doc, tiny.config)
    assert doc["summary"]["output_tokens"] == 8


def test_continuous_batching_shows_chunks_mixing_and_joining(tiny):
    """3 prompts, 2 seats, a 16-token budget: chunked prefill, prefill+decode in one step, a late joiner."""
    prompts = ["hi", "the cat sat on the mat " * 6, "a mat and then the cat ran far away quickly"]
    ecfg = EngineConfig(max_num_seqs=2, max_num_batched_tokens=16)
    doc = traced(tiny, "paged", prompts, ecfg, max_tokens=5)
    check_trace(doc, tiny.config)
    steps = doc["steps"]
    phases = [{r["request_id"]: r["phase"] for r in s["requests"]} for s in steps]
    assert any("prefill chunk" in p.values() for p in phases), "a long prompt should be split across steps"
    assert any(
        {"decode", "prefill"} <= set(p.values()) or {"decode", "prefill chunk"} <= set(p.values()) for p in phases
    ), "prefill and decode should share a step"
    first_seen = {}
    for i, p in enumerate(phases):
        for rid in p:
            first_seen.setdefault(rid, i)
    assert first_seen["req-2"] > 0, "the third request joins only when a seat frees up"
    assert all(s["num_scheduled"] > 0 for st in steps for s in st["requests"])
    assert all(sum(r["num_scheduled"] for r in s["requests"]) <= 16 for s in steps)
    assert all(len(s["requests"]) <= 2 for s in steps)


def test_chrome_export_is_valid_trace_event_format(tiny):
    llm = LLM(tiny)
    with Tracer() as tracer:
        llm.generate(["Hello", "World wide"], SamplingParams(max_tokens=3, temperature=0))
    doc = json.loads(json.dumps(to_chrome(tracer)))
    required = {
        "X": {"name", "ph", "ts", "dur", "pid", "tid"},
        "C": {"name", "ph", "ts", "pid", "args"},
        "M": {"name", "ph", "pid", "args"},
    }
    kinds = set()
    for ev in doc["traceEvents"]:
        assert ev["ph"] in required, ev
        assert required[ev["ph"]] <= set(ev), ev
        kinds.add(ev["ph"])
        if ev["ph"] == "X":
            assert ev["dur"] >= 0 and ev["ts"] >= 0
        if ev["ph"] == "C":
            assert all(isinstance(v, int | float) for v in ev["args"].values())
    assert kinds == {"X", "C", "M"}
    steps = [e for e in doc["traceEvents"] if e.get("cat") == "step"]
    stages = [e for e in doc["traceEvents"] if e.get("cat") == "stage" and e["name"] != "tokenize (final)"]
    for st in stages:  # every stage event sits inside one step event
        assert any(s["ts"] <= st["ts"] and st["ts"] + st["dur"] <= s["ts"] + s["dur"] + 1 for s in steps), st


def test_markdown_rendering(tiny):
    llm = LLM(tiny)
    with Tracer() as tracer:
        llm.generate("Hello", SamplingParams(max_tokens=2, temperature=0))
    md = render_markdown(tracer)
    assert md.startswith("# stagewise trace")
    # the default tier is torch; each row names the tier that ran (embedding has none: naive)
    assert "backend torch" in md and "| 0 | 0 | qkv_proj | torch | x [num_tokens=" in md
    assert "| 0 | 0 | rmsnorm | torch | x [num_tokens=" in md
    assert "| 0 | - | embedding | naive |" in md


def test_inactive_tracer_records_nothing(tiny):
    tracer = Tracer()
    LLM(tiny).generate("Hello", SamplingParams(max_tokens=2, temperature=0))
    assert tracer.steps == [] and tracer.prelude == []


def test_cli_tree_on_tiny_at_fixed_width():
    res = run_cli(
        "Hello there",
        "Second prompt",
        "--model",
        "tiny",
        "--max-tokens",
        "2",
        "--width",
        "120",
        "--no-timing",
        "--layers",
        "all",
    )
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "\x1b[" not in out  # colour off
    assert all(len(line) <= 120 for line in out.splitlines())
    assert out.count("layer 0") == 2 and out.count("layer 1") == 2  # all layers expanded, in both steps
    for name in LAYER_STAGES["paged"] + ["tokenize", "embedding", "lm_head", "sampling"]:
        assert name in out
    assert "num_computed_tokens 0 -> " in out and "summary:" in out
    assert "tokens from 2 requests" in out and "2 tokens from 2 requests" in out  # two decodes in step 1
    single = run_cli("Hello there", "--model", "tiny", "--max-tokens", "2", "--width", "120", "--no-timing").stdout
    assert "1 token from 1 request ·" in single and "from 1 requests" not in single and "1 tokens" not in single
    assert " ms" not in single.split("summary:")[0]  # --no-timing: no wall time anywhere in the tree


def test_cli_json_and_chrome_files(tmp_path):
    out = tmp_path / "t.json"
    res = run_cli("Hello", "--model", "tiny", "--max-tokens", "2", "--format", "json", "--out", str(out))
    assert res.returncode == 0, res.stderr
    jsonschema.validate(json.loads(out.read_text()), TRACE_SCHEMA)
    assert len(load_run(out)["steps"]) == 2  # `stagewise view t.json` replays it: every step has its view
    assert res.stdout == f"wrote {out} (trace JSON, 2 steps; replay it: stagewise view {out})\n"  # and says so
    chrome = tmp_path / "c.json"
    res = run_cli("Hello", "--model", "tiny", "--max-tokens", "2", "--format", "chrome", "--out", str(chrome))
    assert res.returncode == 0 and "traceEvents" in json.loads(chrome.read_text())
    assert res.stdout.startswith(f"wrote {chrome} (Chrome trace events, 2 steps; open it in Perfetto"), res.stdout


def test_cli_405b_meta_trace_shapes():
    res = run_cli("Hello", "--model", "llama-3-405b", "--max-tokens", "2", "--format", "json", "--no-timing")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    m = doc["model"]
    assert (m["hidden_size"], m["num_heads"], m["num_kv_heads"], m["num_layers"]) == (16384, 128, 8, 126)
    step = doc["steps"][0]
    layers = {r["layer"] for r in step["stages"] if r["layer"] is not None}
    assert layers == set(range(126))
    qkv = next(r for r in step["stages"] if r["stage"] == "qkv_proj")
    assert qkv["outputs"][0]["shape"][1] == (128 + 2 * 8) * 128
    att = next(r for r in step["stages"] if r["stage"] == "paged_attention")
    assert att["inputs"][0]["axes"] == ["num_tokens", "heads", "head_dim"] and att["inputs"][0]["shape"][1:] == [
        128,
        128,
    ]
    tree = run_cli("Hello", "--model", "llama-3-405b", "--max-tokens", "1", "--no-timing", "--width", "160")
    assert tree.returncode == 0 and "hidden=16384" in tree.stdout and "x125 more layers" in tree.stdout


@pytest.mark.model
def test_cli_tree_on_real_model():
    res = run_cli("The capital of France is", "--max-tokens", "2", "--width", "150", "--no-timing")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "smollm2-135m" in out or "SmolLM2" in out
    assert "hidden=576" in out and "heads=9, head_dim=64" in out and "kv_heads=3" in out and "vocab=49152" in out
    assert "GQA group 3" in out and "x29 more layers, same shapes" in out
    assert "text 'The capital of France is'" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["hi", "--model", "tiny", "--format", "yaml"], "unknown format 'yaml'"),
        (["hi", "--model", "tiny", "--stage", "softmax"], "unknown stage 'softmax'"),
        (["hi", "--model", "tiny", "--layers", "x"], "--layers expects numbers"),
        (["hi", "--model", "tiny", "--max-tokens", "0"], "max_tokens must be"),
        (["", "--model", "tiny"], "the prompt is empty"),
    ],
)
def test_cli_bad_input(args, message):
    res = run_cli(*args)
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_cli_filters_apply_to_json_and_chrome(tmp_path):
    out = tmp_path / "t.json"
    args = [
        "Hello there",
        "--model",
        "tiny",
        "--max-tokens",
        "3",
        "--stage",
        "rmsnorm",
        "--layers",
        "1",
        "--steps",
        "0,2",
    ]
    res = run_cli(*args, "--format", "json", "--out", str(out))
    assert res.returncode == 0, res.stderr
    doc = json.loads(out.read_text())
    jsonschema.validate(doc, TRACE_SCHEMA)
    assert [s["index"] for s in doc["steps"]] == [0, 2]
    stages = [(r["stage"], r["layer"]) for s in doc["steps"] for r in s["stages"]]
    assert stages and set(stages) <= {("rmsnorm", 1), ("rmsnorm", None)}, stages
    assert doc["prelude"] == []  # tokenize is not among the chosen stages
    res = run_cli(*args, "--format", "chrome", "--out", str(out))
    names = {e["name"] for e in json.loads(out.read_text())["traceEvents"] if e.get("cat") == "stage"}
    assert names and names <= {"rmsnorm (L1)", "rmsnorm (final)"}, names


def test_a_stage_filter_that_matches_nothing_says_so():
    """`--stage paged_attention` in kv mode (it uses `attention`) or a collective without --tp would print an
    empty trace; a note on stderr says why, and the stages that did run are still shown."""
    res = run_cli("hi", "--model", "tiny", "--max-tokens", "1", "--mode", "kv", "--no-timing",
                  "--stage", "rope", "--stage", "paged_attention", "--stage", "all_reduce")  # fmt: skip
    assert res.returncode == 0, res.stderr
    notes = [line for line in res.stderr.splitlines() if line.startswith("note:")]
    assert notes == [
        "note: no paged_attention call in this run (mode kv)",
        "note: no all_reduce call in this run (mode kv) (collectives run only with --tp > 1)",
    ]
    assert "rope" in res.stdout
