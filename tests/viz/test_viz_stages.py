"""The notebooks' figures (stagewise.viz.stages) draw what they are given: bars, lines, labels from the data.

Small hand-made inputs (the notebooks pass the real ones); the figures are drawn with the Agg
backend and closed.
"""

import matplotlib
import numpy as np
import pytest
import torch

from stagewise.viz import stages as viz_stages

matplotlib.use("Agg")


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


def _ticks(ax, axis="x"):
    return [t.get_text() for t in (ax.get_xticklabels() if axis == "x" else ax.get_yticklabels())]


def test_tokenizer_pictures_bars_follow_the_merges_and_ratios():
    merges = [(("Ġ", "t"), 7), (("o", "n"), 3), (("Ġto", "ken"), 4000)]
    fig = viz_stages.tokenizer_pictures(merges, [1, 1, 2, 1, 4], {"prose": 4.5, "digits": 1.0})
    left, middle, right = fig.axes
    assert [p.get_width() for p in left.patches] == [8, 4, 4001]  # rank + 1, in firing order
    assert _ticks(left, "y") == ["Ġ + t", "o + n", "Ġto + ken"]
    assert sum(p.get_height() for p in middle.patches) == 5  # every piece counted once
    assert middle.get_title() == "5 pieces of the docstring corpus"
    assert [p.get_height() for p in right.patches] == [4.5, 1.0]
    assert [t.get_text() for t in right.texts] == ["4.50", "1.00"]


def test_rms_before_after_places_the_final_norm_at_the_layer_count():
    before = torch.rand(7, 4) + 1  # 3 layers x 2 norms + the final norm, 4 tokens
    fig = viz_stages.rms_before_after(before, torch.ones(7, 4), ["a", "b", "c", "d"])
    left, right = fig.axes[:2]
    assert left.get_xlabel() == "layer (two norms per layer; 3 = the final norm)"
    assert len(left.lines) == 4
    np.testing.assert_allclose(left.lines[1].get_ydata(), before[:, 0].numpy())  # token 0, residual stream
    assert _ticks(right, "y") == ["a", "b", "c", "d"]
    assert right.images[0].get_extent() == [-0.25, 3.25, 3.5, -0.5]


def test_rope_pictures_label_the_cache_columns_from_the_rotary_dim():
    angles = torch.arange(5, dtype=torch.float32)
    pair = torch.stack([angles.cos(), angles.sin()], dim=1)  # [5, 2]
    fig = viz_stages.rope_pictures([(pair, "pair 0", "tab:blue")], torch.eye(5), torch.zeros(600, 8), 8)
    left, middle, right = fig.axes[:3]
    assert left.get_title() == "a unit pair at positions 0..4 (labels: 0-3)"
    assert [t.get_text() for t in left.texts] == ["0", "1", "2", "3"]
    assert _ticks(right) == ["cos f_0", "cos f_2", "sin f_0", "sin f_2"]
    assert right.images[0].get_array().shape == (512, 8)  # the first 512 positions only
    assert middle.get_xlabel() == "key position n"
    assert viz_stages.rope_scores(torch.eye(3), "theta = 100").axes[0].get_title() == "theta = 100"


def test_ffn_pictures_stack_the_shares_to_100_percent():
    shares = [
        {"QKV": 0.1, "O": 0.05, "attention": 0.05, "FFN": 0.8},
        {"QKV": 0.1, "O": 0.1, "attention": 0.4, "FFN": 0.4},
    ]
    fig = viz_stages.ffn_pictures(np.linspace(-5, 3, 50), [128, 8192], shares, shares, layer=10)
    left, middle = fig.axes[0], fig.axes[1]
    assert left.get_title() == "SiLU vs ReLU (grey: real gates, layer 10)"
    silu = left.lines[1]
    g, y = silu.get_xdata(), silu.get_ydata()
    np.testing.assert_allclose(y, torch.nn.functional.silu(torch.from_numpy(g)).numpy(), rtol=1e-6)
    tops = {}
    for bar in middle.patches:
        column = round(bar.get_x() + bar.get_width() / 2)
        tops[column] = max(tops.get(column, 0), bar.get_y() + bar.get_height())
    assert tops == pytest.approx({0: 100.0, 1: 100.0})
    assert sorted(t.get_text() for t in middle.texts) == ["10%", "10%", "10%", "40%", "40%", "80%"]


def test_sampling_panels_hatch_seen_tokens_and_count_the_kept_ones():
    fig = viz_stages.sampling_panels(
        penalty=(["a", "b"], [True, False], {"T=1": torch.tensor([0.6, 0.4]), "penalty": torch.tensor([0.3, 0.7])}),
        temperatures={"T=0.5": torch.tensor([0.9, 0.1])},
        filters=(["a", "b"], torch.tensor([0.6, 0.4]), {"top_k=1": (torch.tensor([1.0, 0.0]), 1)}),
        draw=(["a"], torch.tensor([1.0]), [1.0], 10),
    )
    pen, temp, filt, draw = fig.axes
    assert [bar.get_hatch() for bar in pen.patches] == ["//", None, "//", None]
    assert {t.get_text() for t in filt.get_legend().get_texts()} == {"before (T=1)", "top_k=1: 1 kept"}
    assert np.isnan(filt.lines[0].get_ydata()[1])  # a filtered-out token draws no dot
    assert draw.get_legend().get_texts()[1].get_text() == "frequency in 10 seeded draws"
    assert list(temp.lines[0].get_xdata()) == [1, 2]  # ranks start at 1


def test_bars_vertical_and_horizontal_log():
    ax = viz_stages.bars({"fp32": 4.0, "q4_0": 1.0}, "floors", ylabel="ms").axes[0]
    assert [p.get_height() for p in ax.patches] == [4.0, 1.0]
    assert (ax.get_yscale(), ax.get_ylabel(), ax.get_title()) == ("linear", "ms", "floors")
    ax = viz_stages.bars({"naive": 30.0, "torch": 2.0}, "calls", horizontal=True, log=True).axes[0]
    assert [p.get_width() for p in ax.patches] == [30.0, 2.0]
    assert ax.get_xscale() == "log"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["naive", "torch"]


def test_q4_1_code_bytes_writes_both_nibbles_of_each_byte():
    codes = np.array([0x3A] + [0] * 15, dtype=np.uint8)  # high nibble 3 (code 16), low nibble 10 (code 0)
    ax = viz_stages.q4_1_code_bytes(codes).axes[0]
    bits = ax.images[0].get_array()  # [8 bits, 16 bytes], most significant bit on top
    assert list(bits[:, 0]) == [0, 0, 1, 1, 1, 0, 1, 0]
    assert [t.get_text() for t in ax.texts[:2]] == ["3", "10"]


def test_block_weights_levels_are_m_and_m_plus_15_d():
    ax = viz_stages.block_weights(np.linspace(-1, 0.5, 32), m=-1.0, d=0.1).axes[0]
    assert [line.get_ydata()[0] for line in ax.lines] == pytest.approx([-1.0, 0.5])
    assert len(ax.patches) == 32


def test_step_cost_and_speculation_gain_plot_the_given_numbers():
    ax = viz_stages.step_cost([1, 2, 5], {1: 10.0, 2: 11.0, 5: 15.0}, "cost").axes[0]
    measured, linear = ax.lines
    assert list(measured.get_ydata()) == [10.0, 11.0, 15.0]
    assert list(linear.get_ydata()) == [10.0, 20.0, 50.0]  # n decode steps
    left, right = viz_stages.speculation_gain({0.5: [1.0, 1.5, 1.75]}, {0.5: ([1, 4], [1.2, 0.9])}).axes
    assert list(left.lines[0].get_xdata()) == [0, 1, 2]
    assert list(right.lines[0].get_ydata()) == [1.2, 0.9]
    assert list(right.lines[1].get_ydata()) == [1.0, 1.0]  # the break-even line: above it speculation wins


def test_side_by_side_centres_each_group_on_its_position():
    groups = [("q", [0.1, 0.2], "tab:orange"), ("p", [0.3, 0.4], "tab:blue")]
    ax = viz_stages.side_by_side(groups, "token", "prob").axes[0]
    centres = [p.get_x() + p.get_width() / 2 for p in ax.patches]
    assert centres == pytest.approx([-0.2025, 0.7975, 0.2025, 1.2025])
    assert [p.get_height() for p in ax.patches] == pytest.approx([0.1, 0.2, 0.3, 0.4])
