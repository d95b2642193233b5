"""`bench modes --formats`: each mode once per weight format, the format in every name."""

import pytest

from stagewise.bench.commands import modes
from stagewise.errors import StagewiseError
from tests.bench.test_bench import load_result, run_cli


def test_each_mode_runs_in_each_format(tmp_path):
    """tiny quantized at load (int4: q4_1, groups of 32) beside its float32 weights."""
    args = ["--modes", "naive,kv", "--formats", "none,int4", "--prompt-tokens", "4", "--repeats", "1"]
    out = run_cli("modes", "--model", "tiny", "--out", str(tmp_path), *args, "--output-lengths", "6")
    result = load_result(tmp_path, "modes")
    names = {"naive [none]", "kv [none]", "naive [int4]", "kv [int4]"}
    assert set(result["summary"]) == names and set(result["time_per_token"]) == names
    assert result["settings"]["formats"] == ["none", "int4"] and result["outputs_identical"]
    assert result["formats"]["none"].startswith("float32") and "q4_1" in result["formats"]["int4"]
    floors = result["weight_streaming_by_format"]  # each format's own bytes per decode token
    assert floors["int4"]["decode_bytes"] < floors["none"]["decode_bytes"] / 3  # 0.625 vs 4 B/weight
    s = result["summary"]["kv [int4]"]["6"]
    assert s["tbt_over_streaming"] == pytest.approx(s["tbt_ms"] / floors["int4"]["ms"])
    assert set(result["token_ids"]) == {"6 [none]", "6 [int4]"}  # compared within a format
    assert "kv [int4]" in out.output and "[int4] weights: q" in out.output


def test_without_formats_the_names_are_as_before():
    settings = modes.ModesSettings(model="tiny")
    assert list(modes.engine_systems(settings)) == ["naive", "kv", "paged"]
    assert "formats" not in modes.settings_dict(settings)  # earlier result files still match


@pytest.mark.parametrize(
    "formats, message",
    [(("none", "int3"), "unknown quantization 'int3'"), (("auto", "auto"), "names a format twice")],
)
def test_bad_formats_are_one_line_errors(formats, message):
    with pytest.raises(StagewiseError, match=message):
        modes.check_settings(modes.ModesSettings(model="tiny", formats=formats))
