"""The compile gate's launches: what every launcher would launch for a model shape, as plain data.

For one model shape (SmolLM2-135M, Llama-3-8B, ...), one phase (a decode step
of 8 sequences at 2k context, or a 512-token prefill) and one dtype, `launches`
lists each kernel launch the forward pass makes on a GPU: the kernel, its
keyword arguments (tensors as their dtype only; strides and sizes as on a GPU,
where weights are [in, out] row-major and q/k/v are views of the fused QKV
output) and the launcher's own plan for the target (`*_plan` functions in
`stagewise.kernels`: tile configs, warps, stages, constexprs). Nothing here
chooses a tile: the plans do, exactly as the launchers call them.
"""

from dataclasses import dataclass

import torch

from stagewise.config import PRESETS
from stagewise.kernels import matmul_decode
from stagewise.kernels.activation import silu_and_mul_tiles
from stagewise.kernels.embedding import embedding_tiles
from stagewise.kernels.flash_attention import flash_attention_plan
from stagewise.kernels.kv_store import kv_store_tiles
from stagewise.kernels.matmul import DECODE_MAX_M, gemm_plan
from stagewise.kernels.paged_attention import int64_offsets, paged_attention_plan
from stagewise.kernels.precision import dot_policy
from stagewise.kernels.rmsnorm import rmsnorm_plan
from stagewise.kernels.rope import rope_tiles
from stagewise.kernels.row_tiles import token_bucket
from stagewise.kernels.split_k import choose_num_splits, chunk_splits, split_k_reduce_plan
from stagewise.kernels.targets import LaunchPlan, Target


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


BLOCK_SIZE = 16  # KV cache tokens per block (the engine's default)
SMS = {75: 40, 80: 108, 86: 84, 89: 128, 90: 132}  # SMs of a representative GPU per target (T4, A100, ..., H100)


@dataclass(frozen=True)
class Phase:
    name: str  # "decode" or "prefill"
    num_seqs: int  # sequences in the step
    q_len: int  # query tokens per sequence this step
    context: int  # tokens per sequence in the KV cache after the step


DECODE = Phase("decode", num_seqs=8, q_len=1, context=2048)
PREFILL = Phase("prefill", num_seqs=1, q_len=512, context=512)
PHASES = {p.name: p for p in (DECODE, PREFILL)}


@dataclass(frozen=True)
class Launch:
    kernel: str  # kernel family (plan.kernel)
    label: str  # which call: "qkv_proj", "lm_head", ...
    module: str  # module holding the @triton.jit function
    function: str  # its name there
    args: dict  # keyword arguments: {"ptr": dtype name} for tensors, ints / floats / bools otherwise
    plan: LaunchPlan  # the launcher's tiles, warps, stages and constexprs for the target
    # one of several candidates a GPU tuner times under this label, split over launches whose
    # constexprs differ (the split-K GEMM's SERIAL): the gate asks one of them to be clean
    tuned: bool = False


def _ptr(dtype: torch.dtype) -> dict:
    return {"ptr": str(dtype).removeprefix("torch.")}


def _precision(dtype) -> dict:
    """The dot precision a GPU launch gets (precision.py; fp32: IEEE, PyTorch's default without TF32)."""
    policy = dot_policy(dtype, interpreter=False)
    return {"FP32_DOTS": policy.fp32_dots, "INPUT_PRECISION": policy.input_precision}


def _row_plan(kernel: str, constexprs: dict, candidates) -> LaunchPlan:
    """A row kernel's tiles (row_tiles.TileConfig candidates) as a plan."""
    return LaunchPlan(kernel, constexprs, tuple(c.triton_config() for c in candidates))


def _matmul(
    label: str, m: int, n: int, k: int, dtype, target: Target, gather: bool = False, invariant: bool = False
) -> list[Launch]:
    """A GEMM: the split-K decode kernel for m <= 16 or batch-invariant (matmul_decode.py; past one
    16-row tile its programs walk their splits, SERIAL), the tiled one otherwise."""
    x, w = _ptr(dtype), _ptr(dtype)
    strides_b = (1, k) if gather else (n, 1)  # the LM head reads the [vocab, hidden] embedding transposed
    args = dict(a_ptr=x, b_ptr=w, row_index_ptr=_ptr(torch.int64) if gather else x, M=m, N=n, K=k)
    args.update(stride_am=k, stride_ak=1, stride_bk=strides_b[0], stride_bn=strides_b[1], GATHER=gather)
    args.update(INTERPRETED=False, **_precision(dtype))
    if m > DECODE_MAX_M and not invariant:
        args.update(c_ptr=x, M_BUCKET=_next_power_of_2(m), stride_cm=n, stride_cn=1)
        plan = gemm_plan(m, dtype, target)
        return [Launch("matmul", label, "stagewise.kernels.matmul", "_matmul_kernel", args, plan)]
    import triton  # here, not at the top: stagewise.kernels must choose the Triton mode first

    budget = target.shared_memory - matmul_decode.SMEM_HEADROOM
    sms = SMS.get(target.capability, 108)
    fma = target.capability < 80  # as decode_config: FMA tiles before sm_80
    candidates = matmul_decode.gpu_candidates(n, k, dtype.itemsize, sms, budget, fma)
    groups: dict[tuple, list] = {}  # (splits > 1, SERIAL) -> (configs, a K_PER_SPLIT, splits)
    for c in candidates:
        k_per_split, splits = matmul_decode.split_plan(k, c.block_k, c.split_k)
        meta = {"BLOCK_M": matmul_decode.BLOCK_M, "BLOCK_N": c.block_n, "BLOCK_K": c.block_k}
        config = triton.Config(meta, num_warps=c.num_warps, num_stages=c.num_stages)
        serial = m > matmul_decode.BLOCK_M and splits > 1  # as matmul_decode._launch
        groups.setdefault((splits > 1, serial), ([], k_per_split, splits))[0].append(config)
    # K_PER_SPLIT and the partial buffer differ per candidate; every candidate's K_PER_SPLIT is a multiple of
    # BLOCK_K >= 16 (divisible by 16, like K), so one representative value specialises them all alike.
    out = []
    for (split, serial), (configs, k_per_split, splits) in groups.items():
        partials = split and not serial
        a = dict(args, out_ptr=_ptr(torch.float32) if partials else x, K_PER_SPLIT=k_per_split, NUM_SPLITS=splits)
        a.update(stride_os=m * n if partials else 0, stride_om=n, stride_on=1, SERIAL=serial)
        a.update(c_ptr=x, counter_ptr=_ptr(torch.int32), stride_cm=n, stride_cn=1, FUSED_SUM=partials)
        plan = LaunchPlan("matmul", {}, tuple(configs))
        tuned = len(candidates) > 1  # the tuner times them all, whichever group
        module = "stagewise.kernels.matmul_decode"
        out.append(Launch("matmul", label + " (split-K)", module, "_decode_kernel", a, plan, tuned))
    return out


QUANTIZED = (  # (label, kind) of the packed launches: SmolLM2's Q4_1 projections and Q8_0 head, Q4_0 files
    ("qkv_proj", "q4_1"),
    ("o_proj", "q4_1"),
    ("gate_up", "q4_1"),
    ("down_proj", "q4_1"),
    ("qkv_proj", "q4_0"),
    ("lm_head", "q8_0"),
)
K_QUANTIZED = (  # the K-quants, expanded at load to groups with float32 scales (quant/packed_weight.py)
    # a Q4_K_M file's W_q | W_k in q4_k beside a q6_k W_v (a PackedParts: two launches,
    # quant/packed_parts.py) and its q6_k ffn_down (int8 codes, groups of 16); a Q5_K_M file's
    # q5_k (int8 codes 0..31 and a minimum)
    ("qk_proj", "q4_k"),
    ("v_proj", "q6_k"),
    ("down_proj", "q6_k"),
    ("gate_up", "q5_k"),
)


def _dequant_matmul(
    label: str, kind: str, m: int, n: int, k: int, dtype, target: Target, invariant: bool = False
) -> Launch:
    """The fused dequantize-GEMM of a packed weight (kernels/dequant_matmul.py), as its launcher plans it."""
    import triton

    from stagewise.kernels import dequant_matmul as dq
    from stagewise.kernels.matmul_decode import split_plan
    from stagewise.quant.packed_weight import KINDS, LAYOUT

    bits, offset, has_mins = KINDS[kind]
    code_dtype, scale_dtype, fixed_group = LAYOUT[kind]  # K-quants: float32 scales, q6_k groups of 16
    group = fixed_group or dq.GROUP_SIZE
    sms = SMS.get(target.capability, 108)
    cfg = dq.dequant_config(m, n, k, sms, dtype.itemsize, bits == 8 and has_mins, invariant)
    k_per_split, splits = split_plan(k, cfg.block_k, cfg.split_k)
    serial = -(-m // cfg.block_m) > 1 and splits > 1  # as dequant_launch
    partials = splits > 1 and not serial
    x, scales = _ptr(dtype), _ptr(scale_dtype)
    args = dict(a_ptr=x, codes_ptr=_ptr(code_dtype), scales_ptr=scales, mins_ptr=scales)
    args.update(out_ptr=_ptr(torch.float32) if partials else x, M=m, N=n, K=k, K_PER_SPLIT=k_per_split)
    args.update(NUM_SPLITS=splits, stride_am=k, stride_ak=1, stride_codes=k * bits // 8, stride_scales=k // group)
    args.update(stride_os=m * n if partials else 0, stride_om=n, stride_on=1, INTERPRETED=False)
    constexprs = dict(BITS=bits, OFFSET=offset, HAS_MINS=has_mins, GROUP=group, SERIAL=serial, **_precision(dtype))
    tiles = {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k}
    stages = dq.launch_stages(cfg, serial, bits == 8 and has_mins)
    config = triton.Config(tiles, num_warps=cfg.num_warps, num_stages=stages)
    plan = LaunchPlan("dequant_matmul", constexprs, (config,))
    name = f"{label} {kind}" + (f" (split-K {splits}{', serial' if serial else ''})" if splits > 1 else "")
    return Launch("dequant_matmul", name, "stagewise.kernels.dequant_matmul", "_dequant_matmul_kernel", args, plan)


def quantized_launches(
    model: str, phase: Phase, dtype: torch.dtype, target: Target, k_kinds: tuple[str, ...] | None = None
) -> list[Launch]:
    """The projections' launches when their weights are kept packed (LLM(quantization="auto") on a GGUF);
    k_kinds: the K-quant kinds among them (None: all of K_QUANTIZED)."""
    cfg = PRESETS[model]
    tokens = phase.num_seqs * phase.q_len
    shapes = {  # label -> (M, N, K)
        "qkv_proj": (tokens, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, cfg.hidden_size),
        "qk_proj": (tokens, (cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim, cfg.hidden_size),  # W_q | W_k
        "v_proj": (tokens, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size),
        "o_proj": (tokens, cfg.hidden_size, cfg.num_heads * cfg.head_dim),
        "gate_up": (tokens, 2 * cfg.intermediate_size, cfg.hidden_size),
        "down_proj": (tokens, cfg.hidden_size, cfg.intermediate_size),
        "lm_head": (phase.num_seqs, cfg.vocab_size, cfg.hidden_size),
    }
    chosen = QUANTIZED + tuple((label, kind) for label, kind in K_QUANTIZED if k_kinds is None or kind in k_kinds)
    out = [_dequant_matmul(label, kind, *shapes[label], dtype, target) for label, kind in chosen]
    out += [  # batch-invariant (the default) prefill: the decode config over tiles of 16 rows
        _dequant_matmul(f"{label} batch-invariant", kind, *shapes[label], dtype, target, invariant=True)
        for label, kind in chosen
        if shapes[label][0] > DECODE_MAX_M
    ]
    for launch in out:
        launch.args.update(launch.plan.constexprs)
    return out


def launches(
    model: str, phase: Phase, dtype: torch.dtype, target: Target, k_kinds: tuple[str, ...] | None = None
) -> list[Launch]:
    """Every kernel launch of one forward step (one layer's worth: the layers are identical) plus sampling;
    k_kinds: which K-quant dequantize-GEMMs to include (None: all)."""
    cfg = PRESETS[model]
    hidden, d, heads, kv_heads = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    seqs, tokens = phase.num_seqs, phase.num_seqs * phase.q_len
    qkv_width = (heads + 2 * kv_heads) * d
    x, i64, f32 = _ptr(dtype), _ptr(torch.int64), _ptr(torch.float32)
    out = []

    def add(kernel, label, module, function, args, plan):
        out.append(Launch(kernel, label, f"stagewise.kernels.{module}", function, args, plan))

    bucket = token_bucket(tokens)
    add("embedding", "embedding", "embedding", "_embedding_kernel",
        dict(ids_ptr=i64, weight_ptr=x, out_ptr=x, num_tokens=tokens, hidden=hidden, tokens_bucket=bucket),
        _row_plan("embedding", {}, embedding_tiles(tokens, hidden, interpreter=False)))  # fmt: skip
    for residual in (False, True):
        args = dict(x_ptr=x, x_row_stride=hidden, residual_ptr=x, residual_row_stride=hidden, weight_ptr=x)
        args.update(out_ptr=x, residual_out_ptr=x, hidden=hidden, eps=1e-5)
        label = "rmsnorm+residual" if residual else "rmsnorm"
        add("rmsnorm", label, "rmsnorm", "_rmsnorm_kernel", args, rmsnorm_plan(hidden, residual))

    def gemm(label: str, m: int, n: int, k: int, gather: bool = False) -> None:
        out.extend(_matmul(label, m, n, k, dtype, target, gather))
        if m > DECODE_MAX_M:  # batch-invariant (the default): the split-K kernel for every M
            out.extend(_matmul(f"{label} batch-invariant", m, n, k, dtype, target, gather, invariant=True))

    gemm("qkv_proj", tokens, qkv_width, hidden)
    if tokens <= DECODE_MAX_M:  # decode, plain weights: attn_norm inside qkv_proj (norm_matmul.py)
        out.append(_norm_matmul(tokens, qkv_width, hidden, dtype, target))
    rope_args = dict(positions_ptr=i64, q_ptr=x, q_token_stride=qkv_width, q_head_stride=d, k_ptr=x)
    rope_args.update(k_token_stride=qkv_width, k_head_stride=d, cos_sin_ptr=f32, cos_sin_row_stride=d)
    rope_args.update(num_tokens=tokens, num_heads=heads, num_kv_heads=kv_heads)
    rope_heads, rope_tile = rope_tiles(tokens, heads, kv_heads, d)
    add("rope", "rope", "rope", "_rope_kernel", rope_args, _row_plan("rope", rope_heads, [rope_tile]))
    kv_args = dict(k_ptr=x, k_token_stride=qkv_width, k_head_stride=d, v_ptr=x, v_token_stride=qkv_width)
    kv_args.update(v_head_stride=d, k_cache_ptr=x, v_cache_ptr=x, slot_mapping_ptr=i64, num_kv_heads=kv_heads)
    kv_args.update(num_tokens=tokens, tokens_bucket=bucket)
    kv_heads_tiling, kv_tiles = kv_store_tiles(tokens, kv_heads, d, interpreter=False)
    add(
        "kv_store",
        "kv_store",
        "kv_store",
        "_kv_store_kernel",
        kv_args,
        _row_plan("kv_store", kv_heads_tiling, kv_tiles),
    )
    out.append(_rope_kv_store(tokens, heads, kv_heads, d, qkv_width, dtype))  # paged: rope + kv_store
    out.extend(_attention(phase, heads, kv_heads, d, qkv_width, dtype, target))
    out.extend(_attention(phase, heads, kv_heads, d, qkv_width, dtype, target, invariant=True))
    gemm("o_proj", tokens, hidden, heads * d)
    gemm("gate_up", tokens, 2 * cfg.intermediate_size, hidden)
    inter = cfg.intermediate_size
    args = dict(gate_up_ptr=x, out_ptr=x, num_tokens=tokens, inter=inter, stride_in_row=2 * inter)
    args.update(stride_out_row=inter, tokens_bucket=bucket, INTERPRETED=False)
    add("silu_and_mul", "silu_and_mul", "activation", "_silu_and_mul_kernel", args,
        _row_plan("silu_and_mul", {}, silu_and_mul_tiles(tokens, inter, interpreter=False)))  # fmt: skip
    gemm("down_proj", tokens, hidden, inter)
    if tokens <= DECODE_MAX_M:  # decode, plain weights: the two launches above as one (silu_down.py)
        out.append(_silu_down(tokens, hidden, inter, dtype, target))
    gemm("lm_head", seqs, cfg.vocab_size, hidden, gather=True)
    out.extend(_sampling(seqs, cfg.vocab_size, dtype))
    if phase.q_len == 1:  # a decode step may verify speculative drafts
        out.extend(_rejection_sampling(cfg.vocab_size))
    for launch in out:  # the plan's constexprs complete the arguments (tiles come from each config)
        launch.args.update(launch.plan.constexprs)
    return out + quantized_launches(model, phase, dtype, target, k_kinds)


def _sampling(batch: int, vocab: int, dtype) -> list[Launch]:
    """The fused sampler's passes (kernels/sampling.py), each a pass kernel and its combine, penalty on."""
    import triton

    from stagewise.kernels import sampling

    tiles = sampling.sampling_tiles(vocab, interpreter=False)
    f32, i32, i64, u8 = _ptr(torch.float32), _ptr(torch.int32), _ptr(torch.int64), _ptr(torch.uint8)
    # the launcher's shared set of arguments, as dtypes; each kernel takes the ones its signature names
    shared = dict(logits_ptr=_ptr(dtype), logits_row_stride=vocab, seen_ptr=u8, seen_row_stride=vocab,
                  penalty_ptr=f32, temperature_ptr=f32, top_k_ptr=i64, top_p_ptr=f32, min_p_ptr=f32,
                  seed_ptr=i64, row_max_ptr=f32, row_sum_ptr=f32, threshold_ptr=f32, kept_ptr=f32,
                  prefix_ptr=i32, token_ptr=i64, part_f_ptr=f32, part_i_ptr=i32, mask_ptr=u8,
                  mask_row_stride=1, batch=batch, vocab=vocab, num_chunks=tiles.num_chunks, shift=5,
                  PENALTY=True, GREEDY=sampling.GREEDY_TEMPERATURE, WRITE_MASK=False, CHUNK=tiles.chunk,
                  BLOCK=tiles.block, SEARCH_BLOCK=tiles.search_block, RADIX_BITS=sampling.RADIX_BITS,
                  ROWS=tiles.combine_rows(batch), CHUNKS_POW2=triton.next_power_of_2(tiles.num_chunks))  # fmt: skip
    launches = []
    for name, (pass_kernel, combine_kernel) in sampling.PASSES.items():
        warps = (sampling.SamplingTiles.pass_warps(name), 4)  # the combine: a plain launch's defaults
        for kernel, label, num_warps in zip((pass_kernel, combine_kernel), (name, f"{name} combine"), warps):
            config = triton.Config({}, num_warps=num_warps, num_stages=3)
            args, plan = sampling.kernel_args(kernel, shared), LaunchPlan("sampling", {}, (config,))
            module, function = kernel.fn.__module__, kernel.fn.__name__
            launches.append(Launch("sampling", f"sampling {label}", module, function, args, plan))
    return launches


def _rejection_sampling(vocab: int, k: int = 4) -> list[Launch]:
    """The rejection sampler of a speculative step (kernels/rejection_sampling.py), k drafts per
    sequence, with and without draft probabilities; float32 whatever the model's dtype."""
    import triton

    from stagewise.kernels import rejection_sampling as rs

    f32, i32, i64, u8 = _ptr(torch.float32), _ptr(torch.int32), _ptr(torch.int64), _ptr(torch.uint8)
    out = []
    for has_q in (False, True):
        args = dict(draft_ptr=i64, cu_ptr=i32, q_ptr=f32, q_row_stride=vocab, p_ptr=f32, p_row_stride=vocab)
        # noise per sequence (exp_pos_stride 0); per row swaps the strides: the same specialisation
        args.update(greedy_ptr=u8, uniform_ptr=f32, exp_ptr=f32, exp_seq_stride=vocab, exp_pos_stride=0)
        args.update(out_ptr=i64)
        args.update(out_row_stride=k + 1, count_ptr=i32, vocab=vocab)
        constexprs = dict(HAS_Q=has_q, BLOCK=rs.block_for(vocab))
        plan = LaunchPlan("rejection_sampling", constexprs, (triton.Config({}, num_warps=4, num_stages=3),))
        label = "rejection_sampling" + (" (draft probs)" if has_q else " (point mass)")
        out.append(Launch("rejection_sampling", label, rs.__name__, "_rejection_sample_kernel", args, plan))
    return out


def _attention(
    phase: Phase, heads, kv_heads, d, qkv_width, dtype, target: Target, invariant: bool = False
) -> list[Launch]:
    """FlashAttention (the contiguous-cache path) and paged attention (+ split-K reduce) for this phase;
    invariant: their batch-invariant launches (one tile, keys in KEY_CHUNK chunks, flash unsplit)."""
    x, i32, f32 = _ptr(dtype), _ptr(torch.int32), _ptr(torch.float32)
    group = heads // kv_heads
    sms = SMS.get(target.capability)
    suffix = " batch-invariant" if invariant else ""
    plan = flash_attention_plan(phase.q_len, group, d, dtype, target, invariant)
    splits = 1  # as the launcher: only the (fixed) decode tile splits its keys, never batch-invariant
    if not plan.autotuned and not invariant:
        programs = -(-phase.q_len * group // plan.configs[0].kwargs["BLOCK_M"]) * phase.num_seqs * kv_heads
        splits = choose_num_splits(programs, phase.context, sms)
    flash = dict(q_ptr=x, k_ptr=x, v_ptr=x, out_ptr=f32 if splits > 1 else x, m_part_ptr=f32, l_part_ptr=f32)
    flash.update(cu_seqlens_q_ptr=i32, cu_seqlens_k_ptr=i32, seqused_k_ptr=i32)
    flash.update(qk_scale=0.18, q_len_bucket=_next_power_of_2(phase.q_len))
    flash.update(stride_q_token=qkv_width, stride_q_head=d, stride_k_token=kv_heads * d, stride_k_head=d)
    flash.update(stride_v_token=kv_heads * d, stride_v_head=d, stride_o_token=heads * splits * d)
    flash.update(stride_o_head=splits * d, stride_o_split=d if splits > 1 else 0)
    flash.update(stride_ml_token=heads * splits if splits > 1 else 0, stride_ml_head=splits if splits > 1 else 0)
    flash.update(HAS_SEQUSED_K=phase.name == "decode", NUM_SPLITS=splits, INT64_OFFSETS=False, **_precision(dtype))
    label = f"flash_attention split {splits}" if splits > 1 else "flash_attention"
    label += " (TMA)" if plan.constexprs["TMA"] else ""  # K/V through tensor descriptors (sm_90)
    label += suffix
    launches = [
        Launch("flash_attention", label, "stagewise.kernels.flash_attention", "_flash_attention_kernel", flash, plan)
    ]

    plan = paged_attention_plan(phase.q_len, group, d, dtype, target, invariant)
    num_q_blocks = -(-phase.q_len * group // plan.configs[0].kwargs["BLOCK_M"])
    programs = num_q_blocks * phase.num_seqs * kv_heads
    if invariant:  # one program per chunk of KEY_CHUNK keys, or one for all (as the launcher)
        splits = chunk_splits(programs, phase.context, sms, plan.constexprs["KEY_CHUNK"], None)
    else:
        splits = choose_num_splits(programs, phase.context, sms)
    partial = splits > 1
    paged = dict(q_ptr=x, k_cache_ptr=x, v_cache_ptr=x, out_ptr=f32 if partial else x, m_part_ptr=f32)
    paged.update(l_part_ptr=f32, block_table_ptr=i32, seq_lens_ptr=i32, cu_seqlens_q_ptr=i32, qk_scale=0.18)
    paged.update(stride_q_token=qkv_width, stride_q_head=d, stride_o_token=heads * (splits if partial else 1) * d)
    paged.update(stride_o_head=(splits if partial else 1) * d, stride_o_split=d if partial else 0)
    paged.update(stride_ml_token=heads * splits if partial else 0, stride_ml_head=splits if partial else 0)
    paged.update(stride_bt_row=-(-phase.context // BLOCK_SIZE), stride_slot=kv_heads * d)
    int64 = int64_offsets(plan.configs[0].kwargs["BLOCK_M"])  # as the launcher: no tensor nears 2^31
    paged.update(stride_kv_head=d, BLOCK_SIZE=BLOCK_SIZE, NUM_SPLITS=splits, INT64_OFFSETS=int64)
    paged.update(**_precision(dtype))
    label = (f"paged_attention split {splits}" if partial else "paged_attention") + suffix
    launches.append(
        Launch("paged_attention", label, "stagewise.kernels.paged_attention", "_paged_attention_kernel", paged, plan)
    )
    if partial:
        reduce = dict(acc_part_ptr=f32, m_part_ptr=f32, l_part_ptr=f32, out_ptr=x, NUM_SPLITS=splits)
        reduce.update(stride_a_token=heads * splits * d, stride_a_head=splits * d, stride_a_split=d)
        reduce.update(stride_ml_token=heads * splits, stride_ml_head=splits, stride_o_token=heads * d, stride_o_head=d)
        launches.append(Launch("split_k_reduce", "split_k_reduce" + suffix, "stagewise.kernels.split_k",
                               "_split_k_reduce_kernel", reduce, split_k_reduce_plan(d)))  # fmt: skip
    return launches


def _silu_down(m: int, n: int, k: int, dtype, target: Target) -> Launch:
    """The down projection with silu(gate) * up in its input load (kernels/silu_down.py): the split-K
    decode GEMM's candidates, stages cut for the second A-side tile, as its GPU tuner times them.
    The unfused pair's rows stay: prefill, and sm_75 (not proven there), still launch it."""
    import triton

    from stagewise.kernels import silu_down

    budget = target.shared_memory - matmul_decode.SMEM_HEADROOM
    fma = target.capability < 80
    found = silu_down.candidates(n, k, dtype.itemsize, SMS.get(target.capability, 108), budget, fma)
    meta = lambda c: {"BLOCK_M": matmul_decode.BLOCK_M, "BLOCK_N": c.block_n, "BLOCK_K": c.block_k}  # noqa: E731
    configs = tuple(triton.Config(meta(c), num_warps=c.num_warps, num_stages=c.num_stages) for c in found)
    # as in _matmul: one candidate's K_PER_SPLIT (a multiple of 16) specialises them all alike
    k_per_split, splits = matmul_decode.split_plan(k, found[0].block_k, found[0].split_k)
    x = _ptr(dtype)
    args = dict(gate_up_ptr=x, b_ptr=x, out_ptr=_ptr(torch.float32) if splits > 1 else x, c_ptr=x)
    args.update(counter_ptr=_ptr(torch.int32), M=m, N=n, K=k, K_PER_SPLIT=k_per_split, stride_gm=2 * k)
    args.update(stride_bk=n, stride_bn=1, stride_os=m * n if splits > 1 else 0, stride_om=n, stride_on=1)
    args.update(stride_cm=n, stride_cn=1, INTERPRETED=False, FUSED_SUM=splits > 1, **_precision(dtype))
    plan = LaunchPlan("silu_down", {}, configs)
    return Launch("silu_down", "silu_down (split-K)", "stagewise.kernels.silu_down", "_silu_down_kernel", args, plan)


def _norm_matmul(m: int, n: int, k: int, dtype, target: Target) -> Launch:
    """attn_norm fused into qkv_proj's input load (kernels/norm_matmul.py): the split-K decode GEMM's
    candidates, stages cut for the residual's A-side tile, as its GPU tuner times them. Prefill keeps
    rmsnorm + matmul."""
    import triton

    from stagewise.kernels import norm_matmul

    budget = target.shared_memory - matmul_decode.SMEM_HEADROOM
    fma = target.capability < 80
    found = norm_matmul.candidates(n, k, dtype.itemsize, SMS.get(target.capability, 108), budget, fma)
    meta = lambda c: {"BLOCK_M": matmul_decode.BLOCK_M, "BLOCK_N": c.block_n, "BLOCK_K": c.block_k}  # noqa: E731
    configs = tuple(triton.Config(meta(c), num_warps=c.num_warps, num_stages=c.num_stages) for c in found)
    k_per_split, splits = matmul_decode.split_plan(k, found[0].block_k, found[0].split_k)  # as in _matmul
    x = _ptr(dtype)
    args = dict(x_ptr=x, stride_xm=k, residual_ptr=x, stride_rm=k, residual_out_ptr=x, norm_w_ptr=x, b_ptr=x)
    args.update(out_ptr=_ptr(torch.float32) if splits > 1 else x, c_ptr=x, counter_ptr=_ptr(torch.int32))
    args.update(M=m, N=n, K=k, K_PER_SPLIT=k_per_split, eps=1e-5, stride_bk=n, stride_bn=1)
    args.update(stride_os=m * n if splits > 1 else 0, stride_om=n, stride_on=1, stride_cm=n, stride_cn=1)
    args.update(HAS_RESIDUAL=True, INTERPRETED=False, FUSED_SUM=splits > 1, **_precision(dtype))
    plan = LaunchPlan("norm_matmul", {}, configs)
    label = "rmsnorm+qkv_proj (split-K)"
    return Launch("norm_matmul", label, "stagewise.kernels.norm_matmul", "_norm_matmul_kernel", args, plan)


def _rope_kv_store(tokens: int, heads: int, kv_heads: int, d: int, qkv_width: int, dtype) -> Launch:
    """RoPE with the paged KV store (kernels/rope_kv_store.py): rope's fixed tiles, q/k/v views of QKV."""
    x = _ptr(dtype)
    args = dict(positions_ptr=_ptr(torch.int64), slot_mapping_ptr=_ptr(torch.int64), cos_sin_ptr=_ptr(torch.float32))
    for name in ("q", "k", "v"):
        args.update({f"{name}_ptr": x, f"{name}_token_stride": qkv_width, f"{name}_head_stride": d})
    args.update(k_cache_ptr=x, v_cache_ptr=x, cos_sin_row_stride=d, num_tokens=tokens, num_heads=heads)
    args.update(num_kv_heads=kv_heads)
    rope_heads, tile = rope_tiles(tokens, heads, kv_heads, d)
    plan = _row_plan("rope_kv_store", rope_heads, [tile])
    return Launch(
        "rope_kv_store", "rope+kv_store", "stagewise.kernels.rope_kv_store", "_rope_kv_store_kernel", args, plan
    )
