"""A request: its tokens, its progress, its sampling settings and its timestamps.

The engine's whole view of a request is two counters (vLLM's view, from the
seeds): `num_tokens` — prompt plus generated tokens it owns — and
`num_computed_tokens` — how many of those already have K/V computed. A step
schedules `num_tokens - num_computed_tokens` tokens to catch up; a long prompt
is that difference at the start, a decode step is a difference of one.
"""

import enum
import time
from dataclasses import dataclass, field

import torch

from stagewise.engine.text_stream import TextStream
from stagewise.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no KV
    RUNNING = "running"  # scheduled, holds KV
    FINISHED = "finished"  # done; its KV is released


class FinishReason(enum.Enum):
    STOP = "stop"  # end-of-sequence token or a stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # dropped before the end: its stream was closed or interrupted
    ERROR = "error"  # an engine step failed because of this request (Request.error says why)


@dataclass
class Request:
    request_id: str  # unique id, e.g. "req-0"
    prompt: str  # the prompt text as given (after the chat template, if applied)
    prompt_token_ids: list[int]  # tokenized prompt
    params: SamplingParams  # how to sample and when to stop
    seed: int  # random stream seed (params.seed, or one picked by the engine)
    text_stream: TextStream  # detokenizer + stop-string matcher for the output
    output_token_ids: list[int] = field(default_factory=list)  # generated so far
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None  # with FinishReason.ERROR: one line saying what failed
    arrival_time: float = field(default_factory=time.perf_counter)  # when it was submitted
    first_scheduled_time: float | None = None  # when a step first ran any of its tokens
    token_times: list[float] = field(default_factory=list)  # when each output token was produced
    # [vocab] bool: prompt + output tokens (repetition penalty set)
    seen: torch.Tensor | None = None
    # speculative decoding (engine/speculative/): this step's guesses, unverified, scheduled after
    # the last token; their K/V are computed this step and rewound if rejected
    spec_token_ids: list[int] = field(default_factory=list)
    # [len(spec_token_ids), vocab] draft q rows; None = point mass
    spec_probs: torch.Tensor | None = None
    last_num_accepted: int = 0  # drafts kept in the latest verify step
    num_spec_steps: int = 0  # verify steps that checked at least one draft
    num_draft_tokens: int = 0  # drafts verified in all
    num_accepted_tokens: int = 0  # of those, drafts accepted
    # SamplingParams.logprobs: one StepLogprobs per output token, and those of this step's rows
    # not yet appended (the sampler fills them; append_token takes them in order)
    logprobs: list = field(default_factory=list)
    pending_logprobs: list = field(default_factory=list)
    # parallel sampling (SamplingParams.n > 1): which of the prompt's n samples this is, and for
    # samples 1 .. n-1 the first sample, whose prompt blocks they share once it has computed them
    sample_index: int = 0
    fork_of: "Request | None" = field(default=None, repr=False)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def spec_all_token_ids(self) -> list[int]:
        """all_token_ids, then this step's unverified guesses: what a verify step runs over."""
        return self.prompt_token_ids + self.output_token_ids + self.spec_token_ids

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def seen_mask(self, vocab_size: int) -> torch.Tensor:
        """[vocab] bool of tokens in the prompt or output, kept up to date incrementally."""
        if self.seen is None:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool)
            self.seen[torch.tensor(self.all_token_ids, dtype=torch.long)] = True
        return self.seen

    def append_token(self, token_id: int, stop_ids: frozenset[int], max_model_len: int) -> str:
        """Record a sampled token; decide whether the request is finished; return new text."""
        now = time.perf_counter()
        if self.pending_logprobs:  # the log-probabilities of the row that chose this token
            self.logprobs.append(self.pending_logprobs.pop(0))
        self.output_token_ids.append(token_id)
        self.token_times.append(now)
        if self.seen is not None:
            self.seen[token_id] = True
        params = self.params
        # eos, or another end-of-sequence id
        is_eos = token_id in stop_ids and not params.ignore_eos
        if is_eos:
            self.finish_reason = FinishReason.STOP
            return self.text_stream.finish()  # the EOS token itself adds no text
        done_by_length = (
            len(self.output_token_ids) >= params.max_tokens or self.num_tokens >= max_model_len
        )
        delta = self.text_stream.push(token_id, final=done_by_length)
        if self.text_stream.stopped_by is not None:
            self.finish_reason = FinishReason.STOP
        elif done_by_length:
            self.finish_reason = FinishReason.LENGTH
        return delta


def prompt_indices(requests: list[Request]) -> dict[str, int]:
    """request id -> the position of its prompt among the call's prompts.

    The requests of one call are its prompts' first samples, in order, then the other samples of
    parallel sampling (each `fork_of` its first sample)."""
    firsts = {id(r): i for i, r in enumerate(r for r in requests if r.fork_of is None)}
    return {r.request_id: firsts.get(id(r.fork_of or r), 0) for r in requests}
