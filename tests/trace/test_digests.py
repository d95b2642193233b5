"""Row digests (`trace/digests.py`): per-request hashes of every stage output's rows, and the first op two
runs part at. Expected divergences come from runs made to differ on purpose, never from the code under test."""

import pytest
import torch

from stagewise import LLM, SamplingParams
from stagewise.config import EngineConfig
from stagewise.trace import Tracer
from stagewise.trace.digests import first_divergence, first_token_divergence, row_digests, row_owners

PARAMS = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
TARGET = "the cat sat on the mat and then ran far away quickly " * 6  # past 64 keys
OTHERS = ["hello there friend", "x y z"]


def test_rows_belong_to_their_request_and_position_and_padding_to_nobody():
    requests = [
        {"request_id": "a", "num_scheduled": 2, "padding": 1},  # a static batch's left padding first
        {"request_id": "b", "num_scheduled": 3},
        {"request_id": "c", "num_scheduled": 0, "padding": 1},  # a finished row still computed
    ]
    positions = [0, 0, 1, 7, 8, 9, 0]
    assert row_owners(requests, positions) == [None, ("a", 0), ("a", 1), ("b", 7), ("b", 8), ("b", 9), None]


def test_a_digest_is_of_the_rows_bits():
    x = torch.tensor([[1.0, 2.0], [1.0, 2.0], [1.0, 2.0 + 2**-22]])
    d = row_digests(x)
    assert d[0] == d[1] != d[2] and len(d[0]) == 16  # 8 bytes, hex
    assert row_digests(x.bfloat16())[0] != d[0]  # another dtype, other bits


def traced(llm: LLM, prompts: list[str], params=PARAMS):
    with Tracer(timing=False, digests=True) as tracer:
        outs = llm.generate(prompts, params)
    return tracer, outs


@pytest.mark.parametrize("mode", ["paged", "kv", "naive"])
def test_invariant_runs_have_the_same_digests_alone_and_batched(tiny, mode):
    alone, (a,) = traced(LLM(tiny, mode=mode), [TARGET])  # each its own engine: no prefix-cache hit
    batched, outs = traced(LLM(tiny, mode=mode), [OTHERS[0], TARGET, OTHERS[1]])
    b = outs[1]
    keys = alone.row_digests[a.request_id].keys() & batched.row_digests[b.request_id].keys()
    stages = {key[1] for key in keys}
    assert {"embedding", "qkv_proj", "rope", "o_proj", "ffn", "lm_head"} <= stages
    assert any("attention" in s for s in stages) and ("rmsnorm", 1) in {(k[1], k[2]) for k in keys}
    assert len(keys) > 1000
    assert first_divergence(alone, a.request_id, batched, b.request_id) is None
    assert first_token_divergence(alone, a.request_id, batched, b.request_id) is None


def test_without_invariance_the_first_divergent_op_is_named(tiny, monkeypatch):
    """batch_invariant=False: the decode steps' GEMMs take 1 row alone and 3 in the batch (MKL's kernels
    for 1 and for 2-3 rows), so the first op to differ is a projection of the first decode step."""
    from stagewise.tuning import gemm_forms

    # plain x @ w, whatever an earlier test in this process calibrated (another form may agree at 1 and 3 rows)
    monkeypatch.setattr(gemm_forms, "CPU_FORMS", gemm_forms.CpuForms())
    alone, (a,) = traced(LLM(tiny, batch_invariant=False), [TARGET])
    batched, outs = traced(LLM(tiny, batch_invariant=False), [OTHERS[0], TARGET, OTHERS[1]])
    div = first_divergence(alone, a.request_id, batched, outs[1].request_id)
    assert div is not None, "the runs did not differ: the scenario tests nothing"
    prompt_len = len(a.prompt_token_ids)
    assert div.position >= prompt_len  # the prompt's prefill had the same shapes alone and batched
    assert div.stage in ("qkv_proj", "o_proj", "ffn", "lm_head", "paged_attention")
    assert div.stage in div.describe() and div.differing_rows >= 1
    token = first_token_divergence(alone, a.request_id, batched, outs[1].request_id)
    assert token is not None and token >= prompt_len - 1


def test_a_chunked_prefill_without_invariance_parts_in_attention(tiny):
    """The prompt in 7-token chunks (a busy engine) against whole, packed weights (the int4 kernel's
    rows never depend on the batch): with the one-product prefill attention (batch_invariant=False)
    the prompt's own rows part first, at attention of layer 0."""
    from dataclasses import replace

    from stagewise.models.quantize_at_load import quantize_weights

    packed = replace(tiny, weights=quantize_weights(tiny.weights, "int4", "tiny"))
    llm = LLM(packed, batch_invariant=False)
    chunked = LLM(packed, batch_invariant=False, engine_config=EngineConfig(max_num_batched_tokens=7))
    alone, (a,) = traced(llm, [TARGET])
    busy, (b,) = traced(chunked, [TARGET])
    div = first_divergence(alone, a.request_id, busy, b.request_id)
    assert div is not None and div.layer == 0 and div.stage == "paged_attention", div
    assert div.position < len(a.prompt_token_ids)
