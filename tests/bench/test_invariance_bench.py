"""`stagewise bench invariance` (bench/commands/invariance.py): both rows, the cost row, the plot; a smoke
run on `tiny` (the numbers are the quiet machine's business, not the test's)."""

from stagewise.bench.commands.invariance import InvarianceSettings, plot_invariance, run_invariance, table_rows


def test_the_benchmark_runs_both_rows_and_prints_the_cost(tmp_path):
    settings = InvarianceSettings(
        model="tiny", formats=("none",), repeats=2, decode_tokens=4, ttft_prompts=(16,), batching=False, spec=False
    )
    result = run_invariance(settings)
    single = result["results"]["none"]["single_stream"]
    assert set(single) == {"invariant", "variant"}
    for row in single.values():
        assert set(row) == {"decode", "ttft_16"}
        assert all(0 < v["min"] <= v["median"] <= v["max"] for v in row.values())
    heads, rows = table_rows(result)
    assert heads == ["weights", "row", "decode tok/s", "TTFT ms @16"]
    assert [r[1] for r in rows] == ["invariant", "variant", "invariant / variant"]
    assert rows[2][2].endswith("x")
    plot_invariance(result, tmp_path / "invariance.png")
    assert (tmp_path / "invariance.png").stat().st_size > 0
