"""The scheduler: which requests run this step, and how many tokens each.

There are no prefill and decode phases here (the seeds' point, and vLLM's):
each request only has `num_tokens` (prompt + output so far) and
`num_computed_tokens` (K/V already in the cache, prefix-cache hits included).
A step schedules `num_tokens - num_computed_tokens` tokens for a request — a
whole prompt, a chunk of it, or the single token sampled last step — as long
as four constraints hold:

1. `max_num_seqs`: at most that many requests running at once;
2. the token budget `max_num_batched_tokens` summed over the step (a long
   prompt that does not fit is cut into chunks across steps: chunked prefill);
   and while any running request is decoding, prompt tokens (prefills and
   prefill chunks) take at most `prefill_beside_decodes` of it: every
   decoding request waits for the whole step, so a step that also prefills
   512 tokens makes each of them wait for those 512 (on a CPU, many times a
   decode step). A small chunk keeps the time between tokens even; a step
   with no decode still prefills with the whole budget (time to first token);
3. `max_model_len`: checked when a request is submitted (prompt + max_tokens);
4. free KV blocks: the block manager must find blocks for the new tokens.

FCFS: running requests first, in arrival order, then waiting ones. When a
running request cannot get a block, the most recently admitted running request
is preempted by recompute — its blocks are freed, its computed tokens reset
to 0, and it goes back to the *front* of the waiting queue; its output tokens
are kept and recomputed with the prompt when it is resumed. No waiting
request is admitted in a step that preempted.

A request can also leave early: `abort()` (its stream was abandoned) frees its
blocks at once. After a step whose forward pass was interrupted,
`recover_interrupted_step()` preempts every running request (recompute is
always correct) and unnames the blocks the step named before writing them.

Speculative decoding (engine/speculative/): before scheduling, the runner may
give a decoding request k guesses (`req.spec_token_ids`). It then needs 1 + k
query tokens (its last token, then the guesses), counted against the budget
like any others; when the budget or the free blocks are short, the guesses are
cut first (down to none: a plain decode step). Only verified tokens name
blocks in the prefix cache: blocks are named up to `num_tokens` here, and the
runner names the accepted guesses' blocks after verification.

When a step fails for some request, the engine runs each request of that step
by itself (`schedule_alone`) to find which one it was; `fail()` then removes
that request with finish reason "error".

Reuse when a request is admitted: a waiting request is looked up in the prefix
cache (`BlockManager.match_prefix`, hash or radix) and starts past the tokens
it found. A parallel sample (`Request.fork_of`, SamplingParams.n > 1) waits
instead for its first sample's prompt to be computed, then shares those
blocks (`share_prefix`) and computes only the prompt's last token, whose
logits it samples from with its own random stream. Requests that leave
(finished or preempted) hand what they computed to the prefix cache.
"""

from collections import deque
from dataclasses import dataclass, field

from stagewise.engine.request import FinishReason, Request, RequestStatus
from stagewise.kv.block_manager import NO_HIT, BlockManager, PrefixHit


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed for it this step
    num_cached_tokens: int  # tokens reused when it was admitted this step (prefix cache or fork)
    samples: bool  # True when this step reaches its last token, so a token is sampled
    num_spec_tokens: int = 0  # of num_new_tokens, unverified guesses after its last token
    reused_from: str | None = None  # with num_cached_tokens: "hash", "radix" or "fork"


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # requests sent back to waiting this step
    preempted: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)  # waiting requests that started running

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        prefill_beside_decodes: int | None = None,
    ):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs  # constraint 1
        self.max_num_batched_tokens = max_num_batched_tokens  # constraint 2
        # constraint 2, in steps with decodes (None: no cap)
        self.prefill_beside_decodes = prefill_beside_decodes
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        self.block_manager.begin_step()
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        decoding = any(r.num_tokens - r.num_computed_tokens == 1 for r in self.running)
        cap = self.prefill_beside_decodes
        # prompt tokens this step
        prefill_left = min(budget, cap) if decoding and cap is not None else budget

        # 1) running requests, FCFS; preempt from the back when blocks run out
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            remaining = req.num_tokens - req.num_computed_tokens
            if remaining == 1:  # decoding: the last token, then any guesses (speculative decoding)
                n = min(remaining + len(req.spec_token_ids), budget)
            else:
                n = min(remaining, budget, prefill_left)
            # a prefill chunk, and this step's prompt tokens are spent: it continues next step
            if n == 0:
                i += 1
                continue
            while not bm.allocate(req.request_id, req.num_computed_tokens, n):
                if n > remaining:  # guesses are the first to go when blocks run short
                    n = remaining
                    continue
                victim = self.running.pop()  # the most recently admitted request
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:  # req preempted itself: nothing else fits
                break
            self._scheduled(out, req, n)
            budget -= n
            prefill_left -= n if remaining > 1 else 0
            i += 1

        # 2) waiting requests, FCFS, only in a step without preemption
        while self.waiting and not out.preempted and len(self.running) < self.max_num_seqs:
            if min(budget, prefill_left) == 0:
                break
            req = self.waiting[0]
            hit = self._lookup(req)
            if hit is None:
                break  # a parallel sample waits for its first sample's prompt (FCFS: all wait)
            n = min(req.num_tokens - req.num_computed_tokens - hit.num_tokens, budget, prefill_left)
            if not bm.allocate(req.request_id, req.num_computed_tokens, n, cached_prefix=hit):
                break  # FCFS: the head waits for blocks, and so does everyone behind it
            self.waiting.popleft()
            if req.num_computed_tokens == 0:
                bm.record_lookup(req.num_tokens, hit)
            self._admit(out, req, hit)
            self._scheduled(out, req, n, hit)
            budget -= n
            prefill_left -= n
        return out

    def schedule_alone(self, req: Request) -> SchedulerOutput:
        """A step that runs `req` only (isolating a failure); the others wait, or are preempted
        when `req` needs their blocks. Constraint 2's budget still holds (chunked prefill)."""
        self.block_manager.begin_step()
        out = SchedulerOutput()
        bm = self.block_manager
        req.spec_token_ids, req.spec_probs = [], None  # isolating a failure: no guesses
        waiting = req in self.waiting
        hit = NO_HIT
        if waiting and req.num_computed_tokens == 0:
            hit = bm.match_prefix(req.all_token_ids)
        n = min(
            req.num_tokens - req.num_computed_tokens - hit.num_tokens, self.max_num_batched_tokens
        )
        while not bm.allocate(req.request_id, req.num_computed_tokens, n, cached_prefix=hit):
            victim = next(r for r in reversed(self.running) if r is not req)  # req fits alone
            self.running.remove(victim)
            self._preempt(victim)
            out.preempted.append(victim)
        if waiting:
            self.waiting.remove(req)
            self._admit(out, req, hit)
        self._scheduled(out, req, n, hit)
        return out

    def _lookup(self, req: Request) -> PrefixHit | None:
        """What a waiting request can reuse: its first sample's prompt (a parallel sample whose
        first sample runs; None while that prompt is still being computed), or the prefix cache."""
        if req.num_computed_tokens:
            return NO_HIT
        first = req.fork_of
        if first is not None and first.status == RequestStatus.RUNNING and not req.output_token_ids:
            if first.num_computed_tokens < first.num_prompt_tokens:
                return None
            return self.block_manager.share_prefix(first.request_id, req.num_prompt_tokens - 1)
        return self.block_manager.match_prefix(req.all_token_ids)

    def _admit(self, out: SchedulerOutput, req: Request, hit: PrefixHit) -> None:
        req.num_computed_tokens += hit.num_tokens
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        out.admitted.append(req)

    def _scheduled(
        self, out: SchedulerOutput, req: Request, n: int, hit: PrefixHit = NO_HIT
    ) -> None:
        end = req.num_computed_tokens + n
        samples = end >= req.num_tokens
        num_spec = end - req.num_tokens if samples else 0  # guesses that fit the budget
        del req.spec_token_ids[num_spec:]  # the budget or the blocks may cut the guesses short
        if req.spec_probs is not None:
            req.spec_probs = req.spec_probs[:num_spec]
        reused = hit.origin if hit.num_tokens else None
        out.scheduled.append(ScheduledRequest(req, n, hit.num_tokens, samples, num_spec, reused))
        # K/V of these tokens are written during this step, before any attention reads them,
        # so full blocks can be named now and shared by requests scheduled later in this step.
        # Guesses are not named: only once verified (the runner registers them after the step).
        self.block_manager.register_full_blocks(
            req.request_id, req.all_token_ids, min(end, req.num_tokens)
        )

    def _release(self, req: Request) -> None:
        """Free a leaving request's blocks; the prefix cache keeps what it computed (K/V of
        every token but the last: a token's K/V are computed when the next one is sampled)."""
        valid = min(req.num_computed_tokens, req.num_tokens - 1)
        self.block_manager.free(req.request_id, req.all_token_ids, valid)

    def _preempt(self, req: Request, keep: bool = True) -> None:
        if keep:
            self._release(req)
        else:  # after a failed step: its hits and copies may never have been written
            self.block_manager.free(req.request_id)
        req.spec_token_ids, req.spec_probs = [], None  # guesses go with the cache
        req.num_computed_tokens = 0  # recompute: prompt + outputs so far run again on resume
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def abort(self, req: Request) -> None:
        """Drop a waiting or running request now and free its blocks (finish reason "abort")."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.block_manager.free(req.request_id)
        req.status = RequestStatus.FINISHED
        req.finish_reason = FinishReason.ABORT

    def fail(self, req: Request, error: str) -> None:
        """Remove a request whose step failed; finish reason "error", `req.error` says why."""
        self.abort(req)
        req.finish_reason, req.error = FinishReason.ERROR, error

    def recover_interrupted_step(self) -> list[Request]:
        """Undo a step whose forward pass did not complete; -> the requests sent back to waiting."""
        self.block_manager.forget_names_of_step()
        victims = list(self.running)
        for req in reversed(victims):  # appendleft in reverse keeps their FCFS order at the front
            self.running.remove(req)
            self._preempt(req, keep=False)
        return victims

    def finish(self, req: Request) -> None:
        req.status = RequestStatus.FINISHED
        self.running.remove(req)
        self._release(req)
