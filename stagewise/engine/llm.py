"""`LLM`: the user-facing API — load a model once, then generate or stream.

    llm = LLM(model="smollm2-135m", mode="kv")   # backend="torch": the fast PyTorch tiers
    outs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0))
    for event in llm.stream(["Tell me a story"], SamplingParams(max_tokens=64)):
        print(event.text, end="")

User text never becomes control tokens: a prompt, or a chat message's content,
is tokenized as plain text, and only the chat template's own markers are
control tokens (`engine/prompts.py`); `special_tokens=True` trusts the prompt.

Modes: "paged" (default) is continuous batching over a paged KV cache, "naive"
recomputes the whole sequence every step (no cache), "kv" runs static batches
over a contiguous per-request KV cache.

`backend` picks the tier of every stage; `stage_backends` overrides single
stages ({"attention": "naive"}); `describe()["backend"]` says what ran:

    "naive"   the textbook formula of every stage in PyTorch (the reference)
    "torch"   the faster PyTorch tier where a stage has one (the calibrated CPU
              GEMM forms, the batched paged decode, RoPE in fewer ops), naive
              elsewhere. The default, on a CPU and on a CUDA GPU alike.
    "triton"  the Triton kernels (the interpreter on a CPU: slow, for checking)

Why "torch" on a GPU too: eager steps are host-bound, and the committed H200
run (`benchmarks/README.md`, batch 1, paged) measured a SmolLM2 decode step at
28.0 ms in PyTorch against 30.2 ms eager Triton (Llama-3-8B shapes: 23.4 ms
against 28.3). Triton wins once the step replays from a CUDA graph (1.35 ms,
5.16 ms): ask for `backend="triton", engine_config=EngineConfig(cuda_graphs=True)`.
Greedy graphed steps then read their ids one step late, the next step queued
first (`defer_graph_reads`, on by default; engine/graph_runner.py).

Stepping the engine by hand (paged mode), one iteration at a time:

    llm.add_request("Hello", SamplingParams(max_tokens=4))
    while llm.has_unfinished_requests():
        for event in llm.step():
            print(event.request_id, event.token_id, event.text)

In paged mode there is one engine: requests from `add_request` and from live
streams share it, and each engine step routes each token to its owner's inbox
(a stream yields its own; `step()` returns add_request's), whichever call ran
the step (`engine/shared_engine.py`). A stream closed early (`break`, an
exception, Ctrl-C, the iterator dropped) aborts its unfinished requests and
frees their blocks; a step whose forward pass raised is undone (running
requests recompute, blocks it named unnamed), so the `LLM` stays usable after
any interruption, a second Ctrl-C during the cleanup included.

A request that makes an engine step fail is found (the step's requests rerun
one at a time) and finished with `finish_reason="error"`: a stream yields that
as its final event for the request (`event.error` says why), `generate` raises
`RequestFailed` naming it, and every other request goes on.

Threads: one `LLM` may be called from several threads at once (a server's
handlers, say). Each engine step runs under the LLM's lock, so the threads take
turns step by step, and their requests share the batch; the lock is never
held while a stream yields, so a thread that stops between two tokens blocks
nobody, and several streams may be interleaved in one thread too. Greedy
outputs are the same as each request run alone. Modes "kv" and "naive" take
the lock for each of their steps as well; `last_stats` is the last call's,
whichever thread made it.

Batch invariance (the project's design notes; on by default): a request's logits, and so its
greedy tokens, are the same bits whoever shares its steps — alone or among 32,
whatever the chunking of its prompt, after preemption, verified among k + 1
speculative rows, in modes "naive", "kv" and "paged" — on the torch tier, for
float and packed weights. `LLM(..., batch_invariant=False)` runs the torch tier's
faster batch-variant paths instead (`Stage.torch_variant`): a prefill's
attention in one product, GEMM forms chosen by the row count. Out of scope:
the naive tier (the textbook's products, `stages/attention.py` says why),
results across tiers or dtypes, and across tensor-parallel degrees (a run with
tensor_parallel_size > 1 says so once).

Tensor parallelism (`stagewise/parallel/`): `LLM(..., tensor_parallel_size=N)`
splits every matrix over N ranks — this process is rank 0 (it schedules and
samples), ranks 1..N-1 are worker processes started here (gloo on a CPU, NCCL
on GPUs) or by torchrun. Every mode runs under it; `shutdown()` (or a `with`
block) ends the workers. An interrupted or failed tensor-parallel step shuts
every rank down: that `LLM` then refuses further steps.
"""

import copy
import itertools
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from stagewise.config import DEFAULT_MODEL, PRESETS, EngineConfig, ParallelConfig
from stagewise.engine.build import build_model, build_paged_runner
from stagewise.engine.checks import (
    check_flags,
    check_llm_arguments,
    engine_config_of,
    max_model_len_of,
    parallel_config_of,
    speculative_config_of,
)
from stagewise.engine.kv_runner import KVRunner
from stagewise.engine.naive_runner import NaiveRunner
from stagewise.engine.outputs import RequestFailed, RequestOutput, TokenEvent, run_summary
from stagewise.engine.paged_runner import PagedRunner
from stagewise.engine.prompts import check_text, encode_prompt
from stagewise.engine.request import FinishReason, Request, RequestStatus, prompt_indices
from stagewise.engine.run_stats import RunStats
from stagewise.engine.shared_engine import SharedEngine
from stagewise.engine.speculative import SpeculativeConfig
from stagewise.engine.text_stream import TextStream
from stagewise.errors import StagewiseError
from stagewise.models.chat_template import apply_chat_template
from stagewise.models.ops import StageOps
from stagewise.models.prepare import prepare_weights
from stagewise.models.quantized import weight_formats
from stagewise.models.registry import LoadedModel, load_model
from stagewise.runtime import load_phase
from stagewise.sampling_params import SamplingParams, sample_seed
from stagewise.stages.rope import describe_rope
from stagewise.trace.hooks import active_tracer


class LLM:
    def __init__(
        self,
        model: str | LoadedModel = DEFAULT_MODEL,
        backend: str = "torch",
        mode: str = "paged",
        device: str | None = None,
        dtype=None,
        stage_backends: dict[str, str] | None = None,
        engine_config: EngineConfig | None = None,
        special_tokens: bool = False,
        tensor_parallel_size: int = 1,
        parallel_config: ParallelConfig | None = None,
        recalibrate: bool = False,
        quantization: str = "auto",
        speculative_config: dict | str | SpeculativeConfig | None = None,
        batch_invariant: bool = True,
        prefix_cache: str | None = None,
    ):
        # 1. validate the arguments (engine/checks.py), before anything is loaded
        check_llm_arguments(model, backend, mode, device, dtype, stage_backends, engine_config)
        engine_config = engine_config_of(engine_config, prefix_cache)
        self.speculative_config = speculative_config_of(speculative_config, mode)
        pcfg = parallel_config_of(tensor_parallel_size, parallel_config)
        check_flags(
            special_tokens=special_tokens, recalibrate=recalibrate, batch_invariant=batch_invariant
        )
        self.special_tokens = special_tokens  # True: prompts may hold control tokens (trusted)
        self.mode = mode
        # batch_invariant (the default): a request's numbers never depend on its batch
        self.ops = StageOps(backend, stage_backends, batch_invariant=batch_invariant)
        # 2. load the model. quantization "auto" (the default): a GGUF's Q4_0/Q4_1/Q8_0 (and
        # K-quant) weights stay packed, 4-8 bits per weight; "none": all float, as a Hugging Face
        # model computes (the packed torch tier computes in bfloat16, so its greedy tokens can
        # part from the float model's after a near-tie)
        self.loaded = (
            model
            if isinstance(model, LoadedModel)
            else load_model(model, device, dtype, quantization=quantization)
        )
        self.config = self.loaded.config
        self.tokenizer = copy.copy(self.loaded.tokenizer)  # its own: a chat_template set stays here
        self.engine_config = engine_config or EngineConfig()
        self.max_model_len = max_model_len_of(self.config, self.engine_config)
        # 3. ready the weights for the tiers that run them (on one device)
        self.tensor_parallel_size = pcfg.tensor_parallel_size
        if pcfg.tensor_parallel_size == 1:
            # The tiers' forms of these weights, built once: the CPU GEMM forms (from this
            # machine's cache when it measured the same shapes before) and the packed weights'
            # torch-tier layout; a no-op off the CPU or when no stage runs the torch tier.
            prepare_weights(
                self.loaded.weights, self.ops.backends, recalibrate, source=self.loaded.source
            )
        with load_phase(f"building the engine (backend {self.ops.describe()})"):
            # 4. the model on one device, or tensor parallelism's ranks started (engine/build.py)
            self.model = build_model(self.loaded, self.ops, pcfg, self.engine_config)
            # 5. paged mode keeps one engine (KV cache, block manager, prefix cache) for the
            # LLM's lifetime; modes "kv" and "naive" build a runner per call
            self.engine = build_paged_runner(self) if mode == "paged" else None
        self._ids = itertools.count()
        self.last_stats = RunStats()  # counters of the most recent generate/stream call
        self._lock = threading.RLock()  # held for each engine step, never while a stream yields
        # paged mode: every call shares the one engine; each token goes to its request's owner
        self._shared = SharedEngine(self.engine, self._lock) if self.engine is not None else None

    def shutdown(self) -> None:
        """End the tensor-parallel workers (a no-op on one device); also on a `with` block's exit.

        LLMs of other modes over the same LoadedModel and N share one set of ranks (one process
        group per process); the last of them to shut down ends the workers. A speculative
        proposer is closed too (a draft model's KV cache freed)."""
        proposer = getattr(self.engine, "proposer", None)
        if proposer is not None:
            self.engine.proposer = None
            proposer.close()
        if hasattr(self.model, "release") and not self._released:
            self._released = True
            self.model.release()

    _released = False

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def weightless(self) -> bool:
        """True for shape-only models (meta device): they can be traced, not run."""
        return self.config.shape_only or self.loaded.device.type == "meta"

    def _check_runnable(self) -> None:
        if self.weightless and active_tracer() is None:
            name = self.describe()["name"]
            raise StagewiseError(
                f"{name} has no weights (shape only, meta device): it can be traced "
                f"(stagewise trace --model {name}), not run"
            )

    # ---- requests ----------------------------------------------------------------------------

    def format_prompt(self, prompt: str, chat: bool) -> str:
        """Wrap a user message in the model's chat template when `chat` is set."""
        if not chat:
            return prompt
        return apply_chat_template(
            self.tokenizer, [{"role": "user", "content": prompt}], add_generation_prompt=True
        )

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """Token ids of a prompt as a request gets them (user text never becomes control tokens)."""
        return encode_prompt(self.ops, self.tokenizer, prompt, chat, self.special_tokens)[1]

    def make_request(
        self,
        prompt: str,
        params: SamplingParams,
        chat: bool = False,
        arrival_time: float | None = None,
    ) -> Request:
        """Validate and tokenize one prompt; raises StagewiseError on bad input."""
        arrival_time = arrival_time if arrival_time is not None else time.perf_counter()
        check_text(prompt)
        if not isinstance(params, SamplingParams):
            raise StagewiseError(f"params must be a SamplingParams, got {type(params).__name__}")
        if params.logprobs is not None and params.logprobs > self.config.vocab_size:
            raise StagewiseError(
                f"logprobs={params.logprobs} is more than the vocabulary "
                f"({self.config.vocab_size} tokens)"
            )
        text, ids = encode_prompt(
            self.ops, self.tokenizer, prompt, chat, self.special_tokens, self.max_model_len
        )
        if len(ids) > self.max_model_len:
            raise StagewiseError(
                f"the prompt has {len(ids)} tokens, more than max_model_len={self.max_model_len}"
            )
        if len(ids) + params.max_tokens > self.max_model_len:
            raise StagewiseError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len={self.max_model_len}; lower max_tokens"
            )
        seed = params.seed if params.seed is not None else random.SystemRandom().randrange(2**63)
        tok = self.tokenizer
        # After visible prompt text the output continues it: "Paris is" + " the" keeps its space
        # (SentencePiece would drop it as a dummy prefix); after markers only (a bare bos) the
        # output starts the text.
        continuation = bool(tok.decode(ids[-8:], skip_special_tokens=True))
        return Request(
            request_id=f"req-{next(self._ids)}",
            prompt=text,
            prompt_token_ids=ids,
            params=params,
            seed=seed,
            arrival_time=arrival_time,
            text_stream=TextStream(
                decode=lambda t: tok.decode(t, skip_special_tokens=True, continuation=continuation),
                stop=params.stop,
            ),
        )

    def _requests(self, prompts, params, chat: bool) -> list[Request]:
        self._check_runnable()
        if not isinstance(chat, bool):
            raise StagewiseError(f"chat must be True or False, got {chat!r}")
        if not isinstance(prompts, str | list | tuple):
            raise StagewiseError(
                f"prompts must be a string or a list of strings, got {type(prompts).__name__}"
            )
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not prompts:
            raise StagewiseError("no prompts given")
        params = params if params is not None else SamplingParams()
        per_prompt = list(params) if isinstance(params, list | tuple) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise StagewiseError(f"{len(prompts)} prompts but {len(per_prompt)} SamplingParams")
        # all prompts of one call arrive together, before any tokenization
        arrival = time.perf_counter()
        firsts = [self.make_request(p, sp, chat, arrival) for p, sp in zip(prompts, per_prompt)]
        # parallel sampling: every prompt's first sample, then the others (each waits for its
        # first sample's prompt, whose blocks it shares; engine/scheduler.py)
        return firsts + [s for first in firsts for s in self._more_samples(first)]

    def _more_samples(self, first: Request) -> list[Request]:
        """Samples 1 .. n-1 of `first`'s prompt (SamplingParams.n): the same prompt, each with its
        own random stream (seeded: sample_seed(seed, i), else an engine-picked seed each)."""
        out = []
        for i in range(1, first.params.n):
            params = first.params
            if params.seed is not None:
                params = replace(params, seed=sample_seed(params.seed, i))
            seed = (
                params.seed if params.seed is not None else random.SystemRandom().randrange(2**63)
            )
            sample = Request(
                request_id=f"req-{next(self._ids)}",
                prompt=first.prompt,
                prompt_token_ids=list(first.prompt_token_ids),
                params=params,
                seed=seed,
                arrival_time=first.arrival_time,
                text_stream=TextStream(decode=first.text_stream.decode, stop=params.stop),
                sample_index=i,
                fork_of=first,
            )
            out.append(sample)
        return out

    # ---- running ----------------------------------------------------------------------------

    def stream(
        self,
        prompts: str | list[str],
        params: SamplingParams | list[SamplingParams] | None = None,
        chat: bool = False,
    ) -> Iterator[TokenEvent]:
        """Yield a `TokenEvent` for every token of every request, as soon as it is sampled.

        Stopping early is fine: when the iterator is closed (a `break`, an exception in the
        loop, Ctrl-C, or the iterator being dropped), its unfinished requests are aborted and
        their KV blocks freed; the `LLM` is ready for the next call.
        """
        requests = self._requests(prompts, params, chat)
        yield from self._stream_requests(requests)

    def _stream_requests(self, requests: list[Request]) -> Iterator[TokenEvent]:
        tracer = active_tracer()
        if tracer is not None:
            tracer.model = self.describe()
        if self.mode == "paged":
            stats = yield from self._stream_paged(requests)
        else:
            stats = yield from self._stream_fresh_runner(requests)
        self.last_stats = stats
        if tracer is not None:
            tracer.summary = run_summary(requests, stats)

    def _stream_fresh_runner(self, requests: list[Request]):
        """Modes "naive" and "kv": a runner of its own for this call; nothing outlives it."""
        pad = self.tokenizer.pad_id if self.tokenizer.pad_id is not None else 0
        eos = self.tokenizer.stop_ids  # every id that ends generation
        if self.mode == "naive":
            runner = NaiveRunner(self.model, eos, self.max_model_len)
        else:
            runner = KVRunner(
                self.model, eos, pad, self.max_model_len, self.engine_config.max_num_seqs
            )
        index = prompt_indices(requests)
        steps = runner.run(requests)
        try:
            while True:
                with self._lock:  # the model serves one thread's step at a time; not across yield
                    item = next(steps, None)
                if item is None:
                    break
                req, token, delta = item
                yield TokenEvent.of(req, index[req.request_id], token, delta)
        finally:
            steps.close()
            for req in requests:
                if not req.finished:
                    req.status, req.finish_reason = RequestStatus.FINISHED, FinishReason.ABORT
        return runner.stats

    def _stream_paged(self, requests: list[Request]):
        """Mode "paged": this stream's requests join the shared engine; its events, its inbox."""
        yield from self._shared.stream(requests)
        return self.engine.stats

    def describe(self) -> dict:
        """The model and run settings, as the tracer and benchmarks record them."""
        cfg = self.config
        return {
            "name": cfg.name
            if cfg.name in PRESETS
            else Path(cfg.name).name,  # a preset, or the file/folder name
            "source": self.loaded.source,
            "num_layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size,
            "num_heads": cfg.num_heads,
            "num_kv_heads": cfg.num_kv_heads,
            "group_size": cfg.group_size,
            "head_dim": cfg.head_dim,
            "intermediate_size": cfg.intermediate_size,
            "vocab_size": cfg.vocab_size,
            "rope": describe_rope(
                cfg.rope_theta, cfg.rope_scaling
            ),  # the cos_sin_cache's frequencies
            "max_model_len": self.max_model_len,
            "mode": self.mode,
            "backend": self.ops.describe(),  # the tier asked for, and per-stage overrides
            "tiers": self.ops.tiers_run(),  # the tier each stage runs ("torch" falls back to naive)
            "dtype": str(self.loaded.dtype).removeprefix("torch."),
            "weights": weight_formats(self.loaded.weights),  # e.g. "q4_1 x 120, q8_0 x 1, ..."
            "device": str(self.loaded.device),
            "tensor_parallel_size": self.tensor_parallel_size,
            "speculative": _describe_spec(self.speculative_config),
            "random_weights": self.loaded.random_weights,  # seeded noise: shapes and times are real
            "batch_invariant": self.ops.batch_invariant,  # False: the torch tier's variant paths
            # the paged engine's prefix cache: "hash", "radix" or "none" (None: another mode)
            "prefix_cache": self.engine.block_manager.prefix_cache if self.engine else None,
        }

    def generate(
        self,
        prompts: str | list[str],
        params: SamplingParams | list[SamplingParams] | None = None,
        chat: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of `prompts`.

        A request that fails in an engine step raises `RequestFailed` (one line naming it); the
        call's other requests are aborted, and the LLM goes on serving later calls."""
        requests = self._requests(prompts, params, chat)
        events = self._stream_requests(requests)
        try:
            for event in events:
                if event.finish_reason == "error":
                    raise RequestFailed(f"prompt {event.index}: {event.error}")
        finally:
            events.close()  # at once, not when the traceback lets go: its requests leave now
        return RequestOutput.per_prompt(requests)

    # ---- stepping by hand (paged mode) ------------------------------------------------------

    def _require_paged(self, what: str) -> PagedRunner:
        if self.engine is None:
            raise StagewiseError(f"{what} needs mode='paged' (this LLM runs mode='{self.mode}')")
        return self.engine

    def add_request(
        self, prompt: str, params: SamplingParams | None = None, chat: bool = False
    ) -> str:
        """Queue one request in the engine; returns its id. Run it with `step()`.

        It shares the engine with any live `stream()`: whichever call runs a step, this
        request's tokens come back from `step()`, and a stream's tokens from the stream.
        """
        engine = self._require_paged("add_request")
        self._check_runnable()
        if not isinstance(chat, bool):
            raise StagewiseError(f"chat must be True or False, got {chat!r}")
        req = self.make_request(prompt, params if params is not None else SamplingParams(), chat)
        engine.check_fits(req)
        self._shared.add([req, *self._more_samples(req)])
        return req.request_id

    def step(self) -> list[TokenEvent]:
        """Run one engine iteration; returns the tokens of requests added with `add_request`.

        That is the tokens sampled in this iteration, plus any sampled for them while a
        stream ran the engine since the last `step()` — none is lost, none is duplicated.
        """
        engine = self._require_paged("step")
        if engine.has_unfinished():
            self._check_runnable()
        events = self._shared.step()
        self.last_stats = engine.stats  # counters of the hand-stepped run so far
        return events

    def has_unfinished_requests(self) -> bool:
        """True while the engine holds requests (from add_request or live streams), or `step()`
        has tokens of add_request's requests still to hand out (sampled while a stream ran)."""
        return self._shared is not None and self._shared.has_unfinished()


def _describe_spec(spec: SpeculativeConfig | None) -> str | None:
    """ "ngram k=4 n=2..4", "draft_model k=3 (draft.gguf)", or None when off."""
    if spec is None:
        return None
    if spec.method == "ngram":
        return f"ngram k={spec.k} n={spec.prompt_lookup_min}..{spec.prompt_lookup_max}"
    return f"draft_model k={spec.k} ({Path(spec.model).name})"
