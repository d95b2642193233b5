"""Chunked prefill beside decodes: while a request decodes, a long prompt enters a few tokens per step."""

import pytest

from stagewise import LLM, SamplingParams, StagewiseError
from stagewise.config import CPU_PREFILL_BESIDE_DECODES, CPU_PREFILL_BESIDE_DECODES_COMPILED, EngineConfig
from stagewise.trace import Tracer


def test_the_cap_per_device():
    assert EngineConfig().prefill_cap("cpu") == CPU_PREFILL_BESIDE_DECODES
    assert EngineConfig().prefill_cap("cuda") is None  # a GPU prefills 512 tokens in about a decode step
    assert EngineConfig(prefill_beside_decodes=7).prefill_cap("cuda") == 7
    assert EngineConfig().prefill_cap("cpu", compiled_cpu_kernels=True) == CPU_PREFILL_BESIDE_DECODES_COMPILED
    assert EngineConfig(prefill_beside_decodes=7).prefill_cap("cpu", compiled_cpu_kernels=True) == 7
    with pytest.raises(StagewiseError, match="prefill_beside_decodes must be an int >= 1"):
        EngineConfig(prefill_beside_decodes=0)


def test_a_long_prompt_is_chunked_beside_a_decoding_request_and_alone_takes_the_budget(tiny):
    ecfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, prefill_beside_decodes=8)
    llm = LLM(tiny, mode="paged", engine_config=ecfg)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    long_prompt = " ".join(["apple", "pie"] * 30)
    n_long, n_short = len(llm.encode(long_prompt)), len(llm.encode("hi"))
    assert n_long > 40
    with Tracer(timing=False) as tracer:
        llm.add_request("hi", params)
        while not any(e for e in llm.step()):  # until the first request has its first token
            pass
        llm.add_request(long_prompt, params)
        while llm.has_unfinished_requests():
            llm.step()
    steps = [{r["request_id"]: r["num_scheduled"] for r in s.requests} for s in tracer.steps]
    ids = list(dict.fromkeys(rid for step in steps for rid in step))
    first, second = ids
    beside = [step[second] for step in steps if second in step and first in step and step[first] == 1]
    assert beside[:5] == [8, 8, 8, 8, 8], steps  # 8 prompt tokens per step while the first decodes
    assert sum(step.get(second, 0) for step in steps) == n_long + 11  # its prompt, then 11 decode tokens
    assert steps[0] == {first: n_short}  # alone, a prompt takes what it needs of the whole budget


@pytest.mark.parametrize("switch", ["0", "1"])
def test_the_engine_takes_the_cpu_cap_of_the_kernels_it_runs(tiny, monkeypatch, switch):
    monkeypatch.setenv("STAGEWISE_CPU_KERNELS", switch)  # the compiled CPU kernels on or off
    want = CPU_PREFILL_BESIDE_DECODES_COMPILED if switch == "1" else CPU_PREFILL_BESIDE_DECODES
    assert LLM(tiny, mode="paged").engine.scheduler.prefill_beside_decodes == want
