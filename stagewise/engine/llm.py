"""`LLM`: the user-facing API — load a model once, then generate or stream.

    llm = LLM(model="smollm2-135m", backend="naive", mode="kv")
    outs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0))
    for event in llm.stream(["Tell me a story"], SamplingParams(max_tokens=64)):
        print(event.text, end="")

Modes: "paged" (default) is continuous batching over a paged KV cache, "naive"
recomputes the whole sequence every step (no cache), "kv" runs static batches
over a contiguous per-request KV cache. `backend` picks naive PyTorch or
Triton for every stage; `stage_backends` overrides single stages.

Stepping the engine by hand (paged mode), one iteration at a time:

    llm.add_request("Hello", SamplingParams(max_tokens=4))
    while llm.has_unfinished_requests():
        for event in llm.step():
            print(event.request_id, event.token_id, event.text)
"""

import itertools
import random
import time
from collections.abc import Iterator
from pathlib import Path

from stagewise.config import DEFAULT_MODEL, PRESETS, EngineConfig
from stagewise.engine.outputs import RequestOutput, TokenEvent, run_summary
from stagewise.engine.paged_runner import PagedRunner
from stagewise.engine.recompute_runner import RecomputeRunner
from stagewise.engine.request import Request
from stagewise.engine.run_stats import RunStats
from stagewise.engine.sampling_params import SamplingParams
from stagewise.engine.static_runner import StaticBatchRunner
from stagewise.engine.text_stream import TextStream
from stagewise.errors import StagewiseError
from stagewise.models.llama import LlamaModel
from stagewise.models.ops import StageOps
from stagewise.models.registry import LoadedModel, load_model
from stagewise.stages.rope import describe_rope
from stagewise.trace.hooks import active_tracer

MODES = ("paged", "kv", "naive")


class LLM:
    def __init__(
        self,
        model: str | LoadedModel = DEFAULT_MODEL,
        backend: str = "naive",
        mode: str = "paged",
        device: str | None = None,
        dtype=None,
        stage_backends: dict[str, str] | None = None,
        engine_config: EngineConfig | None = None,
    ):
        if mode not in MODES:
            raise StagewiseError(f"unknown mode '{mode}'; use one of {', '.join(MODES)}")
        self.mode = mode
        self.ops = StageOps(backend, stage_backends)
        self.loaded = model if isinstance(model, LoadedModel) else load_model(model, device, dtype)
        self.config = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.model = LlamaModel(self.loaded, self.ops)
        self.engine_config = engine_config or EngineConfig()
        limit = self.config.max_position_embeddings
        self.max_model_len = min(self.engine_config.max_model_len or limit, limit)
        self._ids = itertools.count()
        self.last_stats = RunStats()  # counters of the most recent generate/stream call
        # paged mode keeps one engine (KV cache, block manager, prefix cache) for the LLM's lifetime
        self.engine = (
            PagedRunner(self.model, self.tokenizer.eos_id, self.max_model_len, self.engine_config)
            if mode == "paged"
            else None
        )
        self._stepped: dict[str, int] = {}  # request id -> index, for requests added with add_request

    # ---- requests ----------------------------------------------------------------------------

    def format_prompt(self, prompt: str, chat: bool) -> str:
        """Wrap a user message in the model's chat template when `chat` is set."""
        if not chat:
            return prompt
        return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)

    def make_request(
        self, prompt: str, params: SamplingParams, chat: bool = False, arrival_time: float | None = None
    ) -> Request:
        """Validate and tokenize one prompt; raises StagewiseError on bad input."""
        arrival_time = arrival_time if arrival_time is not None else time.perf_counter()
        if not isinstance(prompt, str):
            raise StagewiseError(f"a prompt must be a string, got {type(prompt).__name__}")
        if not isinstance(params, SamplingParams):
            raise StagewiseError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not prompt.strip():
            raise StagewiseError("the prompt is empty")
        text = self.format_prompt(prompt, chat)
        # A rendered chat template writes its own bos (Llama 2/3, Mistral): add none (as transformers).
        ids = self.ops("tokenize", text=text, tokenizer=self.tokenizer, add_special_tokens=not chat).tolist()
        if len(ids) > self.max_model_len:
            raise StagewiseError(f"the prompt has {len(ids)} tokens, more than max_model_len={self.max_model_len}")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise StagewiseError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len={self.max_model_len}; lower max_tokens"
            )
        seed = params.seed if params.seed is not None else random.SystemRandom().randrange(2**63)
        tok = self.tokenizer
        return Request(
            request_id=f"req-{next(self._ids)}",
            prompt=text,
            prompt_token_ids=ids,
            params=params,
            seed=seed,
            arrival_time=arrival_time,
            text_stream=TextStream(decode=lambda t: tok.decode(t, skip_special_tokens=True), stop=params.stop),
        )

    def _requests(self, prompts, params, chat: bool) -> list[Request]:
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not prompts:
            raise StagewiseError("no prompts given")
        params = params if params is not None else SamplingParams()
        per_prompt = params if isinstance(params, list | tuple) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise StagewiseError(f"{len(prompts)} prompts but {len(per_prompt)} SamplingParams")
        arrival = time.perf_counter()  # all prompts of one call arrive together, before any tokenization
        return [self.make_request(p, sp, chat, arrival) for p, sp in zip(prompts, per_prompt)]

    # ---- running ----------------------------------------------------------------------------

    def _runner(self):
        pad = self.tokenizer.pad_id if self.tokenizer.pad_id is not None else 0
        eos = self.tokenizer.eos_id
        if self.mode == "paged":
            if self.engine.has_unfinished():
                raise StagewiseError("requests added with add_request are still running; step() them to the end first")
            return self.engine
        if self.mode == "naive":
            return RecomputeRunner(self.model, eos, self.max_model_len)
        return StaticBatchRunner(self.model, eos, pad, self.max_model_len, self.engine_config.max_num_seqs)

    def stream(
        self, prompts: str | list[str], params: SamplingParams | list[SamplingParams] | None = None, chat: bool = False
    ) -> Iterator[TokenEvent]:
        """Yield a `TokenEvent` for every token of every request, as soon as it is sampled."""
        requests = self._requests(prompts, params, chat)
        yield from self._stream_requests(requests)

    def _stream_requests(self, requests: list[Request]) -> Iterator[TokenEvent]:
        index = {r.request_id: i for i, r in enumerate(requests)}
        runner = self._runner()
        tracer = active_tracer()
        if tracer is not None:
            tracer.model = self.describe()
        for req, token, delta in runner.run(requests):
            reason = req.finish_reason.value if req.finish_reason else None
            yield TokenEvent(req.request_id, index[req.request_id], token, delta, req.finished, reason)
        self.last_stats = runner.stats
        if tracer is not None:
            tracer.summary = run_summary(requests, runner.stats)

    def describe(self) -> dict:
        """The model and run settings, as the tracer and benchmarks record them."""
        cfg = self.config
        return {
            "name": cfg.name if cfg.name in PRESETS else Path(cfg.name).name,  # a preset, or the file/folder name
            "source": self.loaded.source,
            "num_layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size,
            "num_heads": cfg.num_heads,
            "num_kv_heads": cfg.num_kv_heads,
            "group_size": cfg.group_size,
            "head_dim": cfg.head_dim,
            "intermediate_size": cfg.intermediate_size,
            "vocab_size": cfg.vocab_size,
            "rope": describe_rope(cfg.rope_theta, cfg.rope_scaling),  # the cos_sin_cache's frequencies
            "max_model_len": self.max_model_len,
            "mode": self.mode,
            "backend": self.ops.describe(),
            "dtype": str(self.loaded.dtype).removeprefix("torch."),
            "device": str(self.loaded.device),
        }

    def generate(
        self, prompts: str | list[str], params: SamplingParams | list[SamplingParams] | None = None, chat: bool = False
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of `prompts`."""
        requests = self._requests(prompts, params, chat)
        for _ in self._stream_requests(requests):
            pass
        return [RequestOutput.of(r) for r in requests]

    # ---- stepping by hand (paged mode) ------------------------------------------------------

    def _require_paged(self, what: str) -> PagedRunner:
        if self.engine is None:
            raise StagewiseError(f"{what} needs mode='paged' (this LLM runs mode='{self.mode}')")
        return self.engine

    def add_request(self, prompt: str, params: SamplingParams | None = None, chat: bool = False) -> str:
        """Queue one request in the engine; returns its id. Run it with `step()`."""
        engine = self._require_paged("add_request")
        req = self.make_request(prompt, params if params is not None else SamplingParams(), chat)
        engine.add(req)
        self._stepped[req.request_id] = len(self._stepped)
        return req.request_id

    def step(self) -> list[TokenEvent]:
        """Run one engine iteration; returns the tokens sampled in it (one per request that sampled)."""
        engine = self._require_paged("step")
        if not engine.has_unfinished():
            return []
        events = []
        self.last_stats = engine.stats  # counters of the hand-stepped run so far
        for req, token, delta in engine.step():
            reason = req.finish_reason.value if req.finish_reason else None
            events.append(
                TokenEvent(req.request_id, self._stepped.get(req.request_id, -1), token, delta, req.finished, reason)
            )
        return events

    def has_unfinished_requests(self) -> bool:
        return self.engine is not None and self.engine.has_unfinished()
