"""Checks for the exercises of notebooks 00-07: one stage each, against its naive reference.

Every check takes the student's function, runs it and the reference on seeded
inputs (the `tiny` preset's shapes and vocabulary, so a check costs
milliseconds), and returns a summary or raises `Mismatch` (see core.py).
"""

import functools

import torch

from stagewise.calc.counts import kv_bytes_per_token
from stagewise.config import PRESETS
from stagewise.exercises.core import Mismatch, call, call_recording_kernels, close, equal
from stagewise.models.forward_batch import ForwardBatch
from stagewise.sampling_params import SamplingParams
from stagewise.stages import STAGES
from stagewise.stages.attention_metadata import AttentionMetadata
from stagewise.stages.ffn import silu_and_mul_naive
from stagewise.stages.qkv_proj import split_qkv
from stagewise.stages.rope import build_cos_sin_cache
from stagewise.stages.sampling import SamplingTensors, apply_min_p, apply_top_k, processed_probs
from stagewise.stages.tokenize import bpe_merge, bytes_to_unicode, piece_to_ids, pre_tokenize
from stagewise.tokenizer.train import TINY_CORPUS, train_bpe

TINY = PRESETS["tiny"]


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@functools.cache
def tiny_tokenizer():
    """The tiny model's 512-token byte-level BPE vocabulary (trained on TINY_CORPUS, well under a second)."""
    from stagewise.tokenizer import Tokenizer

    return Tokenizer.tiny()


# ---------------------------------------------------------------- 00 the pipeline

BATCHES = [([37], [0]), ([3, 5, 2], [0, 0, 0]), ([1, 1, 1], [36, 12, 7]), ([6, 1], [0, 20])]


def check_cu_seqlens(fn) -> str:
    """my_cu_seqlens(lengths) -> [B+1] offsets where each sequence's rows start."""
    for lengths, starts in BATCHES:
        seqs = [[0] * n for n in lengths]
        want = ForwardBatch.from_sequences(seqs, starts, "cpu").cu_seqlens_q_host
        equal(call(fn, list(lengths)), want, f"cu_seqlens for lengths {lengths}")
    return f"{len(BATCHES)} batches agree with ForwardBatch.from_sequences"


def check_positions(fn) -> str:
    """my_positions(lengths, start_positions) -> [T] position of every row of the flat batch."""
    for lengths, starts in BATCHES:
        seqs = [[0] * n for n in lengths]
        want = ForwardBatch.from_sequences(seqs, starts, "cpu").positions.tolist()
        equal(call(fn, list(lengths), list(starts)), want, f"positions for lengths {lengths}, starts {starts}")
    return f"{len(BATCHES)} batches (prefill, decode, mixed) agree with ForwardBatch.from_sequences"


def greedy_sampling(num_seqs: int, vocab: int) -> SamplingTensors:
    params = [SamplingParams(temperature=0)] * num_seqs
    seen = torch.zeros(num_seqs, vocab, dtype=torch.bool)
    return SamplingTensors.from_params(params, seen, [0] * num_seqs, [0] * num_seqs, "cpu")


def check_greedy(fn) -> str:
    """my_greedy(logits [B, V]) -> [B] ids: the sampling stage at temperature 0."""
    logits = torch.randn(4, TINY.vocab_size, generator=_gen(1)) * 3
    want = STAGES["sampling"].naive(logits=logits, sampling=greedy_sampling(4, TINY.vocab_size))
    equal(torch.as_tensor(call(fn, logits.clone())), want, "greedy ids")
    return "4 rows of logits give the sampling stage's greedy ids"


# ---------------------------------------------------------------- 01 tokenize

WORDS = [" the", " tokenization", " baker", " mountains", "Hello", " 大模型", " zyzzyva", " don't"]


def spelled(piece: str) -> list[str]:
    byte_map = bytes_to_unicode()
    return [byte_map[b] for b in piece.encode("utf-8")]


def check_bpe_merge(fn) -> str:
    """my_bpe_merge(symbols, merge_ranks) -> symbols after merging the lowest-rank pair until none is left."""
    ranks = tiny_tokenizer().merge_ranks
    for word in WORDS:
        equal(call(fn, spelled(word), dict(ranks)), bpe_merge(spelled(word), ranks), f"merges of {word!r}")
    return f"{len(WORDS)} words merge like stages.tokenize.bpe_merge (tiny vocabulary)"


def check_piece_to_ids(fn) -> str:
    """my_piece_to_ids(piece, tokenizer) -> ids of one pre-tokenized piece."""
    tok = tiny_tokenizer()
    pieces = pre_tokenize("The baker's daughter sold 12 loaves; naïve 大模型!", tok.pre)
    for piece in pieces:
        equal(call(fn, piece, tok), list(piece_to_ids(piece, tok)), f"ids of the piece {piece!r}")
    return f"{len(pieces)} pieces get the tokenize stage's ids (tiny vocabulary)"


CORPORA = [TINY_CORPUS, "aaabdaaabac aaabdaaabac", "low lower lowest newer wider new"]


def check_first_merge(fn) -> str:
    """my_first_merge(corpus) -> the first pair BPE training learns (most frequent; ties: the smaller pair)."""
    for corpus in CORPORA:
        want = train_bpe(corpus, 1)[0]
        equal(tuple(call(fn, corpus)), want, f"first merge of {corpus[:30]!r}...")
    return f"{len(CORPORA)} corpora: the same first merge as tokenizer.train.train_bpe"


# ---------------------------------------------------------------- 02 embedding and RMSNorm


def _norm_inputs(seed: int):
    g = _gen(seed)
    x = torch.randn(5, TINY.hidden_size, generator=g) * torch.logspace(-2, 3, 5)[:, None]  # rows of any scale
    residual = torch.randn(5, TINY.hidden_size, generator=g)
    weight = 1 + 0.1 * torch.randn(TINY.hidden_size, generator=g)
    return x, residual, weight


def _rounded_like(got, want: torch.Tensor, what: str) -> None:
    """Raise Mismatch unless a half-precision `got` is `want` up to one rounding step per value.

    The reference accumulates and scales in float32 and rounds once, at the end.
    The same maths in bfloat16 / float16 rounds at every op, and some values land
    two or more steps away (float16 squares of values near 1000 even overflow).
    """
    if not isinstance(got, torch.Tensor) or got.dtype != want.dtype:
        kind = got.dtype if isinstance(got, torch.Tensor) else type(got).__name__
        raise Mismatch(f"{what}: got {kind}, expected a {want.dtype} tensor (cast back to the input's dtype)")
    close(got, want, what, atol=1e-2, rtol=1e-2)  # the shape, and no value far off
    w = want.float().abs()
    step = torch.nextafter(want.abs(), torch.full_like(want, float("inf"))).float() - w  # one rounding step
    steps = (got.float() - want.float()).abs() / step
    if (steps > 1.01).any():
        raise Mismatch(
            f"{what}: {int((steps > 1.01).sum())} of {want.numel()} values are {float(steps.max()):.0f} "
            "rounding steps from the reference; compute the norm on x.float() and cast back before the weight"
        )


def check_rmsnorm(fn) -> str:
    """my_rmsnorm(x, weight, eps) -> weight * x / sqrt(mean(x^2) + eps), per row, accumulated in float32."""
    for seed, eps in [(0, 1e-5), (1, 0.5)]:
        x, _, weight = _norm_inputs(seed)
        want, _ = STAGES["rmsnorm"].naive(x=x, weight=weight, eps=eps)
        close(call(fn, x.clone(), weight, eps), want, f"rmsnorm (eps {eps})", atol=1e-5, rtol=1e-4)
    for seed, dtype in [(2, torch.bfloat16), (3, torch.float16)]:
        x, _, weight = (t.to(dtype) for t in _norm_inputs(seed))
        want, _ = STAGES["rmsnorm"].naive(x=x, weight=weight, eps=1e-5)
        _rounded_like(call(fn, x.clone(), weight, 1e-5), want, f"rmsnorm of {dtype} rows")
    return "rows from 0.01 to 1000 in scale, two eps, float32 / bfloat16 / float16: equal to the rmsnorm stage"


def check_add_rmsnorm(fn) -> str:
    """my_add_rmsnorm(x, residual, weight, eps) -> (rmsnorm(x + residual), x + residual)."""
    x, residual, weight = _norm_inputs(2)
    want_out, want_res = STAGES["rmsnorm"].naive(x=x, weight=weight, eps=1e-5, residual=residual)
    got = call(fn, x.clone(), residual.clone(), weight, 1e-5)
    if not isinstance(got, tuple) or len(got) != 2:
        raise Mismatch("return a pair (normed, new_residual)")
    close(got[0], want_out, "normed", atol=1e-5, rtol=1e-4)
    close(got[1], want_res, "new residual", atol=0, rtol=0)
    return "the fused residual add + norm equals the rmsnorm stage with residual="


def check_embedding(fn) -> str:
    """my_embedding(ids, weight) -> weight rows [T, hidden]."""
    weight = torch.randn(TINY.vocab_size, TINY.hidden_size, generator=_gen(3))
    ids = torch.tensor([0, 7, 7, TINY.vocab_size - 1, 42])
    want = STAGES["embedding"].naive(ids=ids, weight=weight)
    close(call(fn, ids, weight), want, "embedding rows", atol=0, rtol=0)
    return "5 ids (repeats, first and last row) equal to the embedding stage"


# ---------------------------------------------------------------- 03 fused QKV and GQA


def check_split_qkv(fn) -> str:
    """my_split_qkv(qkv, num_heads, num_kv_heads, head_dim) -> q [T, H, d], k, v [T, Hkv, d], views of qkv."""
    for cfg in (TINY, PRESETS["smollm2-135m"]):
        qkv = torch.randn(4, cfg.qkv_size, generator=_gen(4))
        got = call(fn, qkv, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        if not isinstance(got, tuple) or len(got) != 3:
            raise Mismatch("return a triple (q, k, v)")
        for name, g, w in zip("qkv", got, split_qkv(qkv, cfg)):
            close(g, w, f"{name} ({cfg.name})", atol=0, rtol=0)
            if g.untyped_storage().data_ptr() != qkv.untyped_storage().data_ptr():
                raise Mismatch(f"{name} is a copy: cut qkv with views (split / view), no copy")
    return "tiny and SmolLM2 shapes: the same views as stages.qkv_proj.split_qkv"


def check_repeat_kv(fn) -> str:
    """my_repeat_kv(kv [T, Hkv, d], num_heads) -> [T, H, d] copies such that MHA on them equals GQA."""
    g = _gen(5)
    T, H, Hkv, d = 9, TINY.num_heads, TINY.num_kv_heads, TINY.head_dim
    q = torch.randn(T, H, d, generator=g)
    k, v = torch.randn(T, Hkv, d, generator=g), torch.randn(T, Hkv, d, generator=g)
    one_seq = AttentionMetadata.over_batch(torch.tensor([0, T], dtype=torch.int32))
    attention = STAGES["attention"].naive
    want = attention(q=q, k=k, v=v, metadata=one_seq, scale=d**-0.5)
    k_full, v_full = call(fn, k, H), call(fn, v, H)
    close(k_full, k.repeat_interleave(H // Hkv, dim=1), "repeated keys (query head h reads KV head h // group)", 0, 0)
    got = attention(q=q, k=k_full, v=v_full, metadata=one_seq, scale=d**-0.5)
    close(got, want, "attention over your copies vs GQA by index map", atol=1e-6)
    return "MHA on your copied K/V equals the attention stage's GQA index map"


def check_kv_bytes_per_token(fn) -> str:
    """my_kv_bytes_per_token(cfg, dtype_bytes) -> bytes of K and V per token, all layers."""
    for name, cfg in PRESETS.items():
        for dtype_bytes in (2, 4):
            equal(call(fn, cfg, dtype_bytes), kv_bytes_per_token(cfg, dtype_bytes).value, f"{name}, {dtype_bytes} B")
    return f"{len(PRESETS)} presets x 2 dtypes agree with the calculator"


# ---------------------------------------------------------------- 04 RoPE

CACHES = [(64, 16, 10000.0), (128, 64, 100000.0), (32, 128, 500000.0)]


def check_cos_sin_cache(fn) -> str:
    """my_cos_sin_cache(max_position, rotary_dim, theta) -> [max_position, rotary_dim]: cos half, sin half."""
    for max_pos, dim, theta in CACHES:
        want = build_cos_sin_cache(max_pos, dim, theta)
        close(call(fn, max_pos, dim, theta), want, f"cache ({max_pos}, {dim}, theta {theta:g})", atol=1e-4, rtol=1e-4)
    return f"{len(CACHES)} caches equal stages.rope.build_cos_sin_cache"


def check_rope(fn) -> str:
    """my_rope(positions, x [T, heads, d], cos_sin_cache) -> x rotated (rotate-half convention)."""
    g = _gen(6)
    d = TINY.head_dim
    cache = build_cos_sin_cache(64, d, TINY.rope_theta)
    positions = torch.tensor([0, 1, 2, 17, 63, 5])
    q = torch.randn(6, TINY.num_heads, d, generator=g)
    k = torch.randn(6, TINY.num_kv_heads, d, generator=g)
    want_q, want_k = STAGES["rope"].naive(positions=positions, q=q, k=k, cos_sin_cache=cache)
    close(call(fn, positions, q.clone(), cache), want_q, "rotated q", atol=1e-5)
    close(call(fn, positions, k.clone(), cache), want_k, "rotated k", atol=1e-5)
    return "q and k at 6 positions equal the rope stage"


# ---------------------------------------------------------------- 05 attention


def check_causal_attention(fn) -> str:
    """my_causal_attention(q [L, H, d], k [L, Hkv, d], v, scale) -> [L, H, d], causal, GQA by index map."""
    g = _gen(7)
    attention = STAGES["attention"].naive
    for L in (1, 5, 19):
        H, Hkv, d = TINY.num_heads, TINY.num_kv_heads, TINY.head_dim
        q = torch.randn(L, H, d, generator=g)
        k, v = torch.randn(L, Hkv, d, generator=g), torch.randn(L, Hkv, d, generator=g)
        one_seq = AttentionMetadata.over_batch(torch.tensor([0, L], dtype=torch.int32))
        want = attention(q=q, k=k, v=v, metadata=one_seq, scale=d**-0.5)
        close(call(fn, q, k, v, d**-0.5), want, f"attention of {L} tokens", atol=1e-5)
    return "1, 5 and 19 tokens (GQA 3:1): equal to the attention stage"


def check_online_softmax(fn) -> str:
    """my_online_step(m [R], l [R], acc [R, d], scores [R, n], values [n, d]) -> (m, l, acc) after one tile.

    The check owns the loop: it starts from m = -inf, l = 0, acc = 0, hands your
    function one tile of keys at a time (tiles of uneven sizes) and compares the
    state after every tile with the softmax statistics of the keys seen so far,
    so a function that only sees the current tile cannot pass by taking a full
    softmax of it.
    """
    g = _gen(8)
    for rows, n, tiles in [(3, 20, [8, 8, 4]), (5, 33, [4, 1, 16, 12]), (2, 7, [7])]:
        scores = torch.randn(rows, n, generator=g, dtype=torch.float64) * 4
        scores[0, n // 2 :] = float("-inf")  # a row with masked keys, as under the causal mask
        values = torch.randn(n, 6, generator=g, dtype=torch.float64)
        m = torch.full((rows,), float("-inf"), dtype=torch.float64)
        l, acc = torch.zeros(rows, dtype=torch.float64), torch.zeros(rows, 6, dtype=torch.float64)  # noqa: E741
        end = 0
        for size in tiles:
            start, end = end, end + size
            got = call(fn, m.clone(), l.clone(), acc.clone(), scores[:, start:end].clone(), values[start:end])
            if not isinstance(got, tuple) or len(got) != 3:
                raise Mismatch("return a triple (m, l, acc): the state after this tile")
            m, l, acc = got  # noqa: E741
            seen = scores[:, :end]  # [R, end]: every key folded in so far
            m_want = seen.max(dim=1).values
            p = torch.exp(seen - m_want[:, None])  # [R, end]
            where = f"{rows}x{n} scores, after the tile of keys {start}..{end - 1}"
            close(m, m_want, f"m {where}", atol=1e-12)
            close(l, p.sum(dim=1), f"l {where}", atol=1e-9)
            close(acc, p @ values[:end], f"acc {where}", atol=1e-9)
        close(acc / l[:, None], torch.softmax(scores, dim=1) @ values, f"acc / l ({rows}x{n})", atol=1e-9)
    return "3 score matrices (one row half masked), tiles of uneven sizes: the state equals softmax of the keys so far"


# ---------------------------------------------------------------- 06 FFN


def check_silu_and_mul(fn) -> str:
    """my_silu_and_mul(gate_up [T, 2*inter]) -> silu(gate) * up [T, inter], silu written out (no F.silu)."""
    gate_up = torch.randn(7, 2 * TINY.intermediate_size, generator=_gen(9)) * 4
    got, ops = call_recording_kernels(fn, gate_up.clone())
    close(got, silu_and_mul_naive(gate_up), "silu(gate) * up", atol=1e-5)
    if "silu" in ops:  # F.silu, nn.SiLU, torch.ops.aten.silu, the stage's own function: one operator underneath
        raise Mismatch("the values are right but PyTorch's silu computed them: write silu(g) = g * sigmoid(g) out")
    return "7 rows equal stages.ffn.silu_and_mul_naive, with silu written out"


def check_ffn(fn) -> str:
    """my_ffn(x, w_gate_up, w_down) -> [T, hidden]."""
    inputs = STAGES["ffn"].example_inputs(TINY, 6, torch.device("cpu"), torch.float32)
    want = STAGES["ffn"].naive(**inputs)
    close(call(fn, inputs["x"], inputs["w_gate_up"], inputs["w_down"]), want, "ffn output", atol=1e-4, rtol=1e-4)
    return "the ffn stage's example inputs give its output"


# ---------------------------------------------------------------- 07 LM head and sampling


def _sampling(num_seqs: int, vocab: int, **kwargs) -> SamplingTensors:
    params = [SamplingParams(**kwargs)] * num_seqs
    seen = torch.zeros(num_seqs, vocab, dtype=torch.bool)
    return SamplingTensors.from_params(params, seen, [0] * num_seqs, [0] * num_seqs, "cpu")


def _probs(seed: int) -> torch.Tensor:
    logits = torch.randn(3, TINY.vocab_size, generator=_gen(seed)) * 2
    logits[1, :4] = 9.0  # a row with a four-way tie at the top
    return torch.softmax(logits, dim=-1)


def check_temperature(fn) -> str:
    """my_softmax_temperature(logits [B, V], temperature) -> probs [B, V]."""
    logits = torch.randn(3, TINY.vocab_size, generator=_gen(10)) * 3
    for t in (0.3, 1.0, 2.5):
        want = processed_probs(logits, _sampling(3, TINY.vocab_size, temperature=t))
        close(call(fn, logits.clone(), t), want, f"probs at temperature {t}", atol=1e-6)
    return "3 temperatures equal stages.sampling.processed_probs"


def check_top_k(fn) -> str:
    """my_top_k(probs [B, V], k) -> probs outside the k most likely zeroed, renormalised (ties at the k-th kept)."""
    probs = _probs(11)
    for k in (1, 3, 50):
        want = apply_top_k(probs, torch.full((3,), k))
        close(call(fn, probs.clone(), k), want, f"top_k={k}", atol=1e-6)
    return "k = 1, 3, 50 (with a tie at the top) equal stages.sampling.apply_top_k"


def check_min_p(fn) -> str:
    """my_min_p(probs [B, V], min_p) -> probs below min_p * max prob zeroed, renormalised."""
    probs = _probs(12)
    for min_p in (0.05, 0.3, 0.9):
        want = apply_min_p(probs, torch.full((3,), min_p))
        close(call(fn, probs.clone(), min_p), want, f"min_p={min_p}", atol=1e-6)
    return "min_p = 0.05, 0.3, 0.9 equal stages.sampling.apply_min_p"


CHECKS = {
    "00.cu_seqlens": check_cu_seqlens,
    "00.positions": check_positions,
    "00.greedy": check_greedy,
    "01.bpe_merge": check_bpe_merge,
    "01.piece_to_ids": check_piece_to_ids,
    "01.first_merge": check_first_merge,
    "02.rmsnorm": check_rmsnorm,
    "02.add_rmsnorm": check_add_rmsnorm,
    "02.embedding": check_embedding,
    "03.split_qkv": check_split_qkv,
    "03.repeat_kv": check_repeat_kv,
    "03.kv_bytes_per_token": check_kv_bytes_per_token,
    "04.cos_sin_cache": check_cos_sin_cache,
    "04.rope": check_rope,
    "05.causal_attention": check_causal_attention,
    "05.online_softmax": check_online_softmax,
    "06.silu_and_mul": check_silu_and_mul,
    "06.ffn": check_ffn,
    "07.temperature": check_temperature,
    "07.top_k": check_top_k,
    "07.min_p": check_min_p,
}
