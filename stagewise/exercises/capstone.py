"""The capstone: an engine the student writes, over the parts the student wrote in notebooks 00-12a.

The student writes one engine step (notebook 16), `step(engine, running, waiting)`, the package's
plain step in five moves: schedule -> build the batch -> forward -> sample -> settle. `Engine`
holds what a step works on, and each of its pieces is one of the student's answers (`PARTS`):

    schedule       the student's schedule() (10) over `allocate` and `free`: the student's block
                   allocator (09) over a pool of KV blocks; a request's first allocation starts
                   from the blocks the student's prefix lookup (09) finds
    the batch      the student's cu_seqlens and positions (00)
    forward        the package's Llama forward pass (`LlamaModel`, the one `LLM()` runs) on the
                   student's stages: embedding (02), RoPE on the student's cos/sin cache (04),
                   every RMSNorm by the student's Triton kernel (12a) after the residual add, the
                   FFN's silu(gate) * up by the student's Triton kernel (12a); attention over the
                   paged pool, new K/V stored at the student's slots (09): a whole prompt through
                   the student's causal attention (05), a chunk through the student's online-softmax
                   tile step (05), a decode token through the student's KV-cache attention (08), GQA
                   by the student's repeat_kv (03). The GEMMs of qkv, o, the FFN and the LM head
                   are the naive stages (nobody writes a matmul by hand)
    sample         the student's greedy (00)

`capstone_checks.py` runs the student's step beside `LLM()` and compares every step.
"""

from collections import deque
from dataclasses import dataclass, field

import torch

from stagewise.exercises.core import Mismatch
from stagewise.exercises.kernel_checks import run_rmsnorm, run_silu_and_mul
from stagewise.kv.access import KVAccess
from stagewise.kv.block_manager import block_digest
from stagewise.models.forward_batch import ForwardBatch
from stagewise.models.llama import LlamaModel
from stagewise.models.ops import StageOps
from stagewise.stages import STAGES
from stagewise.stages.base import stage_of

PARTS = {  # what the engine calls -> the exercise whose answer it is
    "cu_seqlens": "00.cu_seqlens",
    "positions": "00.positions",
    "greedy": "00.greedy",
    "embedding": "02.embedding",
    "repeat_kv": "03.repeat_kv",
    "cos_sin_cache": "04.cos_sin_cache",
    "rope": "04.rope",
    "causal_attention": "05.causal_attention",
    "online_step": "05.online_softmax",
    "cached_attention": "08.cached_attention",
    "slot_mapping": "09.slot_mapping",
    "allocate": "09.allocate",
    "free": "09.free",
    "cached_prefix": "09.cached_prefix",
    "schedule": "10.schedule_step",
    "rmsnorm_kernel": "12a.rmsnorm",
    "silu_and_mul_kernel": "12a.silu_and_mul",
}
MAX_CALLS_PER_STEP = 10_000  # allocate/free calls in one step: beyond this a loop waits for room that never comes


class Parts:
    """The engine's parts by role (`parts.schedule`, ...), each an exercise answer."""

    def __init__(self, answers: dict):
        missing = [name for name in PARTS.values() if name not in answers]
        if missing:
            raise KeyError(f"the capstone needs these exercises' answers too: {', '.join(missing)}")
        for role, name in PARTS.items():
            setattr(self, role, answers[name])


@dataclass
class Seq:
    """A request as the student's step sees it."""

    request_id: str
    token_ids: list[int]  # prompt, then each generated token the model still reads (a final one never)
    max_tokens: int  # tokens to generate
    num_computed_tokens: int = 0  # tokens whose K/V are in the pool
    generated: list[int] = field(default_factory=list)  # the tokens sampled so far

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class StudentOps(StageOps):
    """The stage-ops object the model calls: the student's functions and kernels where there is one.

    fuse=False: the student's stages are separate functions, the model never fuses two of them.
    """

    def __init__(self, parts: Parts):
        super().__init__("naive", fuse=False)
        self.parts, self.naive = parts, StageOps("naive")
        self.calls: dict[str, int] = {}  # stage -> calls answered by the student's code

    def __call__(self, stage, layer: int | None = None, **kw):
        name, p = stage_of(stage, STAGES).name, self.parts
        if name == "embedding":
            out = p.embedding(kw["ids"], kw["weight"])
        elif name == "rmsnorm":
            h = kw["x"] if kw.get("residual") is None else kw["x"] + kw["residual"]  # the residual stream
            out = (run_rmsnorm(p.rmsnorm_kernel, h, kw["weight"], kw["eps"]).to(h.dtype), h)
        elif name == "rope":
            pos, cache = kw["positions"], kw["cos_sin_cache"]
            out = (p.rope(pos, kw["q"], cache), p.rope(pos, kw["k"], cache))
        elif name == "ffn":
            gate_up = kw["x"] @ kw["w_gate_up"]  # [T, hidden] @ [hidden, 2*inter] -> [T, 2*inter]
            inter = gate_up.shape[1] // 2
            block = 1 << (inter - 1).bit_length()  # one program per row
            out = run_silu_and_mul(p.silu_and_mul_kernel, gate_up, block).to(gate_up.dtype) @ kw["w_down"]
        else:  # the GEMMs (qkv_proj, o_proj, lm_head): the naive stage
            return self.naive(stage, layer=layer, **kw)
        self.calls[name] = self.calls.get(name, 0) + 1
        return out


class PagedAttention(KVAccess):
    """One forward pass's attention over the pool, through the student's slots and attention."""

    def __init__(self, engine: "Engine", seqs: list[Seq], counts: list[int]):
        self.engine, self.spans, self.new_slots, self.all_slots = engine, [], [], []
        for seq, n in zip(seqs, counts):
            start, row = seq.num_computed_tokens, engine.rows.get(seq.request_id, [])
            self.spans.append((start, start + n))
            slots = engine.parts.slot_mapping(list(row), list(range(start + n)), engine.block_size)
            self.all_slots.append(torch.as_tensor(slots, dtype=torch.long))  # [start + n]
            self.new_slots.append(self.all_slots[-1][start:])  # [n]: where this step's K/V go

    def attend(self, ops, layer: int, q, k, v, scale):  # q [T, H, d], k, v [T, Hkv, d]
        e, p = self.engine, self.engine.parts
        k_pool, v_pool = e.k_pool[layer], e.v_pool[layer]  # [num_blocks * block_size, Hkv, d]
        out, row0 = torch.empty_like(q), 0
        for (start, end), new, every in zip(self.spans, self.new_slots, self.all_slots):
            rows = slice(row0, row0 + end - start)
            if start == 0:  # a whole prompt: queries and keys coincide
                k_pool[new], v_pool[new] = k[rows], v[rows]
                out[rows] = p.causal_attention(q[rows], k_pool[every], v_pool[every], scale)
            elif end - start == 1:  # a decode token: 08's cache, filled from the pool, takes its K/V
                cache = {layer: {"k": k_pool[every[:-1]], "v": v_pool[every[:-1]]}}
                out[rows] = p.cached_attention(cache, layer, q[rows], k[rows], v[rows], scale)
                k_pool[new], v_pool[new] = cache[layer]["k"][-1:], cache[layer]["v"][-1:]
            else:  # a chunk: the online softmax over the cached keys and its own
                k_pool[new], v_pool[new] = k[rows], v[rows]
                out[rows] = self._online(q[rows], k_pool[every], v_pool[every], scale, start)
            row0 += end - start
        return out

    def _online(self, q, keys, values, scale, start, tile: int = 16):
        p, heads = self.engine.parts, q.shape[1]
        keys, values = p.repeat_kv(keys, heads), p.repeat_kv(values, heads)  # [N, H, d]
        visible = torch.arange(keys.shape[0])[None, :] <= torch.arange(start, start + q.shape[0])[:, None]
        out = torch.empty_like(q)
        for h in range(heads):
            scores = (q[:, h].float() @ keys[:, h].float().T * scale).masked_fill(~visible, float("-inf"))
            m = torch.full((q.shape[0],), float("-inf"))  # [R] running max
            l, acc = torch.zeros(q.shape[0]), torch.zeros(q.shape[0], q.shape[2])  # noqa: E741
            for t in range(0, keys.shape[0], tile):  # key 0 is in the first tile: every row's m is finite
                m, l, acc = p.online_step(m, l, acc, scores[:, t : t + tile], values[t : t + tile, h].float())  # noqa: E741
            out[:, h] = (acc / l[:, None]).to(q.dtype)
        return out


class Engine:
    """What the student's step works on: the pool, the block-table rows, the model on the student's parts."""

    def __init__(self, loaded, parts: Parts, num_blocks: int, block_size: int, budget: int, seats: int,
                 prefix_caching: bool = True):  # fmt: skip
        cfg = loaded.config
        self.parts, self.block_size, self.budget, self.seats = parts, block_size, budget, seats
        self.prefix_caching = prefix_caching
        self.ops = StudentOps(parts)
        self.model = LlamaModel(loaded, self.ops)
        self.model.cos_sin_cache = parts.cos_sin_cache(cfg.max_position_embeddings, cfg.rotary_dim, cfg.rope_theta)
        shape = (cfg.num_layers, num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k_pool = torch.zeros(shape, dtype=loaded.dtype)  # [L, slots, Hkv, d]
        self.v_pool = torch.zeros(shape, dtype=loaded.dtype)
        self.free_queue, self.ref_counts = deque(range(num_blocks)), [0] * num_blocks
        self.rows: dict[str, list[int]] = {}  # request id -> its block-table row
        self.cached: dict[bytes, int] = {}  # chained digest of a full block's prefix -> the block holding it
        self.block_hash: list[bytes | None] = [None] * num_blocks  # block -> the digest it is cached under
        self.seqs: dict[str, Seq] = {}  # every request, by id
        self.forwarded: list[tuple[str, int]] = []  # this step's forward pass: (request id, tokens)
        self.calls = 0  # allocate and free calls in this step

    def _count_call(self) -> None:
        self.calls += 1
        if self.calls > MAX_CALLS_PER_STEP:
            raise Mismatch(f"allocate and free called {MAX_CALLS_PER_STEP} times in one step: a loop waiting forever?")

    def allocate(self, seq: Seq, n: int) -> bool:
        """Room for n more tokens of seq (your 09 allocate); a first allocation starts from the cached prefix.

        The prefix's tokens count as computed at once (their K/V are in the pool): the step computes
        only min(n, seq.num_tokens - seq.num_computed_tokens) of what the scheduler gave.
        """
        self._count_call()
        row = self.rows.setdefault(seq.request_id, [])
        first = self.prefix_caching and not row and seq.num_computed_tokens == 0  # admitted now
        if first:
            for block in self.parts.cached_prefix(list(seq.token_ids), self.block_size, dict(self.cached)):
                if self.ref_counts[block] == 0:  # cached but free: take it back from the free queue
                    self.free_queue.remove(block)
                self.ref_counts[block] += 1  # shared: the request that wrote it may still hold it
                row.append(block)
            seq.num_computed_tokens = len(row) * self.block_size  # their K/V are in the pool already
            n = min(n, seq.num_tokens - seq.num_computed_tokens)  # >= 1: a hit never covers the last token
        owned = len(row)
        got = self.parts.allocate(self.free_queue, self.ref_counts, row, seq.num_computed_tokens + n, self.block_size)
        if got is False:
            if first:  # no room: give the hits back, the request waits as it was
                self.free(seq)
                seq.num_computed_tokens = 0
            return False
        for block in row[owned:]:  # a reused free block forgets the prefix it held
            if self.block_hash[block] is not None and self.cached.get(self.block_hash[block]) == block:
                del self.cached[self.block_hash[block]]
            self.block_hash[block] = None
        return True

    def free(self, seq: Seq) -> None:
        """Give back every block seq holds (your 09 free)."""
        self._count_call()
        self.parts.free(self.free_queue, self.ref_counts, self.rows.setdefault(seq.request_id, []))
        del self.rows[seq.request_id]

    def name_blocks(self, seq: Seq) -> None:
        """Name every full block of seq's computed tokens by its chained digest, as 09's lookup reads it."""
        if not self.prefix_caching:
            return
        parent, row = None, self.rows[seq.request_id]
        for i in range(seq.num_computed_tokens // self.block_size):
            parent = block_digest(parent, seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            if parent not in self.cached and self.block_hash[row[i]] is None:  # the first copy is the one
                self.cached[parent], self.block_hash[row[i]] = row[i], parent

    @torch.inference_mode()
    def forward(self, seqs: list[Seq], counts: list[int], ids: list[int], positions, cu_seqlens) -> torch.Tensor:
        """The model over the flat batch: `counts[i]` tokens of `seqs[i]` from its num_computed_tokens on.

        ids [T], positions [T] and cu_seqlens [B+1] as the student built them. -> logits [B, vocab],
        one row per request: its batch's last token. The K/V of the batch go to the pool.
        """
        cu = [int(c) for c in cu_seqlens]
        if len(ids) != sum(counts) or len(cu) != len(counts) + 1:
            raise Mismatch(f"a batch of {len(ids)} ids for counts {counts} with cu_seqlens {cu}")
        self.forwarded = [(s.request_id, n) for s, n in zip(seqs, counts)]
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long),
            positions=torch.as_tensor(positions, dtype=torch.long),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
            last_token_index=torch.tensor([c - 1 for c in cu[1:]], dtype=torch.long),
            cu_seqlens_q_host=cu,
            max_q_len=max(counts),
        )
        return self.model.forward(batch, PagedAttention(self, seqs, counts))  # [B, vocab]
