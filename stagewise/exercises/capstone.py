"""The capstone: an engine assembled from the student's own exercise functions.

`StudentParts` holds one function per job, each the answer to an exercise (the signatures its
check states). `StudentEngine` runs the package's Llama forward pass (`LlamaModel`, the one
`LLM()` runs) on them:

    stage ops      embedding (02), rmsnorm and its fused residual add (02), rope (04, on the
                   student's cos/sin cache), the FFN (06); the GEMMs of qkv, o and the LM head
                   are the naive stages (nobody writes a matmul by hand)
    attention      a paged KV cache: new K/V stored through the student's slot mapping (09),
                   read back through it; a whole prompt through the student's causal attention
                   (05), a chunk or a decode token through the student's online-softmax tile step
                   (05), GQA through the student's repeat_kv (03)
    memory         the student's allocate and free (09) over a free queue of blocks, and the
                   student's prefix lookup (09): a request's first allocation starts from the
                   cached blocks of its longest cached prefix, shared, not recomputed
    scheduling     the student's schedule() step (10): token budget, seats, chunked prefill,
                   preemption by recompute
    batching       the student's cu_seqlens and positions (00) for the flat token batch
    sampling       the student's greedy (00)

Nothing of the package's scheduler, block manager or attention runs; its model code does, so the
greedy tokens can be compared with `LLM()` on the same model.
"""

from collections import deque
from dataclasses import dataclass, field

import torch

from stagewise.models.forward_batch import ForwardBatch
from stagewise.models.llama import LlamaModel
from stagewise.models.ops import StageOps
from stagewise.stages import STAGES
from stagewise.stages.base import stage_of

PARTS = {  # field of StudentParts -> the exercise whose answer it is
    "cu_seqlens": "00.cu_seqlens",
    "positions": "00.positions",
    "greedy": "00.greedy",
    "embedding": "02.embedding",
    "rmsnorm": "02.rmsnorm",
    "add_rmsnorm": "02.add_rmsnorm",
    "repeat_kv": "03.repeat_kv",
    "cos_sin_cache": "04.cos_sin_cache",
    "rope": "04.rope",
    "causal_attention": "05.causal_attention",
    "online_step": "05.online_softmax",
    "ffn": "06.ffn",
    "slot_mapping": "09.slot_mapping",
    "allocate": "09.allocate",
    "free": "09.free",
    "cached_prefix": "09.cached_prefix",
    "schedule": "10.schedule_step",
}


@dataclass
class StudentParts:
    cu_seqlens: object
    positions: object
    greedy: object
    embedding: object
    rmsnorm: object
    add_rmsnorm: object
    repeat_kv: object
    cos_sin_cache: object
    rope: object
    causal_attention: object
    online_step: object
    ffn: object
    slot_mapping: object
    allocate: object
    free: object
    cached_prefix: object
    schedule: object

    @classmethod
    def of(cls, solved: dict) -> "StudentParts":
        """From a dict of exercise name -> function (every notebook's SOLUTIONS merged)."""
        missing = [check for check in PARTS.values() if check not in solved]
        if missing:
            raise KeyError(f"the capstone needs these exercises' functions too: {', '.join(missing)}")
        return cls(**{part: solved[check] for part, check in PARTS.items()})


class StudentOps:
    """The stage-ops object the model calls: the student's functions where there is one."""

    def __init__(self, parts: StudentParts):
        self.parts, self.naive = parts, StageOps("naive")
        self.calls: dict[str, int] = {}  # stage -> calls answered by the student's function

    def __call__(self, stage, layer: int | None = None, **kw):
        name, p = stage_of(stage, STAGES).name, self.parts
        if name == "embedding":
            out = p.embedding(kw["ids"], kw["weight"])
        elif name == "rmsnorm" and kw.get("residual") is None:
            out = (p.rmsnorm(kw["x"], kw["weight"], kw["eps"]), kw["x"])  # the first norm starts the stream
        elif name == "rmsnorm":
            out = tuple(p.add_rmsnorm(kw["x"], kw["residual"], kw["weight"], kw["eps"]))
        elif name == "rope":
            pos, cache = kw["positions"], kw["cos_sin_cache"]
            out = (p.rope(pos, kw["q"], cache), p.rope(pos, kw["k"], cache))
        elif name == "ffn":
            out = p.ffn(kw["x"], kw["w_gate_up"], kw["w_down"])
        else:  # the GEMMs (qkv_proj, o_proj, lm_head): the naive stage
            return self.naive(stage, layer=layer, **kw)
        self.calls[name] = self.calls.get(name, 0) + 1
        return out

    def fuses(self, *stages) -> bool:
        """The student's stages are separate functions: the model never fuses two of them."""
        return False


@dataclass
class Seq:
    """A request as the student's scheduler sees it (request_id, num_tokens, num_computed_tokens)."""

    request_id: str
    token_ids: list[int]  # prompt, then the tokens generated so far
    max_tokens: int  # tokens to generate
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    generated: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class StudentPagedKV:
    """One step's attention over the paged pool, through the student's slots and attention."""

    def __init__(self, engine: "StudentEngine", seqs: list[Seq], counts: list[int]):
        self.engine, self.spans, self.new_slots, self.all_slots = engine, [], [], []
        for seq, n in zip(seqs, counts):
            start, row = seq.num_computed_tokens, engine.rows[seq.request_id]
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
            k_pool[new], v_pool[new] = k[rows], v[rows]  # store first: the step's keys are read too
            keys, values = k_pool[every], v_pool[every]  # [end, Hkv, d], read through the block table
            if start == 0:  # a whole prompt: queries and keys coincide
                out[rows] = p.causal_attention(q[rows], keys, values, scale)
            else:  # a chunk or a decode token: the online softmax over the cached keys
                out[rows] = self._online(q[rows], keys, values, scale, start)
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


class StudentEngine:
    """Greedy generation on a loaded model, every engine part the student's."""

    def __init__(self, loaded, parts: StudentParts, num_blocks: int, block_size: int, budget: int, seats: int):
        cfg = loaded.config
        self.parts, self.block_size, self.budget, self.seats = parts, block_size, budget, seats
        self.ops = StudentOps(parts)
        self.model = LlamaModel(loaded, self.ops)
        self.model.cos_sin_cache = parts.cos_sin_cache(cfg.max_position_embeddings, cfg.rotary_dim, cfg.rope_theta)
        shape = (cfg.num_layers, num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k_pool = torch.zeros(shape, dtype=loaded.dtype)  # [L, slots, Hkv, d]
        self.v_pool = torch.zeros(shape, dtype=loaded.dtype)
        self.free_queue, self.ref_counts = deque(range(num_blocks)), [0] * num_blocks
        self.rows: dict[str, list[int]] = {}  # request id -> its block-table row
        self.cached: dict[int, int] = {}  # chained hash of a full block's prefix -> the block holding it
        self.block_hash: list[int | None] = [None] * num_blocks  # block -> the hash it is cached under
        self.reused: dict[str, int] = {}  # request id -> prompt tokens found in the cache at admission
        self.steps: list[list[tuple[str, int]]] = []  # what each step scheduled
        self.preemptions = 0  # requests the student's scheduler sent back to waiting

    def allocate(self, seq: Seq, n: int) -> bool:
        """Room for n more tokens of seq; a request's first allocation starts from its cached prefix.

        The scheduler asked for n tokens not knowing the cache; the tokens found there are not
        computed again, so this step computes min(n, tokens left) of them (`_forward`).
        """
        row = self.rows.setdefault(seq.request_id, [])
        first = not row and seq.num_computed_tokens == 0  # admitted now, not a running request growing
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
        if first:
            self.reused[seq.request_id] = seq.num_computed_tokens
        for block in row[owned:]:  # a reused free block forgets the prefix it held
            if self.block_hash[block] is not None and self.cached.get(self.block_hash[block]) == block:
                del self.cached[self.block_hash[block]]
            self.block_hash[block] = None
        return True

    def free(self, seq: Seq) -> None:
        self.parts.free(self.free_queue, self.ref_counts, self.rows.pop(seq.request_id, []))

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_tokens: int, max_steps: int = 10_000) -> list[list[int]]:
        """Greedy, no stop token: every request generates exactly max_tokens tokens."""
        seqs = [Seq(f"r{i}", list(p), max_tokens) for i, p in enumerate(prompts)]
        running, waiting = [], deque(seqs)
        while running or waiting:
            if len(self.steps) >= max_steps:
                raise RuntimeError(f"the requests did not finish in {max_steps} steps: does the largest fit alone?")
            before = {s.request_id for s in running}
            step = self.parts.schedule(running, waiting, self.budget, self.seats, self.allocate, self.free)
            self.preemptions += len(before - {s.request_id for s in running})  # sent back to waiting
            by_id = {s.request_id: s for s in seqs}
            batch_seqs = [by_id[rid] for rid, _ in step]
            counts = [min(n, s.num_tokens - s.num_computed_tokens) for s, (_, n) in zip(batch_seqs, step)]
            self.steps.append([(s.request_id, n) for s, n in zip(batch_seqs, counts)])  # cached tokens left out
            self._forward(batch_seqs, counts)
            for seq in batch_seqs:
                if seq.num_computed_tokens == seq.num_tokens and len(seq.generated) == seq.max_tokens:
                    running.remove(seq)
                    self.free(seq)
        return [s.generated for s in seqs]

    def _register(self, seq: Seq) -> None:
        """Name every full block of seq's computed tokens by its chained hash, as 09's lookup reads it."""
        parent, row = None, self.rows[seq.request_id]
        for i in range(seq.num_computed_tokens // self.block_size):
            parent = hash((parent, tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])))
            if parent not in self.cached and self.block_hash[row[i]] is None:  # the first copy is the one
                self.cached[parent], self.block_hash[row[i]] = row[i], parent

    def _forward(self, seqs: list[Seq], counts: list[int]) -> None:
        p = self.parts
        starts = [s.num_computed_tokens for s in seqs]
        cu = [int(c) for c in p.cu_seqlens(counts)]  # [B+1]
        ids = [t for s, a, n in zip(seqs, starts, counts) for t in s.token_ids[a : a + n]]
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long),
            positions=torch.as_tensor(p.positions(counts, starts), dtype=torch.long),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
            last_token_index=torch.tensor([c - 1 for c in cu[1:]], dtype=torch.long),
            cu_seqlens_q_host=cu,
            max_q_len=max(counts),
        )
        logits = self.model.forward(batch, StudentPagedKV(self, seqs, counts))  # [B, vocab]
        next_ids = p.greedy(logits)
        for b, (seq, n) in enumerate(zip(seqs, counts)):
            seq.num_computed_tokens += n
            self._register(seq)
            if seq.num_computed_tokens == seq.num_tokens:  # the step reached its last token: sample
                token = int(next_ids[b])
                seq.generated.append(token)
                if len(seq.generated) < seq.max_tokens:
                    seq.token_ids.append(token)


def load_solutions(folder) -> dict:
    """Every `notebooks/solutions/nbNN.py`'s SOLUTIONS, merged: exercise name -> function."""
    import importlib.util
    from pathlib import Path

    solved = {}
    for path in sorted(Path(folder).glob("nb*.py")):
        spec = importlib.util.spec_from_file_location(f"solutions_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        solved.update(module.SOLUTIONS)
    return solved
