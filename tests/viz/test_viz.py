"""Figures of stagewise.viz drawn from small hand-made data: bars land where the data says.

The notebooks pass the real numbers; drawn with the Agg backend and closed.
"""

import matplotlib
import pytest

from stagewise import viz

matplotlib.use("Agg")


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


def test_kv_per_token_writes_the_group_size_over_each_gqa_bar():
    ax = viz.kv_per_token([("small", 18_000, 6_000, 3), ("big", 4_000_000, 250_000, 16)]).axes[0]
    assert [p.get_height() for p in ax.patches] == [18.0, 4000.0, 6.0, 250.0]  # kB: MHA bars, then GQA
    assert [t.get_text() for t in ax.texts] == ["/3", "/16"]
    assert ax.get_yscale() == "log"


def test_per_rank_times_centres_the_kind_labels_between_the_ranks():
    ax = viz.per_rank_times(["all_reduce", "ffn"], {0: [1.0, 2.0], 1: [3.0, 4.0]}, "ranks").axes[0]
    assert [p.get_width() for p in ax.patches] == [1.0, 2.0, 3.0, 4.0]
    assert list(ax.get_yticks()) == pytest.approx([0.2, 1.2])
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["rank 0", "rank 1"]


def test_stacked_rows_start_each_part_where_the_last_ended():
    ax = viz.stacked_rows(["a", "b"], [("shard", [2.0, 3.0]), ("comm", [0.5, 1.0])], "ms", "tp").axes[0]
    assert [(p.get_x(), p.get_width()) for p in ax.patches] == [(0, 2.0), (0, 3.0), (2.0, 0.5), (3.0, 1.0)]
