"""The calculator: the seeds' worked numbers, exact counts against the configs, properties, CLI, plots, probe.

Seed figures are quoted from ../shared/seeds/003_*.txt (chapters 5-8, Llama 3
405B: d = 16384, L = 126, fp16, an H100 taken as 1 PFLOP/s and 3.3 TB/s).
Tolerances are the seeds' rounding: they print 2-4 significant figures.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stagewise.calc.counts import (
    attention_flops,
    kv_bytes,
    kv_bytes_per_token,
    linear_coefficient,
    linear_flops,
    seeds_attention_flops,
    seeds_kv_bytes_per_token,
    seeds_linear_flops,
    seeds_params_flops,
)
from stagewise.calc.hardware import HARDWARE, probe_this_machine
from stagewise.calc.roofline import analyze, load_hardware, load_model_config, summarize
from stagewise.calc.seeds import seeds_worked_examples
from stagewise.config import PRESETS
from stagewise.errors import StagewiseError
from stagewise.kv.paged import kv_bytes_per_token as engine_kv_bytes_per_token

L, D, P = 126, 16384, 405e9  # the seeds' Llama 3 405B
BIG = PRESETS["llama-3-405b"]
SEEDS_HW = HARDWARE["h100-seeds"]


def close(ours: float, seed: float, rel: float) -> bool:
    return abs(ours - seed) <= rel * abs(seed)


# ---------------------------------------------------------------- the seeds' numbers, one by one


def test_ch6_mha_kv_per_token_and_at_one_million():
    per_token = seeds_kv_bytes_per_token(L, D, 2).value
    assert per_token / 1024 == 8064  # "16384 * 2 * 2 = 64 KB ... 64 KB * 126 = 8064 KB" (KB = KiB)
    assert close(per_token * 1e6 / 1e12, 8.26, 1e-3)  # "8064 KB * 1,000,000 ≈ 8.26 TB"
    # the preset as MHA gives the same, and its real GQA (8 KV heads) is 16x smaller: 516,096 B
    assert kv_bytes_per_token(BIG, 2, mha=True).value == per_token
    assert kv_bytes_per_token(BIG, 2).value == 126 * 2 * 8 * 128 * 2 == 516_096


def test_ch5_naive_step_at_1000_and_at_one_million():
    lin = seeds_linear_flops(L, D, 1000).value
    assert close(lin / 1e12, 744, 1e-3)  # "2 × 126 × 11 × 1000 × 16384² ≈ 744 TFLOPs"
    assert close(lin / 1e15, 0.74, 0.01)  # "744 ÷ 1000 ≈ 0.74 秒" at 1 PFLOP/s
    n = 10**6  # "生成单个词的耗时将达到约 2.5 小时": linear term + the full N x N attention term
    total = seeds_linear_flops(L, D, n).value + seeds_attention_flops(L, D, n, n).value
    assert close(total / 1e15 / 3600, 2.5, 0.01)
    assert seeds_linear_flops(L, D, n).value / 1e15 / 3600 < 0.25  # the linear term alone is not it


def test_ch8_prefill_at_100k():
    n = 100_000
    lin, att = seeds_params_flops(P, n).value, seeds_attention_flops(L, D, n, n).value
    assert lin == 8.1e16  # "2 × N × P = 8.1 × 10^16"
    assert close(att, 8.26e16, 1e-3)  # "4 × L × N² × d ≈ 8.26 × 10^16"
    assert close(lin + att, 1.64e17, 5e-3)  # "约 1.64 × 10^17 FLOPs"
    kv = kv_bytes(BIG, 2, n).value  # "写入 KV Cache：约 51.6 GB": the real GQA, not MHA
    assert close(kv / 1e9, 51.6, 1e-3)
    assert kv_bytes(BIG, 2, n, mha=True).value / 1e9 > 800  # MHA would be 825.8 GB
    moved = 2 * P + kv
    assert close(moved / 1e9, 861.6, 1e-3)  # "合计：约 861.6 GB"
    assert close((lin + att) / moved, 190_000, 5e-3)  # "≈ 190,000 FLOPs/Byte"


def test_ch8_decode_at_100k_and_the_ridge():
    n = 100_000
    lin, att = seeds_params_flops(P, 1).value, seeds_attention_flops(L, D, 1, n).value
    assert lin == 8.1e11  # "2 × 1 × P = 8.1 × 10^11"
    assert close(att, 8.25e11, 2e-3)  # "≈ 8.25 × 10^11" (8.2575e11, rounded down)
    assert close(lin + att, 1.635e12, 1e-3)  # "约 1.635 × 10^12 FLOPs"
    assert close((lin + att) / (2 * P + kv_bytes(BIG, 2, n).value), 1.9, 0.01)  # "≈ 1.9 FLOPs/Byte"
    assert close(SEEDS_HW.ridge_point("fp16"), 300, 0.02)  # "拐点约 300 FLOPs/Byte"
    assert close(HARDWARE["h100"].ridge_point("bf16"), 300, 0.02)  # the datasheet H100 agrees


def test_every_seeds_row_within_its_tolerance():
    rows = seeds_worked_examples()
    assert len(rows) >= 18
    for row in rows:
        assert abs(row.rel_diff) <= row.tolerance, (row.quantity, row.seed, row.ours)


def test_where_the_seeds_simplify():
    assert linear_coefficient(BIG).value == 11.875  # not 11: GQA K/V are small, SwiGLU inter = 3.25 d
    n = 100_000  # causal attention is half the seeds' full N x N (plus the diagonal)
    assert attention_flops(BIG, n, n).value == 2 * L * 128 * 128 * n * (n + 1)
    assert attention_flops(BIG, n, n, causal=False).value == seeds_attention_flops(L, D, n, n).value
    assert attention_flops(BIG, n, 1).value == seeds_attention_flops(L, D, 1, n).value  # decode: identical


# ---------------------------------------------------------------- exact counts against the configs


def test_exact_counts_from_configs():
    assert PRESETS["smollm2-135m"].num_parameters() == 134_515_008  # the real GGUF's tensor sizes
    assert PRESETS["llama-3-8b"].num_parameters() == 8_030_261_248
    assert kv_bytes_per_token(PRESETS["smollm2-135m"], 4).value == 2 * 30 * 3 * 64 * 4 == 46_080
    assert kv_bytes_per_token(PRESETS["llama-3-8b"], 2).value == 131_072
    for name, dtype, nbytes in [("smollm2-135m", torch.float32, 4), ("llama-3-8b", torch.bfloat16, 2)]:
        assert kv_bytes_per_token(PRESETS[name], nbytes).value == engine_kv_bytes_per_token(PRESETS[name], dtype)


def test_tiny_by_hand():
    cfg = PRESETS["tiny"]  # L=2 hidden=96 inter=256 H=6 Hkv=2 d=16 V=512, tied
    per_block = 96 * (6 + 4) * 16 + 96 * 96 + 96 * 512 + 256 * 96  # QKV, O, gate/up, down
    assert linear_flops(cfg, 3).value == 2 * 3 * 2 * per_block + 2 * 512 * 96  # 3 tokens, logits for 1
    assert attention_flops(cfg, 3, 3).value == 4 * 2 * 96 * (1 + 2 + 3)  # token n sees n keys


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(list(PRESETS)), n=st.integers(1, 5000))
def test_prefill_attention_is_the_sum_of_its_tokens(name, n):
    cfg = PRESETS[name]
    assert attention_flops(cfg, n, n).value == sum(attention_flops(cfg, k, 1).value for k in range(1, n + 1))


# ---------------------------------------------------------------- properties


@settings(max_examples=50, deadline=None)
@given(name=st.sampled_from(list(PRESETS)), n=st.integers(1, 10**6), extra=st.integers(1, 10**5))
def test_flops_and_kv_grow_with_context_and_gqa_never_exceeds_mha(name, n, extra):
    cfg = PRESETS[name]
    assert attention_flops(cfg, n, 1).value < attention_flops(cfg, n + extra, 1).value
    assert attention_flops(cfg, n, n).value < attention_flops(cfg, n + extra, n + extra).value
    assert kv_bytes(cfg, 2, n).value < kv_bytes(cfg, 2, n + extra).value
    assert kv_bytes(cfg, 2, n).value <= kv_bytes(cfg, 2, n, mha=True).value
    a, b = analyze(cfg, HARDWARE["h100"], n), analyze(cfg, HARDWARE["h100"], n + extra)
    assert a.prefill.flops.value < b.prefill.flops.value and a.decode.bytes.value < b.decode.bytes.value
    assert a.naive.flops.value >= a.prefill.flops.value  # the masked N x N does at least the causal work


@settings(max_examples=50, deadline=None)
@given(
    name=st.sampled_from(list(PRESETS)),
    hw=st.sampled_from(list(HARDWARE)),
    n=st.integers(1, 200_000),
    dtype=st.sampled_from(["bf16", "fp32"]),
)
def test_largest_batch_is_exactly_what_fits(name, hw, n, dtype):
    cap = analyze(PRESETS[name], HARDWARE[hw], n, dtype=dtype).capacity
    memory, weights, per_seq = HARDWARE[hw].memory_bytes, cap.weights.value, cap.kv_per_sequence.value
    batch = cap.max_batch.value
    if weights > memory:
        assert batch == 0
    else:
        assert weights + batch * per_seq <= memory < weights + (batch + 1) * per_seq
    assert cap.max_batch_mha.value <= batch


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(list(PRESETS)), n=st.integers(1, 100_000), b=st.integers(1, 256))
def test_batching_decode_raises_intensity_and_throughput(name, n, b):
    one, many = analyze(PRESETS[name], HARDWARE["h100"], n, 1), analyze(PRESETS[name], HARDWARE["h100"], n, b + 1)
    assert many.decode.intensity.value > one.decode.intensity.value  # the weights are read once for the batch
    assert many.decode_tokens_per_s.value > one.decode_tokens_per_s.value
    assert many.decode.time.value >= one.decode.time.value


def test_verdicts_of_the_seeds_example():
    a = analyze(BIG, SEEDS_HW, 100_000, dtype="fp16")
    assert a.prefill.bound == "compute-bound" and a.decode.bound == "memory-bound"
    assert a.prefill.time.value == a.prefill.compute_time.value  # TTFT: compute, ~2 min
    assert close(a.decode.time.value, 859.1e9 / 3.3e12, 1e-3)  # time per token: bytes / bandwidth
    assert a.capacity.max_batch.value == 0  # 811.7 GB of weights on one 80 GB GPU
    assert analyze(BIG, SEEDS_HW.scaled(16), 100_000).capacity.max_batch.value > 0


# ---------------------------------------------------------------- API errors and config loading


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: analyze(BIG, SEEDS_HW, 0), "context must be > 0"),
        (lambda: analyze(BIG, SEEDS_HW, 10, batch=0), "batch must be > 0"),
        (lambda: analyze(BIG, SEEDS_HW, 10, dtype="int3"), "unknown dtype 'int3'"),
        (lambda: analyze(BIG, HARDWARE["a100"], 10, dtype="fp8"), "has no fp8 math"),
        (lambda: load_model_config("no-such-model"), "unknown model 'no-such-model'"),
        (lambda: load_hardware("tpu"), "unknown hardware 'tpu'"),
        (lambda: SEEDS_HW.scaled(0), "devices must be >= 1"),
    ],
)
def test_bad_input_raises_one_line(call, message):
    with pytest.raises(StagewiseError, match=message) as info:
        call()
    assert "\n" not in str(info.value)


def test_hf_config_json_with_rope_scaling(tmp_path):
    cfg8 = PRESETS["llama-3-8b"]
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0},
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    for arg in (str(tmp_path), str(tmp_path / "config.json")):
        cfg = load_model_config(arg)
        assert cfg.num_parameters() == cfg8.num_parameters()
        assert kv_bytes_per_token(cfg, 2).value == 131_072
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(StagewiseError, match="lacks the size field"):
        load_model_config(str(tmp_path / "bad.json"))


def test_summarize_is_json_ready():
    out = summarize(PRESETS["llama-3-8b"], HARDWARE["h200"], 8192, 8, "bf16")
    text = json.dumps(out)
    assert out["kv_per_token"]["value"] == 131_072 and "2*L*Hkv*d*bytes" in out["kv_per_token"]["formula"]
    assert out["decode"]["bound"] == "memory-bound" and out["hardware"]["ridge_point"] > 100
    assert json.loads(text)["capacity"]["max_batch"]["value"] == out["capacity"]["max_batch"]["value"]


# ---------------------------------------------------------------- CLI, plots, probe

ENV = {**os.environ, "STAGEWISE_QUIET": "1", "COLUMNS": "220", "NO_COLOR": "1"}


def run_calc(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "stagewise.cli.calc", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=120)


def test_cli_tables_json_and_plots(tmp_path):
    out_json, plots = tmp_path / "calc.json", tmp_path / "plots"
    res = run_calc(
        "--model", "llama-3-8b", "--context", "8192", "--batch", "4", "--explain", "--seeds",
        "--json-out", str(out_json), "--plot", str(plots),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    for text in ("131,072 B", "compute-bound", "memory-bound", "largest batch", "2*L*Hkv*d*bytes", "8,064", "744"):
        assert text in res.stdout, text
    data = json.loads(out_json.read_text())
    expected = summarize(PRESETS["llama-3-8b"], HARDWARE["h100"], 8192, 4, "bf16")
    assert data["analysis"]["decode"]["time"] == expected["decode"]["time"]
    assert len(data["seeds"]) == len(seeds_worked_examples())
    for name in ("roofline.png", "kv_memory.png"):
        assert (plots / name).stat().st_size > 1000


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--model", "no-such-model"], "unknown model 'no-such-model'"), (["--context", "0"], "context must be > 0")],
)
def test_cli_bad_input_one_line_exit_2(args, message):
    res = run_calc(*args)
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in res.stderr


def test_plots_written_directly(tmp_path):
    from stagewise.calc.plots import RooflinePoint, plot_kv_memory, plot_roofline

    points = [RooflinePoint("decode", 1.9), RooflinePoint("prefill", 1.9e5, 5e14)]
    plot_roofline(HARDWARE["h100"], points, tmp_path / "r.png")
    configs = [PRESETS["llama-3-8b"], PRESETS["smollm2-135m"]]
    plot_kv_memory(configs, [1000, 10_000, 100_000], tmp_path / "sub" / "kv.png", hardware=HARDWARE["a100"])
    assert (tmp_path / "r.png").stat().st_size > 1000 and (tmp_path / "sub" / "kv.png").stat().st_size > 1000


def test_probe_smoke():
    hw = probe_this_machine(seconds=0.3, weight_bytes=16 * 2**20)
    assert hw.memory_bandwidth > 0 and hw.memory_bytes > 0
    assert hw.peak_flops("fp32") > 0 and hw.peak_flops("bf16") > 0 and hw.peak_flops("fp16") > 0


def test_calc_reads_a_gguf_files_sizes(tmp_path):
    """A .gguf gives its metadata's sizes (no tensor is read); a corrupt one is a one-line error."""
    from stagewise.calc.roofline import load_model_config
    from tests.checkpoints import CFG, hf_tiny_model, round_embedding_to_q8_0, write_gguf

    path = write_gguf(tmp_path / "tiny.gguf", round_embedding_to_q8_0(hf_tiny_model(seed=1)))
    config = load_model_config(str(path))
    assert config.shape_only
    sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
    assert [getattr(config, s) for s in sizes] == [getattr(CFG, s) for s in sizes]
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 20)
    with pytest.raises(StagewiseError, match="not a valid GGUF file"):
        load_model_config(str(bad))
