"""`bench serve-limits` runs end to end against a real server (quick sizes, the tiny model): the stop list
one string over the limit is refused, the watchers beyond --max-view-subscribers are refused, nothing is
lost, and the JSON and PNG land together. Its timings mean nothing here (a busy test machine)."""

import json

from typer.testing import CliRunner

from stagewise.cli.bench import bench_app
from stagewise.serve.limits import ServerLimits


def test_quick_run_measures_both_costs_and_loses_nothing(tmp_path):
    result = CliRunner().invoke(bench_app, ["serve-limits", "--quick", "--model", "tiny", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    data = json.loads((tmp_path / "serve_limits.json").read_text())
    assert (tmp_path / "serve_limits.png").stat().st_size > 0
    stops, view = data["stop_strings"], data["view"]
    assert stops["one_more_string_status"] == 400
    assert stops["stop_list"] == {"strings": 16, "characters_each": 256}
    assert [r["case"] for r in stops["runs"]] == ["alone", "beside the stop list"]
    assert all(r["stop_request_status"] == 200 for r in stops["runs"] if r["case"] != "alone")
    limit = ServerLimits().max_view_subscribers
    assert (view["accepted"], view["refused"], view["failed_to_connect"]) == (limit, 60 - limit, 0)
    runs = stops["runs"] + view["runs"]
    assert all(r["completed"] > 0 and not r["failed"] and not r["lost"] for r in runs)
    assert stops["tbt_p50_ratio"] > 0 and view["speed_ratio"] > 0 and view["server_tbt_ms_mean_watched"] > 0
    assert data["server"]["exit_code"] in (0, 143)
