"""Checks for the exercises of notebooks 08-13: the cache, the scheduler, the roofline, the kernels' maths, TP.

References: the calculator (`stagewise.calc`: `roofline`, `tensor_parallel`), the block
manager, the kv_store and paged-attention stages, the tensor-parallel shard
plan, and the engine itself, run on the `tiny` model (random weights, 2
layers: a whole generate call takes milliseconds).
"""

import functools

import torch

from stagewise.calc.counts import Quantity, kv_bytes, kv_bytes_per_token, weight_bytes_streamed
from stagewise.calc.hardware import HARDWARE
from stagewise.calc.roofline import analyze
from stagewise.calc.steps import roofline
from stagewise.calc.tensor_parallel import INTERCONNECTS, analyze_tp
from stagewise.config import PRESETS, EngineConfig
from stagewise.exercises.core import Mismatch, call, call_recording_ops, close, equal, near
from stagewise.kv.block_manager import BlockManager
from stagewise.parallel.shard import valid_tp_sizes
from stagewise.stages import STAGES
from stagewise.stages.attention_metadata import AttentionMetadata
from stagewise.stages.paged_attention import gather_kv

TINY = PRESETS["tiny"]
MODELS = ["smollm2-135m", "llama-3-8b", "llama-3-405b"]


@functools.cache
def tiny_model():
    """The tiny model, loaded once (random seeded weights)."""
    from stagewise.models.registry import load_model

    return load_model("tiny", device="cpu")


def run_tiny(mode: str, prompt_lens: list[int], output_lens: list[int], seats: int = 4):
    """Generate on the tiny model with exact prompt and output lengths; returns the run's stats."""
    from stagewise.bench.harness.workloads import single_prompt
    from stagewise.engine.llm import LLM
    from stagewise.sampling_params import SamplingParams

    loaded = tiny_model()
    ecfg = EngineConfig(max_num_seqs=seats, max_model_len=256, enable_prefix_caching=False)
    llm = LLM(loaded, mode=mode, engine_config=ecfg)
    prompts = [single_prompt(loaded.tokenizer, n, seed=i) for i, n in enumerate(prompt_lens)]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in output_lens]
    llm.generate(prompts, params)
    return llm.last_stats


# ---------------------------------------------------------------- 08 KV cache


def check_kv_cache_bytes(fn) -> str:
    """my_kv_cache_bytes(cfg, num_tokens, dtype_bytes) -> bytes of K and V for num_tokens tokens."""
    for name in MODELS:
        for tokens, dtype_bytes in [(1, 2), (8192, 2), (1_000_000, 4)]:
            want = kv_bytes(PRESETS[name], dtype_bytes, tokens).value
            equal(call(fn, PRESETS[name], tokens, dtype_bytes), want, f"{name}, {tokens} tokens, {dtype_bytes} B")
    return f"{len(MODELS)} models x 3 sizes agree with the calculator's kv_bytes"


def check_naive_step_flops(fn) -> str:
    """my_naive_step_flops(cfg, context) -> FLOPs of one step that recomputes all N tokens (no cache)."""
    for name in MODELS:
        for n in (1, 100, 4096):
            want = analyze(PRESETS[name], HARDWARE["h100"], context=n).naive.flops.value
            near(call(fn, PRESETS[name], n), want, f"{name}, N = {n}", rel=1e-9)
    return f"{len(MODELS)} models x 3 contexts agree with the calculator's naive step"


def check_rows_computed(fn) -> str:
    """my_rows_computed(prompt_len, new_tokens) -> (rows the naive engine computes, rows the kv engine computes)."""
    for prompt_len, new_tokens in [(5, 1), (7, 4), (3, 9)]:
        got = tuple(call(fn, prompt_len, new_tokens))  # first: a stub stops here, before any engine runs
        want = (
            run_tiny("naive", [prompt_len], [new_tokens]).tokens_computed,
            run_tiny("kv", [prompt_len], [new_tokens]).tokens_computed,
        )
        equal(got, want, f"P = {prompt_len}, n = {new_tokens}")
    return "3 requests: the engines' own row counters (tiny model, modes naive and kv)"


# ---------------------------------------------------------------- 09 paged KV cache


def check_blocks_needed(fn) -> str:
    """my_blocks_needed(num_tokens, block_size) -> blocks that hold num_tokens tokens."""
    for block_size in (1, 16, 32):
        manager = BlockManager(num_blocks=1, block_size=block_size)
        for tokens in (0, 1, 15, 16, 17, 32, 100):
            equal(call(fn, tokens, block_size), manager.blocks_needed(tokens), f"{tokens} tokens, block {block_size}")
    return "7 lengths x 3 block sizes agree with BlockManager.blocks_needed"


def check_slot_mapping(fn) -> str:
    """my_slot_mapping(block_ids, positions, block_size) -> the slot of every position.

    The check writes K through your slots with the kv_store stage and reads the
    sequence back through its block table with paged attention's gather: it must
    come back in order.
    """
    g = torch.Generator().manual_seed(13)
    block_size, num_blocks, Hkv, d = 4, 10, TINY.num_kv_heads, TINY.head_dim
    block_ids = [7, 2, 9, 0]  # a block-table row: anywhere in the pool, in any order
    seq_len = 14
    k = torch.randn(seq_len, Hkv, d, generator=g)
    k_cache = torch.zeros(num_blocks * block_size, Hkv, d)
    v_cache = torch.zeros_like(k_cache)
    for chunk in (range(0, 9), range(9, 13), range(13, 14)):  # a prefill, a chunk, a decode token
        got = call(fn, list(block_ids), list(chunk), block_size)
        try:
            slots = torch.as_tensor(got, dtype=torch.long).reshape(-1)  # [len(chunk)]
        except (TypeError, ValueError, RuntimeError):
            raise Mismatch(f"positions {chunk.start}..{chunk.stop - 1}: want a list of ints, not {got!r:.50}") from None
        equal(slots.shape[0], len(chunk), f"number of slots for positions {chunk.start}..{chunk.stop - 1}")
        pool = num_blocks * block_size
        outside = [(p, int(s)) for p, s in zip(chunk, slots) if not 0 <= s < pool]
        if outside:
            p, s = outside[0]
            raise Mismatch(f"position {p} maps to slot {s}, outside the pool's {pool} slots (block * size + offset)")
        step = AttentionMetadata.build([len(chunk)], [chunk.stop], "cpu", slot_mapping=slots.tolist())
        new_k = k[chunk.start : chunk.stop]
        STAGES["kv_store"].naive(k=new_k, v=new_k, k_cache=k_cache, v_cache=v_cache, metadata=step)
    back = gather_kv(k_cache.view(num_blocks, block_size, Hkv, d), torch.tensor(block_ids), seq_len)
    close(back, k, "K read back through the block table", atol=0, rtol=0)
    return "K written through your slots (kv_store) reads back in order through the block table"


# ---------------------------------------------------------------- 10 continuous batching

WORKLOADS = [([7, 3, 5], [3, 6, 2], 2), ([4, 9, 2, 6, 5], [5, 1, 7, 2, 3], 3)]


def check_static_rows(fn) -> str:
    """my_static_rows(prompt_lens, output_lens, seats) -> (rows computed, padding rows) of static batching."""
    for prompts, outputs, seats in WORKLOADS:
        got = tuple(call(fn, list(prompts), list(outputs), seats))
        stats = run_tiny("kv", prompts, outputs, seats)
        equal(got, (stats.tokens_computed, stats.padding_tokens), f"prompts {prompts}, outputs {outputs}")
    return "2 workloads: the static engine's own counters (tiny model, mode kv)"


def check_continuous_rows(fn) -> str:
    """my_continuous_rows(prompt_lens, output_lens) -> rows continuous batching computes."""
    for prompts, outputs, seats in WORKLOADS:
        got = call(fn, list(prompts), list(outputs))
        equal(got, run_tiny("paged", prompts, outputs, seats).tokens_computed, f"prompts {prompts}, outputs {outputs}")
    return "2 workloads: the paged engine's own counter (tiny model, no prefix caching)"


# ---------------------------------------------------------------- 11 roofline


def check_roofline_time(fn) -> str:
    """my_roofline_time(flops, bytes_moved, peak_flops, bandwidth) -> seconds at the speed of light."""
    cases = 0
    for name in MODELS:
        for hw in HARDWARE.values():
            step = analyze(PRESETS[name], hw, context=1024, batch=8).prefill
            for flops in (step.flops.value, step.flops.value / 1e4):  # a compute-bound and a memory-bound case
                want = roofline("x", Quantity(flops, "FLOP", ""), step.bytes, hw, "bf16").time.value
                got = call(fn, flops, step.bytes.value, hw.peak_flops("bf16"), hw.memory_bandwidth)
                near(got, want, f"{name} on {hw.name}", rel=1e-9)
                cases += 1
    return f"{cases} steps (compute- and memory-bound) agree with calc.steps.roofline"


def check_decode_intensity(fn) -> str:
    """my_decode_intensity(batch, flops_per_seq, weight_bytes, kv_bytes_per_seq) -> FLOP per byte of a decode step."""
    for name in MODELS:
        cfg = PRESETS[name]
        for batch in (1, 16, 256):
            a = analyze(cfg, HARDWARE["h100"], context=2048, batch=batch)
            per_seq = a.decode.flops.value / batch
            weights = weight_bytes_streamed(cfg, a.dtype_bytes, batch).value
            kv = kv_bytes_per_token(cfg, a.dtype_bytes).value * (2048 + 1)  # N read + the new token written
            near(call(fn, batch, per_seq, weights, kv), a.decode.intensity.value, f"{name}, B = {batch}", rel=1e-9)
    return f"{len(MODELS)} models x 3 batch sizes agree with the calculator's decode step"


# ---------------------------------------------------------------- 12 kernels


def check_merge_splits(fn) -> str:
    """my_merge_splits(acc [S, d], m [S], l [S]) -> out [d]: split-K's exact merge of partial softmax states."""
    g = torch.Generator().manual_seed(14)
    H, Hkv, d, n = TINY.num_heads, TINY.num_kv_heads, TINY.head_dim, 40
    q = torch.randn(1, H, d, generator=g)  # one decode query
    k, v = torch.randn(n, Hkv, d, generator=g), torch.randn(n, Hkv, d, generator=g)  # its n cached keys and values
    one_decode = AttentionMetadata.build([1], [n], "cpu", k_starts=[0, n])  # 1 query on n keys
    want = STAGES["attention"].naive(q=q, k=k, v=v, metadata=one_decode, scale=d**-0.5)  # [1, H, d]
    for splits in (1, 3, 8):
        for h in (0, H - 1):
            kv_head = h // (H // Hkv)
            scores = (k[:, kv_head].double() @ q[0, h].double()) * d**-0.5  # [n]
            parts = torch.tensor_split(torch.arange(n), splits)
            m = torch.stack([scores[p].max() for p in parts])  # [S]
            sums = torch.stack([torch.exp(scores[p] - m[s]).sum() for s, p in enumerate(parts)])  # [S]: l per split
            acc = torch.stack([torch.exp(scores[p] - m[s]) @ v[p, kv_head].double() for s, p in enumerate(parts)])
            got = call(fn, acc, m, sums)
            close(got, want[0, h].double(), f"head {h}, {splits} splits", atol=1e-6)
    return "1, 3 and 8 splits of a decode query's keys merge to the attention stage's output"


def check_softmax_exp2(fn) -> str:
    """my_softmax_exp2(scores [R, N], scale) -> softmax(scores * scale), computed with exp2 only."""
    g = torch.Generator().manual_seed(15)
    scores = torch.randn(4, 25, generator=g, dtype=torch.float64) * 10
    for scale in (1.0, 0.125):
        got, ops = call_recording_ops(fn, scores.clone(), scale)
        close(got, torch.softmax(scores * scale, dim=-1), f"scale {scale}", atol=1e-12)
        used = sorted(ops & {"exp", "softmax", "log_softmax", "expm1", "sigmoid", "logsumexp"})
        if used or "exp2" not in ops:
            why = f"it calls {', '.join(used)}" if used else "it never calls exp2"
            raise Mismatch(f"the values are right but {why}: compute every power with torch.exp2, as the kernels do")
    return "softmax via exp2(x * log2(e)) equals torch.softmax, and exp2 is the only exponential it calls"


# ---------------------------------------------------------------- 13 tensor parallelism


def check_decode_allreduces(fn) -> str:
    """my_decode_allreduces(cfg, batch, dtype_bytes) -> (bytes of one decode all-reduce, all-reduces per step)."""
    cases = 0
    for name in MODELS + ["llama-3-70b"]:
        cfg = PRESETS[name]
        for batch, dtype_bytes in [(1, 2), (16, 2), (7, 4)]:
            got = tuple(call(fn, cfg, batch, dtype_bytes))
            for n in valid_tp_sizes(cfg)[1:3]:  # the answer must not depend on N: try two of them
                t = analyze_tp(cfg, HARDWARE["h100"], n, "bf16", dtype_bytes, 1024, batch, INTERCONNECTS["nvlink4"])
                want = (t.decode_message.value, t.all_reduces_per_step.value)
                equal(got, want, f"{name}, B = {batch}, {dtype_bytes} B per number, N = {n}")
                cases += 1
    return f"{cases} cases agree with calc.tensor_parallel.analyze_tp (message bytes and all-reduces per decode step)"


def check_valid_tp_sizes(fn) -> str:
    """my_valid_tp_sizes(cfg) -> every N (ascending) over which the model's heads, KV heads and FFN split."""
    for name, cfg in PRESETS.items():
        equal(list(call(fn, cfg)), valid_tp_sizes(cfg), name)
    return f"{len(PRESETS)} models agree with parallel.shard.valid_tp_sizes"


CHECKS = {
    "08.kv_cache_bytes": check_kv_cache_bytes,
    "08.naive_step_flops": check_naive_step_flops,
    "08.rows_computed": check_rows_computed,
    "09.blocks_needed": check_blocks_needed,
    "09.slot_mapping": check_slot_mapping,
    "10.static_rows": check_static_rows,
    "10.continuous_rows": check_continuous_rows,
    "11.roofline_time": check_roofline_time,
    "11.decode_intensity": check_decode_intensity,
    "12b.merge_splits": check_merge_splits,
    "12b.softmax_exp2": check_softmax_exp2,
    "13.decode_allreduces": check_decode_allreduces,
    "13.valid_tp_sizes": check_valid_tp_sizes,
}
