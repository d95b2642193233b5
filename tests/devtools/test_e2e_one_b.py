"""The e2e section's 1B-class row (devtools/e2e_device.py) on the CPU: Llama-3.2-1B's shapes and the
weight-streaming floor they give, the section's plan (the row between the 8B and SmolLM2 models, the
tiny model in its place in the dry run), the row itself at tiny size, and the report's line for it."""

import torch

from stagewise.config import PRESETS
from stagewise.devtools.device_report import render_markdown
from stagewise.devtools.e2e_device import ONE_B, ONE_B_TARGET, e2e_models, one_b_decode
from stagewise.models.registry import load_model


def test_the_1b_row_has_llama_3_2_1b_shapes_and_their_floor():
    c = PRESETS[ONE_B.removeprefix("random:")]
    shapes = (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.vocab_size)
    assert shapes == (2048, 16, 32, 8, 64, 8192, 128256) and c.tie_word_embeddings
    # by hand, bf16: per layer two norms 2 x 2048, qkv 2048 x (2048 + 2 x 512), o 2048 x 2048, gate_up
    # 2048 x 2 x 8192, down 8192 x 2048; then the LM head (the tied table) 128256 x 2048, the final
    # norm and one embedding row 2048 each
    layer = 2 * 2048 + 2048 * 3072 + 2048 * 2048 + 2048 * 16384 + 8192 * 2048
    by_hand = 2 * (16 * layer + 128256 * 2048 + 2048 + 2048)
    assert by_hand == 2_471_632_896
    assert load_model(ONE_B.removeprefix("random:"), "meta", torch.bfloat16).weights.decode_bytes() == by_hand
    # on an H200 (4,067 GB/s measured copy bandwidth) the floor is 0.61 ms; 70% of it is 0.87 ms a token
    assert round(by_hand / 4067e9 * 1e3, 2) == 0.61 and round(by_hand / 4067e9 * 1e3 / ONE_B_TARGET, 2) == 0.87


def test_the_plan_runs_the_1b_model_on_a_gpu_and_the_tiny_one_in_the_dry_run():
    assert e2e_models(dry_run=False) == {"big": "random:llama-3-8b", "one_b": ONE_B, "small": "random:smollm2-135m"}
    assert set(e2e_models(dry_run=True).values()) == {"random:tiny"}


def test_the_1b_row_at_tiny_size_meets_or_misses_its_target_and_renders():
    loaded = load_model("random:tiny", "cpu", None)
    row = one_b_decode("random:tiny", False, "cpu", 3, 10.0, loaded)
    assert row["row"] == "1B-class" and row["backend"] == "triton" and row["cuda_graphs"] is False
    assert row["new_tokens"] == 3 and row["ms_per_token_p50"] > 0
    assert row["streaming_floor_ms"] == row["weight_bytes"] / 10e9 * 1e3
    assert row["share_of_streaming_limit"] == row["streaming_floor_ms"] / row["ms_per_token_p50"]
    gbs = row["weights_gb_per_s"]
    assert abs(gbs / 10.0 - row["share_of_streaming_limit"]) < 1e-9  # GB/s of weights over the copy GB/s
    assert row["passed"] is (row["share_of_streaming_limit"] >= 0.7) and "70% of HBM bandwidth" in row["target"]
    md = render_markdown({"dry_run": True, "sections": {"e2e": {"decode": [row], "wall_s": 9, "limit_s": 140}}})
    assert "| random:tiny (1B-class) | triton | float32 |" in md, md
    share = f"{100 * row['share_of_streaming_limit']:.0f}%"
    assert f"- 1B-class row (random:tiny, float32): {row['ms_per_token_p50']:.2f} ms/token" in md
    assert f"**{share}** of the copy bandwidth (target share_of_streaming_limit >= 0.7" in md
    assert f"met: {'yes' if row['passed'] else 'no'})" in md
