"""The tracer on packed weights: a projection kept as 4- or 8-bit codes shows its format, the [K, N]
matrix it stands for, and each stored part with its shape, its axes and its dtype.

The tiny model's projections are quantized here with the package's round-to-nearest quantizer
(`quant/quantize.py`, the same layouts a GGUF's Q4_1 / Q8_0 tensors load into), so no file is
written; the run itself is real (naive tier, paged mode).
"""

import io

import jsonschema
from rich.console import Console

from stagewise import LLM, SamplingParams
from stagewise.models.registry import load_model
from stagewise.quant.quantize import quantize
from stagewise.trace.export import TRACE_SCHEMA, to_json
from stagewise.trace.render_tree import render_tree
from stagewise.trace.tracer import Tracer


def test_packed_weights_in_the_trace():
    loaded = load_model("tiny", device="cpu")  # a copy of its own: the weights are replaced below
    for layer in loaded.weights.layers:
        layer.w_qkv = quantize(layer.w_qkv, "q4_1")  # [K=96, N=160] float32 -> codes + scales + mins
        layer.w_down = quantize(layer.w_down, "q8_0")  # [K=256, N=96]
    with Tracer(timing=False) as tracer:
        LLM(loaded, backend="naive").generate(["hello world"], SamplingParams(max_tokens=2, temperature=0))
    qkv = next(r for r in tracer.steps[0].stages if r.stage == "qkv_proj")
    parts = {t.name: t for t in qkv.inputs if t.name.startswith("w_qkv")}
    assert sorted(parts) == ["w_qkv.codes", "w_qkv.mins", "w_qkv.scales"]
    codes, scales = parts["w_qkv.codes"], parts["w_qkv.scales"]
    assert (codes.shape, codes.dtype, codes.axes) == ([160, 48], "uint8", ["N", "K/2"])  # two codes a byte
    assert (scales.shape, scales.dtype, scales.axes) == ([160, 3], "float16", ["N", "K/32"])  # a d per group
    assert {t.packed for t in parts.values()} == {"q4_1 [K=96, N=160]"}
    ffn = next(r for r in tracer.steps[0].stages if r.stage == "ffn")
    down = {t.name: t for t in ffn.inputs}["w_down.codes"]
    assert (down.shape, down.dtype, down.axes, down.packed) == ([96, 256], "int8", ["N", "K"], "q8_0 [K=256, N=96]")
    assert {t.packed for t in ffn.inputs if t.name.startswith("w_gate_up")} == {None}  # still float32
    console = Console(file=io.StringIO(), width=200, no_color=True)
    console.print(render_tree(tracer, decode=str, compact=True))
    text = console.file.getvalue()
    line = "qkv_proj (each layer): w_qkv q4_1 [K=96, N=160]: codes [160,48] uint8, scales [160,3] float16, mins"
    assert line in text, text
    assert "w_down q8_0 [K=256, N=96]: codes [96,256] int8, scales [96,8] float16" in text
    console = Console(file=io.StringIO(), width=400, no_color=True)
    console.print(render_tree(tracer, decode=str))
    assert "w_qkv.codes [N=160, K/2=48] uint8" in console.file.getvalue()
    jsonschema.validate(to_json(tracer), TRACE_SCHEMA)
