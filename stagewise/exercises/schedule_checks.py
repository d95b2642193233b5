"""Check for notebook 10's exercise: one `schedule()` step, beside the real `Scheduler`.

The student's scheduler and the package's run the same workloads side by side, each over its own
real block manager; every step must schedule the same requests with the same token counts, leave
the same queues and the same blocks in every request's row. The workloads are built so that every
rule of the exercise decides something, and the check prints how often each did:

    seats         a waiting request that would fit (budget, blocks) waits because every seat is
                  taken: the seat test comes before `allocate`
    budget        running requests past the token budget get nothing this step (decodes too; the
                  budget is an argument of each call, and some workloads vary it from step to step,
                  so that fewer tokens are left than requests running)
    budget first  the budget is spent with a seat free and a request waiting: nobody is admitted,
                  not even with 0 tokens
    blocked head  the head of the queue does not fit while a request behind it would: FCFS, it
                  and everyone behind it wait
    preemptions   a running request cannot grow: the newest running one goes back to waiting
    chunks        a prompt longer than what is left of the budget is cut
"""

import random
from collections import Counter, deque
from dataclasses import dataclass

from stagewise.engine.request import Request, RequestStatus
from stagewise.engine.scheduler import Scheduler
from stagewise.engine.text_stream import TextStream
from stagewise.exercises.block_checks import tally_line
from stagewise.exercises.core import Mismatch, call, equal
from stagewise.kv.block_manager import BlockManager
from stagewise.sampling_params import SamplingParams

BLOCK_SIZE = 4
RULES = {
    "seats": "seats",
    "budget": "budget (running)",
    "budget_first": "budget before seats",
    "blocked_head": "blocked head",
    "preempt": "preemptions",
    "chunk": "chunks",
}


@dataclass
class Seq:
    """What the student's scheduler sees of a request."""

    request_id: str
    num_tokens: int  # prompt + output tokens so far
    num_computed_tokens: int = 0  # of those, tokens whose K/V are in the cache


@dataclass
class Workload:
    requests: list[tuple[int, int]]  # (prompt tokens, max_tokens) of r0, r1, ...
    seats: int  # max_num_seqs
    budget: int | tuple[int, ...]  # tokens per step; a tuple: step i has budget[i % len(budget)]
    num_blocks: int  # blocks of BLOCK_SIZE tokens in the pool

    def budget_at(self, step: int) -> int:
        return self.budget if isinstance(self.budget, int) else self.budget[step % len(self.budget)]


def workloads() -> list[Workload]:
    """Four written to make one rule bind each, then random ones (chunks and preemptions)."""
    written = [
        Workload([(3, 5), (2, 4), (4, 3), (2, 5), (3, 2)], seats=2, budget=16, num_blocks=30),  # seats
        Workload([(3, 6), (2, 5), (4, 4), (1, 6), (2, 3)], seats=4, budget=(8, 2, 5, 1, 3), num_blocks=30),  # budget
        Workload([(4, 6), (18, 4), (3, 4), (2, 3)], seats=3, budget=24, num_blocks=6),  # a blocked head
        Workload([(9, 6), (7, 8), (6, 5)], seats=3, budget=12, num_blocks=6),  # preemptions
    ]
    randoms = []
    for seed in range(4):
        rng = random.Random(seed)
        reqs = [(rng.randint(1, 20), rng.randint(1, 8)) for _ in range(rng.randint(3, 7))]
        seats, budget = rng.randint(2, 5), rng.randint(2, 16)
        blocks = max(-(-(p + m) // BLOCK_SIZE) for p, m in reqs) + rng.randint(0, 3)
        varying = tuple(rng.randint(1, budget) for _ in range(5)) if seed % 2 else budget
        randoms.append(Workload(reqs, seats, varying, blocks))
    return written + randoms


def _request(rid: str, prompt_len: int, max_tokens: int) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    return Request(rid, "", [1] * prompt_len, params, 0, TextStream(decode=lambda ids: ""))


def _fits(bm: BlockManager, req: Request, budget: int) -> bool:
    """Would the block manager find room for `req`'s next tokens within `budget`?"""
    n = min(req.num_tokens - req.num_computed_tokens, budget)
    return bm.blocks_needed(req.num_computed_tokens + n) - len(bm.block_ids(req.request_id)) <= bm.num_free_blocks


def _decided(sched: Scheduler, out, running_before: list[Request], budget: int) -> Counter:
    """Which rules decided something in the step the real scheduler just made."""
    left, bm, seen = budget - out.num_tokens, sched.block_manager, Counter()
    scheduled = {s.request.request_id for s in out.scheduled}
    seen["budget"] = sum(r.request_id not in scheduled for r in running_before if r in sched.running) * (left == 0)
    seen["preempt"] = len(out.preempted)
    seen["chunk"] = sum(s.num_new_tokens < s.request.num_tokens - s.request.num_computed_tokens for s in out.scheduled)
    if sched.waiting and not out.preempted:
        head = sched.waiting[0]
        if len(sched.running) >= sched.max_num_seqs:
            seen["seats"] = left > 0 and _fits(bm, head, left)
        elif left == 0:
            seen["budget_first"] = 1
        elif not _fits(bm, head, left):
            seen["blocked_head"] = any(_fits(bm, r, left) for r in list(sched.waiting)[1:])
    return seen


def _same_blocks(mine: BlockManager, real: BlockManager, rids, where: str) -> None:
    for rid in rids:
        equal(mine.block_ids(rid), real.block_ids(rid), f"{where}: blocks held by {rid} afterwards")
    equal(list(mine.free_queue), list(real.free_queue), f"{where}: the free queue afterwards")


def run_workload(fn, w: Workload, number: int, counts: Counter) -> int:
    """Step the student's scheduler beside the real one until every request is done; -> steps."""
    sched = Scheduler(BlockManager(w.num_blocks, BLOCK_SIZE, False), w.seats, w.budget)
    mine = BlockManager(w.num_blocks, BLOCK_SIZE, False)
    reqs = {f"r{i}": _request(f"r{i}", p, m) for i, (p, m) in enumerate(w.requests)}
    seqs = {rid: Seq(rid, r.num_tokens) for rid, r in reqs.items()}
    for req in reqs.values():
        sched.add(req)
    running, waiting = [], deque(seqs.values())

    def allocate(seq, n):
        return mine.allocate(seq.request_id, seq.num_computed_tokens, n)

    def free(seq):
        mine.free(seq.request_id)

    steps = 0
    while sched.has_unfinished():
        running_before, budget = list(sched.running), w.budget_at(steps)
        sched.max_num_batched_tokens = budget
        out = sched.schedule()
        want = [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]
        where = f"workload {number}, step {steps} (budget {budget}, max_num_seqs {w.seats})"
        got = call(fn, running, waiting, budget, w.seats, allocate, free)
        equal([tuple(x) for x in got] if isinstance(got, list) else got, want, f"{where}: scheduled")
        for name, mine_q, real_q in (("running", running, sched.running), ("waiting", waiting, sched.waiting)):
            equal([s.request_id for s in mine_q], [r.request_id for r in real_q], f"{where}: {name} afterwards")
        for r in [*sched.running, *sched.waiting]:
            equal(seqs[r.request_id].num_computed_tokens, r.num_computed_tokens, f"{where}: {r.request_id} computed")
        _same_blocks(mine, sched.block_manager, reqs, where)
        counts.update(_decided(sched, out, running_before, budget))
        for s in out.scheduled:  # the step's forward pass: K/V written, a token where one is due
            req, seq = s.request, seqs[s.request.request_id]
            req.num_computed_tokens += s.num_new_tokens
            seq.num_computed_tokens += s.num_new_tokens
            if s.samples:
                req.output_token_ids.append(1)
                seq.num_tokens += 1
                if len(req.output_token_ids) >= req.params.max_tokens:
                    sched.finish(req)
                    running.remove(seq)
                    mine.free(seq.request_id)
        steps += 1
        if steps > 500:
            raise Mismatch(f"workload {number} did not finish in 500 steps")
    assert all(r.status == RequestStatus.FINISHED for r in reqs.values())
    return steps


def check_schedule_step(fn) -> str:
    """my_schedule(running, waiting, budget, max_num_seqs, allocate, free) -> [(request id, tokens)].

    `allocate(seq, n) -> bool` asks the block manager for room for n more tokens of seq;
    `free(seq)` returns its blocks. The student moves Seqs between `running` and `waiting`.
    """
    counts, steps, loads = Counter(), 0, workloads()
    for number, w in enumerate(loads):
        steps += run_workload(fn, w, number, counts)
    return f"{steps} steps of {len(loads)} workloads equal Scheduler's; rules that decided: {tally_line(counts, RULES)}"


CHECKS = {"10.schedule_step": check_schedule_step}
