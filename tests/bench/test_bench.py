"""The benchmarks: smoke runs on the tiny model, the identical-outputs guards, workloads, harness arithmetic.

No timing assertions here: speed claims live in the benchmark results, never in tests.
"""

import json
import random

import pytest
import torch
from typer.testing import CliRunner

from stagewise.bench.commands import batching, modes
from stagewise.bench.harness.hf_baseline import static_padding
from stagewise.bench.harness.machine import machine_info, machine_tag
from stagewise.bench.harness.timing import StreamedRequest, Timing, alternating, compare, summarize
from stagewise.bench.harness.workloads import count_tokens, mixed_workload, prompt_with_tokens, single_prompt
from stagewise.cli.bench import bench_app
from stagewise.errors import StagewiseError
from stagewise.tokenizer.vocabulary import Tokenizer
from stagewise.tuning import cpu_load

COMMON_KEYS = {"benchmark", "machine", "settings", "summary"}
SMALL = ["--num-requests", "4", "--prompt-tokens", "16-40", "--output-tokens", "4-12", "--max-num-seqs", "2"]
SMALL_SETTINGS = {"num_requests": 4, "prompt_tokens": (16, 40), "output_tokens": (4, 12), "max_num_seqs": 2}


def run_cli(*args: str):
    result = CliRunner().invoke(bench_app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    assert result.exit_code == 0, result.output
    return result


def load_result(tmp_path, name: str) -> dict:
    png = tmp_path / f"{name}.png"
    assert png.exists() and png.stat().st_size > 1000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return json.loads((tmp_path / f"{name}.json").read_text())


# ---- workloads ---------------------------------------------------------------------------------


def test_workload_is_deterministic_and_hits_token_lengths():
    tok = Tokenizer.tiny()
    a = mixed_workload(tok, num_requests=12, prompt_tokens=(16, 200), output_tokens=(4, 40), seed=3)
    b = mixed_workload(tok, num_requests=12, prompt_tokens=(16, 200), output_tokens=(4, 40), seed=3)
    assert a == b
    assert a != mixed_workload(tok, num_requests=12, prompt_tokens=(16, 200), output_tokens=(4, 40), seed=4)
    for r in a.requests:
        assert count_tokens(tok, r.prompt) == r.prompt_tokens and 16 <= r.prompt_tokens <= 200
        assert 4 <= r.max_tokens <= 40
        assert r.params().ignore_eos and r.params().greedy and r.params().max_tokens == r.max_tokens
    assert len({r.prompt[:40] for r in a.requests}) == len(a.requests)  # no shared prompt starts
    for n in (2, 3, 17, 64, 333):
        assert count_tokens(tok, prompt_with_tokens(tok, n, random.Random(n))) == n
    assert count_tokens(tok, single_prompt(tok, 32)) == 32


def test_workload_rejects_bad_ranges():
    with pytest.raises(StagewiseError, match="prompt tokens"):
        mixed_workload(Tokenizer.tiny(), prompt_tokens=(50, 10))
    with pytest.raises(StagewiseError, match="at least one request"):
        mixed_workload(Tokenizer.tiny(), num_requests=0)


# ---- timing harness ----------------------------------------------------------------------------


def test_summary_percentiles_on_known_inputs():
    s = summarize([10, 1, 9, 2, 8, 3, 7, 4, 6, 5])
    assert s["median"] == 5.5 and s["min"] == 1 and s["max"] == 10 and s["n"] == 10
    assert s["p10"] == pytest.approx(1.9) and s["p90"] == pytest.approx(9.1)
    t = Timing((3.0, 1.0, 2.0))
    assert (t.median_ms, t.p10_ms, t.p90_ms) == (2.0, pytest.approx(1.2), pytest.approx(2.8))
    assert summarize([])["median"] is None


def test_compare_alternates_variants_after_warmup():
    calls = []
    variants = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    timings = compare(variants, repeats=3, warmup=1)
    assert calls == ["a", "b"] * 4  # one warm-up round, then A B A B A B
    assert [len(t.samples_ms) for t in timings.values()] == [3, 3]
    assert list(alternating(["x", "y"], 2)) == [(0, "x"), (0, "y"), (1, "x"), (1, "y")]


def test_streamed_request_metrics_use_the_engine_formulas():
    r = StreamedRequest(arrival_time=10.0, token_ids=[1, 2, 3], token_times=[10.5, 10.7, 11.0])
    m = r.metrics()
    assert m.ttft == pytest.approx(0.5) and m.latency == pytest.approx(1.0)
    assert m.tbt == pytest.approx((0.2, 0.3)) and m.tokens_per_s == pytest.approx(3.0)


def test_cost_fit_recovers_known_coefficients():
    n = list(range(10, 300, 7))
    fit = modes.fit_cost(n, [2 + 0.01 * x + 1e-4 * x * x for x in n], (0, 1, 2))
    assert fit["coef_ms"] == pytest.approx([2, 0.01, 1e-4], rel=1e-6) and fit["r2"] == pytest.approx(1.0)
    flat = modes.fit_cost(n, [5 - 0.001 * x for x in n], (0, 1))  # a negative slope is not a cost
    assert min(flat["coef_ms"]) >= 0


def test_a_busy_machine_is_said_beside_the_numbers(monkeypatch):
    from stagewise.bench.harness.machine import busy_note

    monkeypatch.delenv("STAGEWISE_BUSY_SHARE", raising=False)  # the default share (the suite sets its own)
    assert busy_note(None, "x") is None and busy_note(0.1, "x") is None  # unknown, or quiet (default 25%)
    note = busy_note(0.62, "the modes")
    assert note.startswith("the machine was busy: other processes used 62% of the CPU while the modes ran")


def test_machine_info_and_tag():
    info = machine_info()
    for key in ("cpu", "logical_cores", "torch_threads", "ram_GB", "gpu", "torch", "python", "stagewise", "date"):
        assert key in info
    json.dumps(info)
    tag = machine_tag(info)
    assert tag and all(c.isalnum() or c == "-" for c in tag)


# ---- modes -------------------------------------------------------------------------------------


BUSY = "the machine was busy: other processes used "


def test_bench_modes_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv("STAGEWISE_BUSY_SHARE", "-1")  # any share of the CPU used by others counts as busy
    monkeypatch.setattr(cpu_load, "MIN_TICKS", 1)  # a fast machine runs it in few ticks
    args = ["--prompt-tokens", "8", "--output-lengths", "4,12", "--repeats", "2"]
    printed = run_cli("modes", "--model", "tiny", "--out", str(tmp_path), *args).output
    result = load_result(tmp_path, "modes")
    assert 0 <= result["cpu_others_share"] <= 1  # the load probe around the timed runs
    assert any(n.startswith(BUSY) for n in result["notes"]) and BUSY in " ".join(printed.split())
    for by_length in result["summary"].values():  # TPS is 1 / the TBT beside it: the same statistic
        for s in by_length.values():
            assert s["tps"] == pytest.approx(1000 / s["tbt_ms"])
    assert COMMON_KEYS | {"runs", "time_per_token", "fits", "token_ids", "outputs_identical"} <= set(result)
    assert result["benchmark"] == "modes" and result["outputs_identical"]
    assert set(result["summary"]) == {"naive", "kv", "paged"}
    assert len(result["runs"]) == 3 * 2 * 2  # modes x lengths x repeats
    assert all(len(r["tbt_ms"]) == r["output_tokens"] - 1 for r in result["runs"])
    curve = result["time_per_token"]["naive"]
    assert curve["context_len"] == list(range(9, 9 + 11))
    assert len(result["fits"]["naive"]["coef_ms"]) == 3 and len(result["fits"]["kv"]["coef_ms"]) == 2
    stream = result["weight_streaming"]  # the floor of a decode token, from a plain read far beyond the cache
    assert stream["decode_bytes"] > 0 and stream["read_GBps"] > 0
    assert stream["ms"] == pytest.approx(stream["decode_bytes"] / stream["read_GBps"] / 1e6)
    for mode in ("kv", "paged"):
        s = result["summary"][mode]["12"]
        assert s["tbt_over_streaming"] == pytest.approx(s["tbt_ms"] / stream["ms"])
        parts = result["overhead"][mode]  # a traced decode step, split by stage
        assert parts["steps"] >= 1 and set(parts["stages_ms"]) >= {"qkv_proj", "ffn", "rmsnorm", "lm_head"}
        assert parts["projections_ms"] + parts["other_stages_ms"] == pytest.approx(sum(parts["stages_ms"].values()))
    assert "paged_attention" in result["overhead"]["paged"]["stages_ms"]
    assert "attention" in result["overhead"]["kv"]["stages_ms"]


def test_bench_modes_runs_the_shortest_output_length(tmp_path):
    """2 tokens pass the check (one time between tokens); the 4-token warm-up once overflowed an engine sized for 2."""
    args = ["--modes", "kv", "--prompt-tokens", "4", "--output-lengths", "2", "--repeats", "1"]
    result = run_cli("modes", "--model", "tiny", "--out", str(tmp_path), *args)
    data = load_result(tmp_path, "modes")
    assert data["summary"]["kv"]["2"]["tbt_ms"] > 0
    assert "decode step, traced" not in result.output  # too short for a traced decode step: no empty table


def test_modes_guard_refuses_different_outputs(monkeypatch):
    real = modes.stream_timed

    def tampered(llm, prompts, params, on_event=None):
        reqs = real(llm, prompts, params, on_event)
        if llm.mode == "paged" and params[0].max_tokens > 4:  # the warm-up passes, the measured run differs
            reqs[0].token_ids[-1] += 1
        return reqs

    monkeypatch.setattr(modes, "stream_timed", tampered)
    settings = modes.ModesSettings(model="tiny", prompt_tokens=8, output_lengths=(6,), repeats=1)
    with pytest.raises(StagewiseError, match="'paged \\(run 1\\)' produced different tokens.*output token 5"):
        modes.run_modes(settings)


# ---- batching ----------------------------------------------------------------------------------


def test_bench_batching_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv("STAGEWISE_BUSY_SHARE", "-1")  # any share of the CPU used by others counts as busy
    monkeypatch.setattr(cpu_load, "MIN_TICKS", 1)  # a fast machine runs it in few ticks
    run_cli("batching", "--model", "tiny", *SMALL, "--out", str(tmp_path))
    result = load_result(tmp_path, "batching")
    assert 0 <= result["cpu_others_share"] <= 1 and any(n.startswith(BUSY) for n in result["notes"])
    assert COMMON_KEYS | {"runs", "workload", "token_ids", "outputs_identical", "engine_config"} <= set(result)
    assert set(result["summary"]) == {"static", "continuous"}
    static, cont = result["summary"]["static"], result["summary"]["continuous"]
    expected = result["static_padding_expected"]
    assert static["padding_tokens"] == expected["prompt_padding_tokens"] + expected["output_padding_tokens"]
    assert cont["padding_tokens"] == 0 and cont["preemptions"] == 0
    useful = result["workload"]["total_output_tokens"]
    for s in (static, cont):
        assert s["output_tokens"] == useful
        for key in ("output_tok_per_s", "requests_per_s", "ttft_ms_p99", "tbt_ms_p50", "latency_ms_p99"):
            assert s[key] > 0
        assert s["tbt_p99_over_p50"] == pytest.approx(s["tbt_ms_p99"] / s["tbt_ms_p50"])
    assert result["engine_config"]["prefill_beside_decodes"] is None  # the device default
    for run in result["runs"]:
        assert len(run["requests"]) == result["workload"]["num_requests"]
        assert len(run["kv"]["time_s"]) == len(run["kv"]["bytes"]) > 1
        for req in run["requests"]:  # the TBT-over-time panel: one time per token, gaps between them
            times = req["token_times_s"]
            assert len(times) == req["output_tokens"] and times == sorted(times) and times[0] >= 0
            gaps = [1000 * (b - a) for a, b in zip(times, times[1:])]
            assert req["tbt_ms"] == pytest.approx(gaps, abs=0.005)  # both rounded: times to 1 us, gaps to 1 us
        gap_times, gaps = batching.tbt_timeline(run)
        assert len(gap_times) == len(gaps) == sum(len(r["tbt_ms"]) for r in run["requests"])


def test_batching_guard_refuses_different_outputs(monkeypatch):
    real = batching.stream_timed

    def tampered(llm, prompts, params, on_event=None):
        reqs = real(llm, prompts, params, on_event)
        if llm.mode == "paged" and len(prompts) > 2:  # not the warm-up
            reqs[1].token_ids[0] += 1
        return reqs

    monkeypatch.setattr(batching, "stream_timed", tampered)
    settings = batching.BatchingSettings(model="tiny", **SMALL_SETTINGS)
    with pytest.raises(StagewiseError, match="request 1: 'continuous \\(run 1\\)' produced different tokens"):
        batching.run_batching(settings)


def test_static_padding_by_hand():
    # batch of 2: prompts 3 and 5 tokens -> 2 pad tokens; outputs 2 and 4 -> the first row makes 2 extra
    assert static_padding([3, 5], [2, 4], 2) == {"prompt_padding_tokens": 2, "output_padding_tokens": 2}
    # batches of 1 never pad
    assert static_padding([3, 5], [2, 4], 1) == {"prompt_padding_tokens": 0, "output_padding_tokens": 0}


@pytest.mark.oracle
def test_transformers_baseline_pads_and_times_a_two_request_case(tmp_path):
    from stagewise.bench.harness.hf_baseline import HFBaseline
    from tests.checkpoints import hf_tiny_model, write_hf_dir

    path = write_hf_dir(tmp_path / "hf", hf_tiny_model())
    hf = HFBaseline(str(path), torch.device("cpu"), torch.float32)
    run = hf.run([[5, 6, 7], [8, 9, 10, 11, 12]], max_tokens=[2, 4], batch_size=2, pad_id=0)
    assert (run.prompt_padding_tokens, run.output_padding_tokens) == (2, 2)
    assert run.tokens_computed == 2 * (5 + 4 - 1)  # prefill of 2 x 5 rows, then 3 decode steps of 2 rows
    assert [len(r.token_ids) for r in run.requests] == [2, 4]
    assert [len(r.token_times) for r in run.requests] == [2, 4]
    assert run.requests[0].token_times == run.requests[1].token_times[:2]  # one step clock for the batch
    assert run.kv_bytes == [0, *(2 * (5 + k) * hf.kv_bytes_per_token for k in range(4)), 0]  # [B, P_max + k]
    # the same rows one at a time: no padding, same greedy tokens as in the padded batch
    alone = hf.run([[5, 6, 7], [8, 9, 10, 11, 12]], max_tokens=[2, 4], batch_size=1, pad_id=0)
    assert (alone.prompt_padding_tokens, alone.output_padding_tokens) == (0, 0)
    assert [r.token_ids for r in alone.requests] == [r.token_ids for r in run.requests]


@pytest.mark.oracle
def test_bench_batching_compares_transformers_on_the_same_checkpoint(tmp_path):
    from tests.checkpoints import hf_tiny_model, write_hf_dir

    path = write_hf_dir(tmp_path / "hf", hf_tiny_model())
    out = tmp_path / "out"
    run_cli("batching", "--model", str(path), *SMALL, "--compare", "transformers", "--out", str(out))
    result = load_result(out, "batching")
    hf = result["summary"]["transformers"]
    expected = result["static_padding_expected"]
    assert hf["prompt_padding_tokens"] == expected["prompt_padding_tokens"]
    assert hf["output_padding_tokens"] == expected["output_padding_tokens"]
    assert hf["output_tokens"] == result["workload"]["total_output_tokens"]
    assert "/" in result["transformers"]["requests_identical_to_stagewise"]


def test_compare_transformers_rejects_the_tiny_preset():
    settings = batching.BatchingSettings(model="tiny", compare=("transformers",), **SMALL_SETTINGS)
    with pytest.raises(StagewiseError, match="needs smollm2-135m"):
        batching.run_batching(settings)


# ---- stages and the CLI ------------------------------------------------------------------------


def test_bench_stages_end_to_end(tmp_path):
    run_cli(
        "stages", "--stages", "tokenize,rmsnorm,embedding", "--prefill-tokens", "8", "--repeats", "1",
        "--out", str(tmp_path), "--device", "cpu",
    )  # fmt: skip
    result = load_result(tmp_path, "stages")
    assert COMMON_KEYS | {"rows", "config", "triton_mode", "note"} <= set(result)
    assert [(r["stage"], r["phase"]) for r in result["rows"]] == [
        (s, p) for s in ("tokenize", "rmsnorm", "embedding") for p in ("prefill", "decode")
    ]
    assert result["settings"]["model"] == "tiny" and result["settings"]["dtype"] == "float32"
    rms = next(r for r in result["rows"] if r["stage"] == "rmsnorm")
    assert rms["naive_ms"] > 0 and rms["optimized_ms"] > 0
    if result["triton_mode"] == "interpreter":
        assert "correctness only" in result["note"] and "correctness only" in rms["note"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["modes", "--model", "tiny", "--output-lengths", "4,x"], "comma-separated integers"),
        (["modes", "--model", "tiny", "--modes", "kv,fast"], "unknown mode 'fast'"),
        (["modes", "--model", "tiny", "--backend", "cuda"], "unknown backend"),
        (["batching", "--model", "tiny", "--prompt-tokens", "9-3"], "LOW-HIGH"),
        (["batching", "--model", "tiny", "--compare", "vllm"], "unknown --compare 'vllm'"),
        (["stages", "--stages", "nope"], "unknown stage 'nope'"),
        (["stages", "--dtype", "int8"], "unknown dtype"),
    ],
)
def test_bad_options_are_one_line_errors(args, message, tmp_path):
    result = CliRunner().invoke(bench_app, [*args, "--out", str(tmp_path)])
    assert isinstance(result.exception, StagewiseError)
    assert message in str(result.exception)


def test_soak_smoke_finds_nothing_lost_changed_or_leaked():
    from stagewise.bench.commands.soak import SoakSettings, run_soak

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as `bench soak` runs: the tiny model's ops are too small for threads
    try:
        # with every fault: abandoned streams, a burst of real SIGINTs on streams, a generating thread
        settings = SoakSettings(
            num_requests=24, num_kv_blocks=12, streams_every=8, arrivals_per_step=2, interrupts_every=6, threads_every=9
        )
        result = run_soak(settings)
    finally:
        torch.set_num_threads(threads)
    summary = result["summary"]
    assert result["ok"], (summary, result["lost"], result["mismatched"])
    assert summary["requests"] == 24 and summary["abandoned_streams"] >= 1
    assert summary["preemptions"] > 0 and summary["prefix_cache_hit_rate"] > 0
    assert summary["lost_requests"] == summary["outputs_differing_from_alone"] == summary["blocks_held_at_end"] == 0
    assert summary["interrupt_bursts"] >= 1 and summary["sigints_in_engine_calls"] >= 1
    assert summary["generate_threads_beside_streams"] >= 1 and summary["streamed_requests_checked"] >= 3
    assert summary["requests_ended_in_error"] == 0
