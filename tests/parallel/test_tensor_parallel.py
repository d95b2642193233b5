"""Tensor parallelism on real processes (gloo on the CPU): TP=N gives TP=1's tokens, and fails cleanly.

Every test starts its own worker processes and shuts them down (no service
is started beforehand); each run gets a free port from the OS. The model is
split for real — shards, all-reduces, the vocabulary gather — with nothing
mocked. Reference = the same model on one device, in the same process.
"""

import os
import signal
import time
from dataclasses import replace

import pytest
import torch

from stagewise import LLM, SamplingParams, StagewiseError
from stagewise.config import PRESETS, EngineConfig, ParallelConfig
from stagewise.engine import build
from stagewise.kv.none import NoKVCache
from stagewise.models.forward_batch import ForwardBatch
from stagewise.models.registry import LoadedModel
from stagewise.models.weights import random_weights
from stagewise.parallel.driver import TensorParallelError
from stagewise.parallel.shard import shard_plan, valid_tp_sizes
from stagewise.parallel.worker import FAULT_ENV
from stagewise.tokenizer.vocabulary import Tokenizer

PROMPTS = ["hello world", "the quick brown fox", "a", "tensor parallel ranks", "one two three four five"]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
TOL = 1e-4  # float32 logits: the ranks' partial sums are added in another order than one GEMM's


def tokens(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params)]


def assert_workers_gone(llm: LLM) -> None:
    for rank, proc in llm.model.ranks.processes.items():
        proc.join(5)
        assert not proc.is_alive(), f"rank {rank} (pid {proc.pid}) outlived its LLM"


# ---- the sharding, without processes ----


def test_shard_plans_split_heads_and_replicate_kv_heads():
    smollm = PRESETS["smollm2-135m"]
    plans = [shard_plan(smollm, r, 3) for r in range(3)]
    assert [p.q_heads for p in plans] == [range(0, 3), range(3, 6), range(6, 9)]  # 9 heads / 3
    assert [p.kv_heads for p in plans] == [range(0, 1), range(1, 2), range(2, 3)]  # 3 KV heads / 3
    mqa = replace(smollm, num_heads=4, num_kv_heads=1, intermediate_size=8)
    assert [shard_plan(mqa, r, 2).kv_heads for r in range(2)] == [range(0, 1), range(0, 1)]  # 1 head, on both ranks
    gqa2 = replace(smollm, num_heads=8, num_kv_heads=2, intermediate_size=8)
    # 4 ranks, 2 KV heads: ranks 0-1 keep head 0 (their query heads 0-3 read it), ranks 2-3 head 1
    assert [shard_plan(gqa2, r, 4).kv_heads.start for r in range(4)] == [0, 0, 1, 1]
    assert valid_tp_sizes(smollm) == [1, 3]  # 9 heads, 3 KV heads, 1536 FFN columns


def test_a_size_that_does_not_split_names_the_valid_ones(tiny):
    with pytest.raises(StagewiseError, match=r"tensor_parallel_size=4 cannot split tiny.*N in 1, 2$"):
        LLM(tiny, tensor_parallel_size=4)
    with pytest.raises(StagewiseError, match="tensor_parallel_size must be an int >= 1"):
        LLM(tiny, tensor_parallel_size=0)
    with pytest.raises(StagewiseError, match="cuda_graphs does not run under tensor parallelism"):
        LLM(tiny, tensor_parallel_size=2, engine_config=EngineConfig(cuda_graphs=True))
    with pytest.raises(StagewiseError, match="shape-only model"):
        LLM("llama-3-405b", tensor_parallel_size=8)


# ---- TP = 1's numbers and tokens ----


def _logits(model, prompts, llm) -> torch.Tensor:
    batch = ForwardBatch.from_sequences([llm.encode(p) for p in prompts], [0] * len(prompts), torch.device("cpu"))
    return model.forward(batch, NoKVCache.of(batch))  # [B, vocab]


def test_tiny_tp2_logits_agree_and_tokens_agree_past_ties(tiny, monkeypatch, capsys):
    one = LLM(tiny)
    ref_logits = _logits(one.model, PROMPTS, one)
    ref_tokens = tokens(one)
    monkeypatch.setattr(build, "_SAID", set())  # said once per process: another test may have heard it
    with LLM(tiny, tensor_parallel_size=2) as llm:
        # batch invariance is on, and the start says it does not reach across TP degrees
        assert "across degrees (here 2 ranks vs 1) the logits differ (out of scope)" in capsys.readouterr().err
        assert llm.model.config.num_kv_heads == 1  # each rank's cache holds 1 of the 2 KV heads
        logits = _logits(llm.model, PROMPTS, llm)
        torch.testing.assert_close(logits, ref_logits, rtol=0, atol=TOL)
        got = tokens(llm)
        # streaming, hand stepping and prefix caching all go through the same engine
        streamed = [e.token_id for e in llm.stream(PROMPTS[1], GREEDY)]
        llm.add_request(PROMPTS[1] + " again", GREEDY)
        while llm.has_unfinished_requests():
            llm.step()
        assert llm.last_stats.prefix_hit_tokens >= 0
    assert_workers_gone(llm)
    assert streamed == ref_tokens[1]
    for prompt, a, b in zip(PROMPTS, got, ref_tokens):
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if k is None:
            continue  # identical
        # they part only where TP=1's top-2 logits were closer than the tolerance
        seq = one.encode(prompt) + b[:k]
        batch = ForwardBatch.from_sequences([seq], [0], torch.device("cpu"))
        lg = one.model.forward(batch, NoKVCache.of(batch))[0].topk(2).values
        assert float(lg[0] - lg[1]) < TOL, f"{prompt!r}: tokens part at {k} with a top-2 margin {lg[0] - lg[1]:.2e}"


@pytest.mark.parametrize("mode", ["kv", "naive"])
def test_tiny_tp2_other_modes(tiny, mode):
    ref = tokens(LLM(tiny, mode=mode))
    with LLM(tiny, mode=mode, tensor_parallel_size=2) as llm:
        assert tokens(llm) == ref
    assert_workers_gone(llm)


def test_preemption_under_tp_recomputes_to_the_same_tokens(tiny):
    ecfg = EngineConfig(num_kv_blocks=8, block_size=4, max_num_seqs=4)  # 32 slots for 5 requests: preemption
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    one = LLM(tiny, engine_config=ecfg)
    ref = tokens(one, params=params)
    with LLM(tiny, engine_config=ecfg, tensor_parallel_size=2) as llm:
        assert tokens(llm, params=params) == ref
        assert llm.last_stats.preemptions > 0
    assert_workers_gone(llm)


def test_fewer_kv_heads_than_ranks_are_replicated():
    """MQA (1 KV head) on 2 ranks: both ranks keep the one KV head; logits and tokens are TP=1's."""
    cfg = replace(PRESETS["tiny"], name="tiny-mqa", num_heads=4, num_kv_heads=1, head_dim=24)
    loaded = LoadedModel(
        cfg, random_weights(cfg, seed=1), Tokenizer.tiny(), "tiny MQA", torch.device("cpu"), torch.float32
    )
    one = LLM(loaded)
    with LLM(loaded, tensor_parallel_size=2) as llm:
        assert (llm.model.config.num_heads, llm.model.config.num_kv_heads) == (2, 1)
        torch.testing.assert_close(_logits(llm.model, PROMPTS, llm), _logits(one.model, PROMPTS, one), rtol=0, atol=TOL)
        assert tokens(llm) == tokens(one)


@pytest.mark.model
def test_smollm2_tp3_greedy_tokens_equal_tp1_in_every_mode(smollm):
    prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time",
        "The three primary colors are",
        "Water boils at",
        "The largest planet in the solar system is",
        "To make a cup of tea, first",
        "In 1969, humans",
        "The opposite of hot is",
        "A haiku about autumn:",
        "Python lists are",
        "The speed of light is",
    ]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    modes = ("paged", "kv", "naive")
    tp = {m: LLM(smollm, mode=m, tensor_parallel_size=3) for m in modes}  # one set of ranks, shared by the 3 LLMs
    try:
        assert len({id(llm.model) for llm in tp.values()}) == 1
        assert tp["paged"].model.config.num_heads == 3 and tp["paged"].model.config.num_kv_heads == 1
        for mode in modes:
            assert tokens(tp[mode], prompts, params) == tokens(LLM(smollm, mode=mode), prompts, params), mode
    finally:
        for llm in tp.values():
            llm.shutdown()
    assert_workers_gone(tp["paged"])


# ---- failure: one clear error, every rank gone, in bounded time ----


@pytest.mark.parametrize(
    ("fault", "reason"),
    [("1:2:raise", r"rank 1: RuntimeError: injected fault"), ("1:2:exit", r"rank 1 exited with code 3")],
    ids=["raises", "exits"],
)
def test_a_failing_rank_ends_the_run_with_its_reason(tiny, monkeypatch, fault, reason):
    monkeypatch.setenv(FAULT_ENV, fault)  # the workers inherit it: rank 1 fails at its third forward
    llm = LLM(tiny, tensor_parallel_size=2)
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match=reason):
        tokens(llm)
    assert time.monotonic() - start < 20
    assert_workers_gone(llm)
    with pytest.raises(StagewiseError, match="create a new LLM"):
        tokens(llm)


def test_a_stuck_rank_times_out(tiny, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "1:2:hang")
    llm = LLM(tiny, parallel_config=ParallelConfig(tensor_parallel_size=2, timeout_s=3))
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="a collective waited longer than timeout_s=3 s"):
        tokens(llm)
    assert time.monotonic() - start < 20  # the 3 s collective timeout, then shutdown
    assert_workers_gone(llm)


def test_a_killed_rank_mid_stream(tiny):
    llm = LLM(tiny, tensor_parallel_size=2)
    events = llm.stream(PROMPTS, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    next(events)
    os.kill(llm.model.ranks.processes[1].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="rank 1 exited with code -9"):
        for _ in events:
            pass
    assert time.monotonic() - start < 20
    assert_workers_gone(llm)


# ---- the trace: every rank's shards and collectives ----


def test_trace_records_every_rank_and_collective(tiny):
    from stagewise.trace import Tracer
    from stagewise.trace.export import to_chrome, to_json

    with LLM(tiny, tensor_parallel_size=2) as llm, Tracer() as tracer:
        llm.generate(PROMPTS[:2], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    doc = to_json(tracer)
    step = doc["steps"][-1]
    assert {s["rank"] for s in step["stages"]} == {0, 1}
    for rank in (0, 1):
        mine = [s for s in step["stages"] if s["rank"] == rank]
        reduces = [s for s in mine if s["stage"] == "all_reduce" and s["layer"] == 0]
        assert len(reduces) == 2 and all(s["kind"] == "collective" for s in reduces)  # o_proj and down
        assert reduces[0]["scalars"]["bytes"] == 2 * 96 * 4  # 2 decode tokens x hidden 96 x fp32
        qkv = next(s for s in mine if s["stage"] == "qkv_proj")
        assert qkv["inputs"][1]["shape"] == [96, (3 + 2 * 1) * 16]  # w_qkv of 3 query heads and 1 KV head
        assert any(s["stage"] == "gather" for s in mine)  # the LM head's vocabulary slice
    chrome = to_chrome(tracer)["traceEvents"]
    names = {e["args"]["name"] for e in chrome if e["name"] == "process_name"}
    assert names == {"rank 0 (schedules, samples)", "rank 1"}
    assert {e["pid"] for e in chrome if e.get("cat") == "collective"} == {1, 2}


# ---- Ctrl-C: one line, exit 130, and no process of the run is left ----


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc to see when the command is at work")
def test_ctrl_c_shuts_every_rank_down(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from tests.cli.test_cli_interrupt import AS_FROM_A_TERMINAL, ENV, cpu_seconds

    args = ["generate", "hi", "--model", "tiny", "--tp", "2", "--mode", "naive", "--max-tokens", "1000", "--ignore-eos"]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            AS_FROM_A_TERMINAL,
            *args,
        ],  # Ctrl-C's handler even when the suite runs in the background
        cwd=tmp_path,
        env={**ENV, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a shell gives a foreground command
    )
    deadline = time.monotonic() + 120
    while cpu_seconds(proc.pid) < 4.0 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: every process of the group gets it
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "interrupted"
    assert "Traceback" not in err
    for _ in range(100):  # the workers are gone too (their group is empty)
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("a worker process outlived the interrupted command")


def test_bench_modes_runs_each_mode_at_each_tp_size(tiny):
    """`bench modes --tp 1,2`: kv and paged at TP=2 share one set of ranks; same tokens as TP=1."""
    from stagewise.bench.commands.modes import ModesSettings, run_modes

    settings = ModesSettings(model="tiny", modes=("kv", "paged"), output_lengths=(2, 3), repeats=1, tp=(1, 2))
    result = run_modes(settings, loaded=tiny)
    assert set(result["summary"]) == {"kv", "paged", "kv tp2", "paged tp2"}
    assert result["outputs_identical"] and tuple(result["settings"]["tp"]) == (1, 2)
    from stagewise.parallel.driver import _RUNNING

    assert not _RUNNING  # the last LLM's shutdown ended the shared ranks


def test_torchrun_on_one_machine(tmp_path, tiny):
    """The multi-node path (torchrun, env://) with 2 processes here: rank 0 prints TP=1's text."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists() and shutil.which("torchrun") is None:
        pytest.skip("no torchrun next to this Python")
    from tests.cli.test_cli_interrupt import ENV

    expected = LLM(tiny).generate("hi there", SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0].text
    cmd = [str(torchrun if torchrun.exists() else shutil.which("torchrun")), "--nproc-per-node", "2"]
    cmd += ["-m", "stagewise.cli", "generate", "hi there", "--model", "tiny", "--tp", "2", "--max-tokens", "5"]
    env = {**ENV, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    res = subprocess.run(cmd + ["--ignore-eos"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout == expected + "\n"
