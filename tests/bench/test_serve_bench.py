"""`bench serve`: the Poisson arrivals, the client's bookkeeping, and one quick run against real servers.

The end-to-end test starts `stagewise serve` twice (paged, then kv) as child processes on free
loopback ports, exactly as a user's run does; nothing is mocked.
"""

import json
import math
import statistics

import pytest
from typer.testing import CliRunner

from stagewise.bench.commands.serve_client import (
    RequestResult,
    arrival_offsets,
    inter_arrival_times,
    parse_rates,
    summarize_results,
)
from stagewise.cli.bench import bench_app
from stagewise.errors import StagewiseError


def test_poisson_gaps_have_mean_and_variance_of_the_rate():
    """Exp(rate) gaps: mean 1/rate, variance 1/rate^2. With 20000 seeded draws the sample mean's
    standard error is 0.7% of it and the sample variance's about 2%: tolerances 2% and 6% (~3 sigma)."""
    for rate in (0.5, 2.0, 8.0):
        gaps = inter_arrival_times(20000, rate, seed=1)
        assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.02)
        assert statistics.pvariance(gaps) == pytest.approx(1 / rate**2, rel=0.06)
        assert min(gaps) >= 0
    assert inter_arrival_times(50, 2.0, seed=3) == inter_arrival_times(50, 2.0, seed=3)
    assert inter_arrival_times(50, 2.0, seed=3) != inter_arrival_times(50, 2.0, seed=4)
    assert inter_arrival_times(7, math.inf, seed=0) == [0.0] * 7
    assert arrival_offsets([0.5, 0.25, 1.0]) == [0.0, 0.5, 0.75]
    assert arrival_offsets(inter_arrival_times(4, math.inf, seed=0)) == [0.0] * 4


def test_rates_parse_and_bad_rates_are_one_line():
    assert parse_rates("0.5, 1,2,INF") == ("0.5", "1", "2", "inf")
    for bad in ("0", "-1", "fast", "nan", ","):
        with pytest.raises(StagewiseError, match="--request-rates"):
            parse_rates(bad)
    with pytest.raises(StagewiseError, match="rate must be > 0"):
        inter_arrival_times(3, 0.0, seed=0)


def test_summary_counts_failed_and_lost_and_times_only_complete_requests():
    done = RequestResult(0, 10, 3, sent=0.0, chunk_times=[0.1, 0.2, 0.4], completion_tokens=3, done=True, end=0.5)
    done.finish_reason = "length"
    short = RequestResult(1, 10, 3, sent=0.0, chunk_times=[5.0], completion_tokens=1, done=True, end=5.0)
    cut = RequestResult(2, 10, 3, sent=0.0, chunk_times=[0.3], end=0.3)  # no [DONE]
    refused = RequestResult(3, 10, 3, sent=0.0, error="HTTP 503: queue full", end=0.01)
    s = summarize_results([done, short, cut, refused], start=0.0)
    assert (s["completed"], s["failed"], s["lost"]) == (1, 1, 2)
    assert s["ttft_ms_p50"] == pytest.approx(100) and s["tbt_ms_p99"] == pytest.approx(200, rel=0.01)
    assert s["latency_ms_p50"] == pytest.approx(500) and s["output_tokens"] == 3
    assert s["wall_s"] == pytest.approx(5.0) and s["request_throughput"] == pytest.approx(0.2)
    no_usage = RequestResult(4, 10, 3, chunk_times=[0.1, 0.2], done=True, end=0.3)  # 2 chunks, 3 tokens
    no_usage.finish_reason = "length"
    assert not no_usage.lost  # without a usage count, a chunk may carry several tokens
    assert done.row(0.0)["tbt_ms"] == [100.0, 200.0]


def test_quick_run_against_real_servers_loses_nothing(tmp_path):
    result = CliRunner().invoke(bench_app, ["serve", "--quick", "--model", "tiny", "--out", str(tmp_path)])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    assert result.exit_code == 0, result.output
    assert "a batch is formed from the requests waiting when it starts" in " ".join(result.output.split())
    png = tmp_path / "serve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    data = json.loads((tmp_path / "serve.json").read_text())
    assert set(data["summary"]) == {"continuous", "static"}
    assert [(r["mode"], r["rate"]) for r in data["runs"]] == [
        ("paged", "8"),
        ("paged", "inf"),
        ("kv", "8"),
        ("kv", "inf"),
    ]
    for run in data["runs"]:
        s = run["summary"]
        assert (s["failed"], s["lost"], s["completed"]) == (0, 0, 6), run["errors"]
        assert s["usage_reported"] and s["output_tokens"] == sum(data["workload"]["max_tokens"])
        assert all(r["tokens"] == r["max_tokens"] and r["finish_reason"] == "length" for r in run["requests"])
        assert 0 < s["ttft_ms_p50"] <= s["ttft_ms_p99"] and s["output_tok_per_s"] > 0
    made = 2 * sum(data["workload"]["max_tokens"]) + 2 * 4  # two rates, and the two warm-up requests
    for server in data["servers"].values():
        assert server["exit_code"] in (0, 143) and server["command"][:3] == ["-m", "stagewise.cli", "serve"]
        assert server["metrics"]["generation_tokens"] == made  # the server's own count agrees
    paged = data["servers"]["paged"]["metrics"]
    assert paged["prefix_cache_queries"] > 0 and paged["prefix_cache_hits"] == 0  # the tags: no block shared


def test_a_server_that_cannot_start_is_one_line(tmp_path):
    args = ["serve", "--quick", "--model", "tiny", "--modes", "paged", "--out", str(tmp_path)]
    result = CliRunner().invoke(bench_app, [*args, "--server-arg", "--no-such-option"])
    assert isinstance(result.exception, StagewiseError)
    assert "the server exited with status 2 before it was ready" in str(result.exception)
    assert "\n" not in str(result.exception) and not (tmp_path / "serve.json").exists()
