"""The triton tier's fused kernels inside the model: the same greedy tokens, fewer launches.

With the triton tier on rmsnorm + qkv_proj and on rope + kv_store, `LlamaModel` runs one kernel
for each pair (kernels/norm_matmul.py for decode batches without batch invariance: its sums are
not the rmsnorm kernel's; kernels/rope_kv_store.py in the paged mode, batch-invariant or not).
`StageOps.fuse = False` runs the separate kernels. Launches are counted by wrapping the
interpreter's (or the GPU's) kernel entry, the one call every `kernel[grid](...)` goes through.
"""

import contextlib

import pytest

from stagewise import LLM, SamplingParams
from stagewise.trace import Tracer

PROMPTS = ["Hello there, how are you?", "A"]


@contextlib.contextmanager
def counting_launches():
    """-> a list that gets one entry (the kernel's name) per kernel launch inside the block."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    launches: list[str] = []
    originals = {cls: cls.run for cls in (InterpretedFunction, JITFunction)}

    def wrap(cls):
        def run(self, *args, **kwargs):
            launches.append(getattr(self, "__name__", None) or self.fn.__name__)
            return originals[cls](self, *args, **kwargs)

        return run

    for cls in originals:
        cls.run = wrap(cls)
    try:
        yield launches
    finally:
        for cls, original in originals.items():
            cls.run = original


def launches_per_decode_step(llm: LLM, prompt: str) -> int:
    """Kernels launched by one decode step: (launches for 3 tokens - for 1 token) / 2."""
    counts = []
    for max_tokens in (1, 3):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        with counting_launches() as launches:
            llm.generate([prompt], params)
        counts.append(len(launches))
    return (counts[1] - counts[0]) // 2


def test_greedy_tokens_equal_with_and_without_fusion(tiny):
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    llm = LLM(tiny, backend="triton")
    fused = [o.token_ids for o in llm.generate(PROMPTS, params)]
    llm.ops.fuse = False
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == fused


@pytest.mark.parametrize(("batch_invariant", "saved"), [(False, 2), (True, 1)])
def test_fusion_saves_launches_per_layer_per_decode_step(tiny, batch_invariant, saved):
    """Not batch-invariant: rmsnorm and rope per layer; batch-invariant: rope only (rmsnorm stays)."""
    llm = LLM(tiny, backend="triton", batch_invariant=batch_invariant)
    fused = launches_per_decode_step(llm, "A")
    llm.ops.fuse = False
    separate = launches_per_decode_step(llm, "A")
    print(f"tiny ({tiny.config.num_layers} layers), one decode step: {separate} launches, fused {fused}")
    assert separate - fused == saved * tiny.config.num_layers


def test_trace_records_a_fused_call_once_as_the_later_stage(tiny):
    llm = LLM(tiny, backend="triton", batch_invariant=False)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    with Tracer() as tracer:
        llm.generate(["A"], params)
    layer0 = [r for r in tracer.steps[-1].stages if r.layer == 0]  # a decode step
    names = [r.stage for r in layer0]
    assert names[:3] == ["qkv_proj", "kv_store", "paged_attention"], names
    assert layer0[0].scalars["fused"] == "rmsnorm+qkv_proj" and layer0[0].backend == "triton"
    assert layer0[1].scalars["fused"] == "rope+kv_store"
    assert layer0[0].outputs[0].shape == [1, tiny.config.qkv_size]
    with Tracer() as tracer:  # batch-invariant (the default): rmsnorm before qkv_proj, every step
        LLM(tiny, backend="triton").generate(["A"], params)
    names = [r.stage for r in tracer.steps[-1].stages if r.layer == 0]
    assert names[:4] == ["rmsnorm", "qkv_proj", "kv_store", "paged_attention"], names


@pytest.mark.parametrize("mode", ["kv", "naive"])
def test_other_modes_keep_rope_separate(tiny, mode):
    """Only the paged cache takes the fused RoPE + KV store; the others still call rope."""
    llm = LLM(tiny, backend="triton", mode=mode)
    with Tracer() as tracer:
        llm.generate(["A"], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert "rope" in [r.stage for r in tracer.steps[-1].stages if r.layer == 0]
