"""An engine step reads nothing back from the device but the sampled ids.

On a GPU every host read of a tensor (`.item()`, `.tolist()`, `if t.any():`)
waits for all queued kernels: a step with one per layer is host-bound and can
never be captured in a CUDA graph. The scheduler holds every length as a
Python int, so launchers need none. The chain: the counter (tests/host_reads.py)
sees every kind of read -> it sees one planted inside a stage of a running
step -> the debug value checks are reads (and are off by default) -> a
Triton-backend step reads exactly one thing, the sampled ids, in every mode.
"""

import operator

import pytest
import torch

from stagewise import LLM, SamplingParams
from stagewise.config import EngineConfig
from stagewise.runtime import DEBUG_CHECKS_ENV
from stagewise.stages.sampling import SamplingTensors
from tests.host_reads import HostReadCounter

PROMPTS = ["Hello there, how are you?", "A"]  # different lengths: padding in mode kv
PARAMS = [  # every sampling branch: penalty, min_p, top-k, top-p, a random draw, and a greedy row
    SamplingParams(max_tokens=3, temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.2, seed=1),
    SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),  # finishes first: a padding row in mode kv
]
SAMPLER = "stagewise/engine/sampler.py:"


def counted_run(llm: LLM, prompts=PROMPTS, params=PARAMS) -> tuple[list[tuple[str, str]], int]:
    """Run the prompts to the end, counting host reads in every step; -> (reads, sampler calls)."""
    requests = llm._requests(prompts, params, chat=False)  # tokenized before the count: host text, no device
    if llm.loaded.device.type == "cuda":  # the first run compiles and autotunes: the autotuner reads timings back
        for _ in llm._stream_requests(llm._requests(prompts, params, chat=False)):
            pass
    calls = []
    from_params = SamplingTensors.from_params.__func__

    def counting_from_params(cls, *args, **kwargs):
        calls.append(1)  # once per sampler call
        return from_params(cls, *args, **kwargs)

    SamplingTensors.from_params = classmethod(counting_from_params)
    try:
        with HostReadCounter() as counter:
            for _ in llm._stream_requests(requests):  # every step of the run, as generate() runs them
                pass
    finally:
        SamplingTensors.from_params = classmethod(from_params)
    return counter.reads, len(calls)


def triton_llm(tiny, mode: str) -> LLM:
    """mode "paged+graphs": paged, with decode steps through the CUDA-graph path (engine/cuda_graphs.py)."""
    ecfg = EngineConfig(max_num_batched_tokens=8)  # paged: chunked prefill, then mixed prefill + decode steps
    if mode == "paged+graphs":
        mode, ecfg = "paged", ecfg.with_updates(cuda_graphs=True)
    return LLM(tiny, backend="triton", mode=mode, engine_config=ecfg)


@pytest.fixture(scope="module")
def tiny_cuda():
    from stagewise.models.registry import load_model

    return load_model("tiny", torch.device("cuda"), torch.bfloat16)


# ---- the counter sees every kind of read ----

PLANTED = {
    "item": lambda t: t.max().item(),
    "int": lambda t: int(t[0]),
    "float": lambda t: float(t[0]),
    "bool": lambda t: bool(t.any()),
    "if": lambda t: 1 if (t > 0).any() else 0,
    "index": lambda t: operator.index(t[0]),
    "list index": lambda t: [0, 1, 2][t[0] % 3],
    "range": lambda t: range(t[0]),
    "tolist": lambda t: t.tolist(),
    "cpu": lambda t: t.cpu(),
    "numpy": lambda t: t.numpy(),
    "bool mask": lambda t: t[t > 0],
    "nonzero": lambda t: torch.nonzero(t),
    "unique": lambda t: torch.unique(t),
    "masked_select": lambda t: t.masked_select(t > 0),
    "repeat_interleave": lambda t: torch.repeat_interleave(t.clamp(0, 2)),
    "f-string": lambda t: f"{t[0]}",
    "equal": lambda t: torch.equal(t, t),
    "allclose": lambda t: torch.allclose(t.float(), t.float()),
    "contains": lambda t: 3 in t,
}


@pytest.mark.parametrize("kind", list(PLANTED))
def test_counter_sees_every_kind_of_read(kind):
    t, item = torch.arange(5), torch.Tensor.item
    with HostReadCounter() as counter:
        t + 1  # arithmetic stays on the device: not a read
    assert counter.reads == []
    with HostReadCounter() as counter:
        PLANTED[kind](t)
    assert counter.reads, f"{kind}: not seen"
    assert all(where.startswith("tests/engine/test_host_sync.py:") for _, where in counter.reads), counter.reads
    assert torch.Tensor.item is item  # the methods are restored afterwards


def test_counter_sees_a_read_planted_in_a_stage(tiny):
    llm = triton_llm(tiny, "paged")
    rope = llm.ops._fns["rope"]

    def rope_with_a_read(positions, **kwargs):
        positions.max().item()  # the kind of read a launcher used to do
        return rope(positions=positions, **kwargs)

    llm.ops._fns["rope"] = rope_with_a_read
    llm.ops.fuse = False  # the paged triton tier would run RoPE inside the KV store (rope_kv_store)
    reads, _ = counted_run(llm, ["Hi"], [SamplingParams(max_tokens=1, temperature=0)])
    planted = [r for r in reads if r[1].startswith("tests/engine/test_host_sync.py:")]
    assert len(planted) == tiny.config.num_layers, reads  # one per layer


def test_debug_checks_read_values_and_are_off_by_default(tiny, monkeypatch):
    monkeypatch.setenv(DEBUG_CHECKS_ENV, "1")
    reads, _ = counted_run(triton_llm(tiny, "paged"), ["Hi"], [SamplingParams(max_tokens=1, temperature=0)])
    launchers = {where.split(":")[0] for _, where in reads if where.startswith("stagewise/kernels/")}
    # paged triton: RoPE runs inside the KV store's kernel (rope_kv_store), attn_norm inside qkv_proj's
    assert {"stagewise/kernels/rope_kv_store.py", "stagewise/kernels/paged_attention.py"} <= launchers, reads
    monkeypatch.delenv(DEBUG_CHECKS_ENV)
    from stagewise.runtime import debug_checks

    assert not debug_checks()


# ---- the engine step ----


@pytest.mark.parametrize("mode", ["paged", "kv", "naive", "paged+graphs"])
def test_triton_step_reads_only_the_sampled_ids(tiny, mode, monkeypatch):
    monkeypatch.setenv(DEBUG_CHECKS_ENV, "0")  # the suite turns value checks on; an engine runs without
    reads, sampler_calls = counted_run(triton_llm(tiny, mode))
    transfers = [r for r in reads if r[0] == "tolist" and r[1].startswith(SAMPLER)]
    others = [r for r in reads if r not in transfers]
    assert not others, f"{len(others)} host reads besides the sampled ids:\n" + "\n".join(map(str, others))
    assert sampler_calls >= 3 and len(transfers) == sampler_calls  # exactly one per step that samples


@pytest.mark.parametrize("tier", ["naive", "torch"])
def test_pytorch_tiers_paged_greedy_step_reads_only_the_sampled_ids(tiny, monkeypatch, tier):
    """The PyTorch tiers take the same host lengths, so they read nothing back either (paged: no padding).

    Greedy only: the naive draw is `torch.multinomial`, which checks the probabilities on the host.
    """
    monkeypatch.setenv(DEBUG_CHECKS_ENV, "0")
    llm = LLM(tiny, backend=tier, mode="paged", engine_config=EngineConfig(max_num_batched_tokens=8))
    greedy = [SamplingParams(max_tokens=3, temperature=0, repetition_penalty=1.2, ignore_eos=True)] * 2
    reads, sampler_calls = counted_run(llm, PROMPTS, greedy)
    others = [r for r in reads if not (r[0] == "tolist" and r[1].startswith(SAMPLER))]
    assert not others, "\n".join(map(str, others))
    assert sampler_calls >= 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the driver's own sync detector")
@pytest.mark.parametrize("mode", ["paged", "kv", "naive", "paged+graphs"])
def test_triton_step_never_synchronizes_on_a_gpu(tiny_cuda, mode, monkeypatch):
    """torch's sync debug mode raises on any synchronizing CUDA call; only the sampled ids may sync."""
    monkeypatch.setenv(DEBUG_CHECKS_ENV, "0")
    llm = triton_llm(tiny_cuda, mode)
    counted_run(llm)  # warm-up: compile, autotune and capture the decode graphs (those synchronize)
    tolist = torch.Tensor.tolist

    def tolist_of_the_sampled_ids(tensor):
        import inspect

        allowed = inspect.stack()[1].filename.endswith("stagewise/engine/sampler.py")
        torch.cuda.set_sync_debug_mode(0 if allowed else "error")
        try:
            return tolist(tensor)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    requests = llm._requests(PROMPTS, PARAMS, chat=False)  # the same LLM: its engine keeps its graphs
    monkeypatch.setattr(torch.Tensor, "tolist", tolist_of_the_sampled_ids)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in llm._stream_requests(requests):
            pass
    finally:
        torch.cuda.set_sync_debug_mode(0)
