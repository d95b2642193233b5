"""The e2e section's 4-bit row (devtools/e2e_device.py) on the CPU: the packed model, its decode
row beside the 16-bit one, and the report's line for it."""

from stagewise.devtools.device_report import render_markdown
from stagewise.devtools.e2e_device import BF16_COMMITTED_MS, Q4_KIND, packed_model, q4_decode
from stagewise.models.registry import load_model
from stagewise.quant.packed_weight import is_packed


def test_packed_model_packs_every_projection_and_shares_the_rest():
    loaded = load_model("random:tiny", "cpu", None)
    q4 = packed_model(loaded)
    w, w16 = q4.weights, loaded.weights
    for lw, lw16 in zip(w.layers, w16.layers):
        for name in ("w_qkv", "w_o", "w_gate_up", "w_down"):
            packed = getattr(lw, name)
            assert is_packed(packed) and packed.kind == Q4_KIND and packed.shape == tuple(getattr(lw16, name).shape)
        assert lw.attn_norm is lw16.attn_norm and lw.ffn_norm is lw16.ffn_norm
    assert is_packed(w.lm_head) and w.lm_head.shape == tuple(w16.lm_head.shape) and w.embed is w16.embed
    assert w.decode_bytes() < w16.decode_bytes() / 4  # float32 here: 4 bytes a weight against 0.5625
    assert q4.dtype == loaded.dtype and "q4_0" in q4.source


def test_q4_row_sits_beside_the_16_bit_row_and_renders():
    loaded = load_model("random:tiny", "cpu", None)
    bf16 = {"model": "random:tiny", "backend": "triton", "cuda_graphs": False, "ms_per_token_p50": 100.0}
    row = q4_decode("random:tiny", False, "cpu", 3, 10.0, loaded, [bf16])
    assert row["weights"] == Q4_KIND and row["ms_per_token_p50"] > 0
    assert row["vs_bf16"] == 100.0 / row["ms_per_token_p50"]
    assert row["vs_committed_bf16"] == BF16_COMMITTED_MS / row["ms_per_token_p50"] and row["passed"] is False
    assert row["streaming_floor_ms"] == row["weight_bytes"] / 10e9 * 1e3
    bf16_row = {**row, "weights": None, "dtype": "float32"}
    md = render_markdown(
        {"dry_run": True, "sections": {"e2e": {"decode": [bf16_row, row], "wall_s": 9, "limit_s": 200}}}
    )
    assert "| random:tiny | triton | float32, q4_0 weights |" in md and "| random:tiny | triton | float32 |" in md
    assert f"- q4_0 weights (random codes): {row['ms_per_token_p50']:.2f} ms/token, {row['vs_bf16']:.2f}x" in md
    assert "the committed bf16 figure (target vs_committed_bf16 >= 1.8" in md and "met: no" in md
