"""What a speculating paged engine does around its step (engine/paged_runner.py calls these).

before scheduling   `propose`: each decoding request may get up to k guesses; the scheduler
                    then gives it 1 + k' query tokens (k' <= k: the budget and the free
                    blocks may cut them)
sampling            `verify.verify`: the rejection sampler keeps the guesses the target
                    agrees with, plus one token of its own
settling            `after_verify`: once the kept tokens are appended (a stop string, a
                    stop id or max_tokens cuts the run exactly there), the request rewinds:
                    `num_computed_tokens` goes back to its new end, the blocks past it
                    (rejected guesses' K/V only) are freed, and only now are the newly full
                    blocks named for the prefix cache
leaving             `drop_proposals`: a request that leaves the running set (finished,
                    preempted, aborted) takes its guesses and the proposer's state with it
"""

from stagewise.engine.request import Request
from stagewise.engine.run_stats import RunStats
from stagewise.engine.scheduler import ScheduledRequest
from stagewise.engine.speculative.proposal import Proposer
from stagewise.engine.tracing import note_verified
from stagewise.kv.block_manager import BlockManager


def propose(proposer: Proposer, running: list[Request], k: int, max_model_len: int) -> None:
    """Ask the proposer for each decoding request's guesses (`req.spec_token_ids`). Never more
    than max_tokens and max_model_len allow: a step keeps at most k' + 1 tokens."""
    asking, limits = [], []
    for req in running:
        req.spec_token_ids, req.spec_probs = [], None
        if not req.output_token_ids or req.num_tokens - req.num_computed_tokens != 1:
            continue  # still prefilling: its first token comes from the prompt's pass
        out_left = req.params.max_tokens - len(req.output_token_ids)
        left = min(out_left, max_model_len - req.num_tokens)
        if min(k, left - 1) >= 1:
            asking.append(req)
            limits.append(min(k, left - 1))
    if not asking:
        return
    for req, limit, proposal in zip(asking, limits, proposer.propose(asking, limits)):
        req.spec_token_ids = list(proposal.token_ids[:limit])
        if proposal.probs is not None:
            req.spec_probs = proposal.probs[: len(req.spec_token_ids)]


def after_verify(
    s: ScheduledRequest,
    kept: list[int],
    proposer: Proposer,
    block_manager: BlockManager,
    stats: RunStats,
) -> None:
    """After a request's kept tokens are appended: count, rewind past the rejected guesses, name
    the verified blocks, tell the proposer; the trace notes what was kept."""
    req, accepted, bm = s.request, len(kept) - 1, block_manager
    if s.num_spec_tokens:
        req.num_spec_steps += 1
        req.num_draft_tokens += s.num_spec_tokens
        req.num_accepted_tokens += accepted
        stats.spec_verify_steps += 1
        stats.spec_draft_tokens += s.num_spec_tokens
        stats.spec_accepted_tokens += accepted
        note_verified({req.request_id: {"accepted": accepted, "kept_token_ids": kept}})
    req.last_num_accepted = accepted
    if req.finish_reason is None:
        req.num_computed_tokens = req.num_tokens - 1  # K/V up to the last kept token's input
        bm.truncate(req.request_id, req.num_tokens)  # blocks of rejected guesses only
        bm.register_full_blocks(req.request_id, req.all_token_ids, req.num_computed_tokens)
        proposer.on_verified(req)
    req.spec_token_ids, req.spec_probs = [], None


def drop_proposals(req: Request, proposer: Proposer | None) -> None:
    """The request left the running set: its guesses and the proposer's state for it go."""
    req.spec_token_ids, req.spec_probs = [], None
    if proposer is not None:
        proposer.on_removed(req)
