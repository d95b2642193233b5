"""What `LLM.generate` returns and what `LLM.stream` yields.

Metrics follow the seeds' definitions (chapter 4):

    TTFT       = first token time - arrival time            (the prefill)
    TBT        = time between consecutive output tokens      (each decode step)
    TPS        = 1 / mean(TBT)                               (how fast the text streams out)
    latency    = last token time - arrival time  ==  TTFT + (n - 1) * mean(TBT)
    throughput = output tokens / latency                     (one request: TTFT included,
                                                              so below TPS; a run: all
                                                              output tokens / its wall time)
"""

import statistics
from dataclasses import dataclass, replace

from stagewise.engine.logprobs import Logprobs
from stagewise.engine.request import Request
from stagewise.errors import StagewiseError


class RequestFailed(StagewiseError):
    """An engine step failed because of one request: it was finished and removed, others went on."""


@dataclass(frozen=True)
class RequestMetrics:
    arrival_time: float  # perf_counter seconds when the request was submitted
    first_scheduled_time: float  # when a step first ran any of its tokens
    first_token_time: float  # when its first output token was sampled
    finish_time: float  # when its last output token was sampled
    queue_time: float  # first_scheduled_time - arrival_time
    ttft: float  # first_token_time - arrival_time
    tbt: tuple[float, ...]  # gaps between consecutive output tokens (n - 1 of them)
    tbt_mean: float  # mean of tbt (0 with a single token)
    tbt_p50: float  # median of tbt
    tbt_p99: float  # 99th percentile of tbt
    latency: float  # finish_time - arrival_time
    # output tokens / latency: the request's throughput, TTFT included (not TPS)
    tokens_per_s: float
    # 1 / mean(TBT), the seeds' TPS: tokens per second once decoding runs (0 with a single token)
    tps: float
    # speculative decoding (0 without): guesses verified, guesses kept, verify steps with guesses
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_spec_steps: int = 0
    acceptance_rate: float = 0.0  # num_accepted_tokens / num_draft_tokens
    mean_accepted_tokens: float = 0.0  # guesses kept per verify step (+1 of the target's own)

    @staticmethod
    def of(req: Request) -> "RequestMetrics":
        times = req.token_times
        tbt = tuple(b - a for a, b in zip(times, times[1:]))
        tbt_mean = statistics.fmean(tbt) if tbt else 0.0
        latency = times[-1] - req.arrival_time
        return RequestMetrics(
            arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time or times[0],
            first_token_time=times[0],
            finish_time=times[-1],
            queue_time=(req.first_scheduled_time or times[0]) - req.arrival_time,
            ttft=times[0] - req.arrival_time,
            tbt=tbt,
            tbt_mean=tbt_mean,
            tbt_p50=percentile(tbt, 50),
            tbt_p99=percentile(tbt, 99),
            latency=latency,
            tokens_per_s=len(times) / latency if latency > 0 else float("inf"),
            tps=1 / tbt_mean if tbt_mean > 0 else 0.0,
            num_draft_tokens=req.num_draft_tokens,
            num_accepted_tokens=req.num_accepted_tokens,
            num_spec_steps=req.num_spec_steps,
            acceptance_rate=req.num_accepted_tokens / req.num_draft_tokens
            if req.num_draft_tokens
            else 0.0,
            mean_accepted_tokens=req.num_accepted_tokens / req.num_spec_steps
            if req.num_spec_steps
            else 0.0,
        )


def percentile(values, q: float) -> float:
    """Linear-interpolated percentile (numpy's default); 0 for an empty list."""
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class RequestOutput:
    request_id: str  # the engine's id for the request
    prompt: str  # prompt text (after the chat template, if one was applied)
    prompt_token_ids: list[int]  # tokenized prompt
    text: str  # generated text (special tokens and any stop string removed)
    token_ids: list[int]  # generated token ids (including a final EOS, if any)
    finish_reason: str  # "stop" (EOS or stop string) or "length" (max_tokens / max_model_len)
    metrics: RequestMetrics  # timings of this request
    # SamplingParams(logprobs=k): per output token the top k and the drawn token's log-probability,
    # float32 as computed (engine/logprobs.py); None when not asked
    logprobs: Logprobs | None = None
    # SamplingParams(n=...): the prompt's n samples, sample i at index i (the fields above are
    # sample 0's); every RequestOutput that `generate` returns has n of them
    samples: tuple["RequestOutput", ...] = ()

    @staticmethod
    def per_prompt(requests: list[Request]) -> list["RequestOutput"]:
        """One output per prompt, in the prompts' order, each with its samples."""
        samples: dict[int, list[Request]] = {}
        firsts = [r for r in requests if r.fork_of is None]
        for r in requests:
            samples.setdefault(id(r.fork_of or r), []).append(r)
        out = []
        for first in firsts:
            group = sorted(samples[id(first)], key=lambda r: r.sample_index)
            each = tuple(RequestOutput.of(r) for r in group)
            out.append(replace(each[0], samples=each))
        return out

    @staticmethod
    def of(req: Request) -> "RequestOutput":
        k = req.params.logprobs
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=list(req.prompt_token_ids),
            text=req.text_stream.text,
            token_ids=list(req.output_token_ids),
            finish_reason=req.finish_reason.value if req.finish_reason else "length",
            metrics=RequestMetrics.of(req),
            logprobs=None if k is None else Logprobs.of(req.logprobs, k),
        )


@dataclass(frozen=True)
class TokenEvent:
    """One streamed token: yielded by `LLM.stream` as soon as it is sampled."""

    request_id: str  # which request
    index: int  # position of the request in the prompts list given to stream()/generate()
    token_id: int | None  # the sampled token; None on an "error" event, which carries no token
    text: str  # newly settled text (may be empty while a character or stop string is incomplete)
    finished: bool  # True on the request's last token (and on its error event)
    finish_reason: str | None  # set when finished: "stop", "length", "abort" or "error"
    error: str | None = None  # with finish_reason "error": one line saying what failed
    sample: int = 0  # which of its prompt's n samples (SamplingParams.n) the token belongs to

    @staticmethod
    def of(
        req: Request, index: int, token: int | None, delta: str, final: bool = True
    ) -> "TokenEvent":
        """The event of `req`'s latest token (or of its removal, when `token` is None).

        `final=False`: a token before the last of several settled in one step (speculative
        decoding); it cannot be the request's end, whatever the request's state is now."""
        i = req.sample_index
        if not final:
            return TokenEvent(req.request_id, index, token, delta, False, None, None, i)
        reason = req.finish_reason.value if req.finish_reason else None
        return TokenEvent(req.request_id, index, token, delta, req.finished, reason, req.error, i)


def run_summary(requests: list[Request], stats) -> dict:
    """Totals of one run, for the trace's last line and for benchmarks."""
    done = [r for r in requests if r.token_times]
    metrics = [RequestMetrics.of(r) for r in done]
    tbt = [g for m in metrics for g in m.tbt]
    start = min((r.arrival_time for r in requests), default=0.0)
    end = max((m.finish_time for m in metrics), default=start)
    out_tokens = sum(len(r.output_token_ids) for r in requests)
    mean_tbt = statistics.fmean(tbt) if tbt else 0.0
    return {
        "requests": len(requests),
        "prompt_tokens": sum(r.num_prompt_tokens for r in requests),
        "output_tokens": out_tokens,
        "steps": stats.steps,
        "tokens_computed": stats.tokens_computed,
        "padding_tokens": stats.padding_tokens,
        "kv_cache_MiB": round(stats.kv_cache_bytes / 2**20, 2),
        "kv_blocks_peak": max(stats.blocks_in_use, default=None),
        "preemptions": stats.preemptions,
        "prefix_cache_hit_rate": round(stats.prefix_hit_rate, 3),
        # K/V reused instead of computed: prefix-cache hits and prompts shared by parallel samples
        "reused_tokens": stats.prefix_hit_tokens + getattr(stats, "forked_tokens", 0),
        "ttft_ms": round(1000 * statistics.fmean(m.ttft for m in metrics), 2) if metrics else None,
        "tbt_ms": round(1000 * mean_tbt, 2) if tbt else None,
        "tps": round(1 / mean_tbt, 2) if mean_tbt else None,  # 1 / TBT
        "output_tokens_per_s": round(out_tokens / (end - start), 2)
        if end > start
        else None,  # throughput
        **spec_summary(stats),
    }


def spec_summary(stats) -> dict:
    """Speculative decoding's counters of a run ({} when nothing was guessed)."""
    if not getattr(stats, "spec_draft_tokens", 0):
        return {}
    return {
        "spec_draft_tokens": stats.spec_draft_tokens,  # guesses verified
        "spec_accepted_tokens": stats.spec_accepted_tokens,  # guesses kept
        "spec_acceptance_rate": round(stats.spec_acceptance_rate, 3),
        "spec_mean_accepted_tokens": round(stats.spec_mean_accepted, 3),  # per verify step
    }
