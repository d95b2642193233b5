"""Mode "kv" checks its contiguous KV cache against free memory before allocating it (issue 23, case 10).

A static batch reserves prompt + max_tokens slots for every row, used or not:
16 SmolLM2 prompts with max_tokens=8000 ask for 5.5 GiB at once. Paged mode
refuses a pool that does not fit; kv mode now refuses too, with the numbers.
The free memory is set through `memory.free_bytes`, as the weight check's tests do.
"""

import pytest
import torch

from stagewise import LLM, SamplingParams, StagewiseError
from stagewise.config import PRESETS, EngineConfig
from stagewise.engine.checks import check_kv_batches
from stagewise.kv.paged import kv_bytes_per_token
from stagewise.models import memory


def test_the_issues_smollm2_batch_is_refused_with_the_numbers(monkeypatch):
    cfg = PRESETS["smollm2-135m"]
    monkeypatch.setattr(memory, "free_bytes", lambda device: 4 * 2**30)
    need = 16 * 8010 * kv_bytes_per_token(cfg, torch.float32)
    assert need == 5_905_612_800  # 2 (K, V) * 30 layers * 3 KV heads * 64 * 4 bytes per token
    message = (
        r"^mode 'kv' needs a 5\.5 GiB contiguous KV cache \(16 prompts x 8010 tokens, prompt \+ "
        r"max_tokens reserved for each\) but 4\.0 GiB are free; lower max_tokens or max_num_seqs, "
        r"or use mode='paged'$"
    )
    with pytest.raises(StagewiseError, match=message):
        check_kv_batches(cfg, torch.float32, torch.device("cpu"), [(16, 8010), (4, 100)])
    check_kv_batches(cfg, torch.float32, torch.device("meta"), [(16, 8010)])  # shape only: no memory


def test_generate_in_kv_mode_refuses_before_allocating(tiny, monkeypatch):
    prompts = ["the cat sat on the mat"] * 6
    params = SamplingParams(max_tokens=900, temperature=0, ignore_eos=True)
    llm = LLM(tiny, mode="kv", engine_config=EngineConfig(max_num_seqs=4))
    rows, capacity = 4, len(llm.encode(prompts[0])) + 900  # the first batch is the larger one
    need = rows * capacity * kv_bytes_per_token(tiny.config, torch.float32)
    allocated = []
    real_zeros = torch.zeros
    monkeypatch.setattr(memory, "free_bytes", lambda device: need - 1)
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: allocated.append(a) or real_zeros(*a, **k))
    with pytest.raises(StagewiseError, match=rf"needs a .* \({rows} prompts x {capacity} tokens"):
        llm.generate(prompts, params)
    with pytest.raises(StagewiseError, match="contiguous KV cache"):
        next(llm.stream(prompts, params))
    assert not allocated, "the cache was allocated before the check"
    monkeypatch.setattr(memory, "free_bytes", lambda device: need)  # exactly enough: it runs
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [4] * 6 and allocated
