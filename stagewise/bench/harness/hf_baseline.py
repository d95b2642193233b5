"""The Hugging Face `transformers` baseline: padded static batching with `generate`.

What a plain transformers deployment does with a mixed workload: cut the
requests into batches of `batch_size` in arrival order, left-pad every prompt
of a batch to the batch's longest one, and call `generate` once per batch,
greedy. `generate` cannot stop a row on its own (without an EOS it runs every
row to `max_new_tokens`), so every row generates the batch's longest
`max_tokens` (min_new_tokens = max_new_tokens = that) and we keep only the
first `max_tokens` of each row. The rest is padding waste, as are the pad
tokens of the prompts (the seeds' chapter 7, section 3):

    prompt padding  = sum over rows of (P_max(batch) - P_row)
    output padding  = sum over rows of (max_tokens_max(batch) - max_tokens_row)

The model is the same file stagewise loads (a GGUF or a Hugging Face
directory), and the prompts are the very token ids stagewise's tokenizer
produced, so both sides do the same work. EOS is switched off (the benchmark
requests use `ignore_eos`): with an EOS id set, `min_new_tokens` would forbid
that token and could change the greedy choice. transformers is a dev
dependency only; it is imported here, lazily.

Timing uses a streamer whose `put` is called by `generate` once per decode
step: every token of a batch gets the time its step finished, and every
request arrived when the whole run started, as on the stagewise side.
"""

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from stagewise.bench.harness.timing import StreamedRequest, synchronize
from stagewise.errors import StagewiseError


def static_padding(prompt_lens: list[int], max_tokens: list[int], batch_size: int) -> dict:
    """Padding tokens of padded static batching, batches cut in arrival order (see the module docstring)."""
    prompt_pad = output_pad = 0
    for start in range(0, len(prompt_lens), batch_size):
        p, n = prompt_lens[start : start + batch_size], max_tokens[start : start + batch_size]
        prompt_pad += sum(max(p) - x for x in p)
        output_pad += sum(max(n) - x for x in n)
    return {"prompt_padding_tokens": prompt_pad, "output_padding_tokens": output_pad}


def hf_model_location(model: str) -> tuple[Path, str | None]:
    """(directory, gguf file name or None) of a stagewise model name, for `from_pretrained`."""
    if model == "smollm2-135m":
        from stagewise.models.files import smollm2_gguf_path

        path = smollm2_gguf_path()
        return path.parent, path.name
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.parent, path.name
    if path.is_dir():
        return path, None
    raise StagewiseError(
        f"--compare transformers needs smollm2-135m, a .gguf file or a Hugging Face directory, not '{model}' "
        "(the tiny preset's random weights exist only in stagewise)"
    )


@dataclass
class HFRun:
    requests: list[StreamedRequest]  # useful tokens only, with their times
    prompt_padding_tokens: int  # pad tokens in the prompts
    output_padding_tokens: int  # tokens generated beyond a request's max_tokens
    tokens_computed: int  # rows pushed through the model, padding included
    kv_times_s: list[float] = field(default_factory=list)  # seconds since arrival of each step
    kv_bytes: list[int] = field(default_factory=list)  # KV cache bytes held after that step
    kv_peak_bytes: int = 0  # the largest batch's cache at its end


class _StepClock:
    """A `generate` streamer: the first `put` is the prompt, each later one a step's new tokens [B]."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())  # the tokens are on the host already: the step is done

    def end(self) -> None:
        pass


class HFBaseline:
    def __init__(self, model: str, device: torch.device, dtype: torch.dtype):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local file only: never reach a model hub
        import transformers

        directory, gguf_file = hf_model_location(model)
        kwargs = {"gguf_file": gguf_file} if gguf_file else {}
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, dtype=dtype, local_files_only=True, **kwargs
        )
        self.model = self.model.to(device).eval()
        self.model.generation_config.eos_token_id = None  # never stop or forbid EOS: requests use ignore_eos
        self.device, self.dtype = torch.device(device), dtype
        cfg = self.model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.kv_bytes_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * dtype.itemsize

    def describe(self) -> dict:
        import transformers

        return {"transformers": transformers.__version__, "class": type(self.model).__name__, "dtype": str(self.dtype)}

    @torch.inference_mode()
    def run(
        self, prompt_ids: list[list[int]], max_tokens: list[int], batch_size: int, pad_id: int, on_batch=None
    ) -> HFRun:
        """Generate every request, `batch_size` at a time; `on_batch(num_requests)` after each batch."""
        import transformers

        pads = static_padding([len(p) for p in prompt_ids], max_tokens, batch_size)
        synchronize(self.device)
        arrival = time.perf_counter()
        out = HFRun([StreamedRequest(arrival) for _ in prompt_ids], **pads, tokens_computed=0)
        for start in range(0, len(prompt_ids), batch_size):
            rows = list(range(start, min(start + batch_size, len(prompt_ids))))
            p_max, n_max = max(len(prompt_ids[i]) for i in rows), max(max_tokens[i] for i in rows)
            ids = torch.full((len(rows), p_max), pad_id, dtype=torch.long)  # [B, P_max], left padded
            mask = torch.zeros((len(rows), p_max), dtype=torch.long)
            for b, i in enumerate(rows):
                n = len(prompt_ids[i])
                ids[b, p_max - n :] = torch.tensor(prompt_ids[i])
                mask[b, p_max - n :] = 1
            gen = transformers.GenerationConfig(
                max_new_tokens=n_max, min_new_tokens=n_max, do_sample=False, pad_token_id=pad_id
            )
            clock = _StepClock()
            seqs = self.model.generate(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                generation_config=gen,
                streamer=clock,
            )  # [B, P_max + n_max]
            new = seqs[:, p_max:].tolist()
            if len(clock.times) != n_max or any(len(row) != n_max for row in new):
                raise RuntimeError(f"transformers generated {len(clock.times)} steps, expected {n_max}")
            for b, i in enumerate(rows):
                out.requests[i].token_ids = new[b][: max_tokens[i]]
                out.requests[i].token_times = clock.times[: max_tokens[i]]
            out.tokens_computed += len(rows) * (p_max + n_max - 1)
            for step, t in enumerate(clock.times):  # after step k the cache holds P_max + k tokens per row
                out.kv_times_s.append(t - arrival)
                out.kv_bytes.append(len(rows) * (p_max + step) * self.kv_bytes_per_token)
            out.kv_peak_bytes = max(out.kv_peak_bytes, len(rows) * (p_max + n_max - 1) * self.kv_bytes_per_token)
            if on_batch is not None:
                on_batch(len(rows))
        out.kv_times_s = [0.0, *out.kv_times_s, out.kv_times_s[-1]]  # empty before the first prefill and at the end
        out.kv_bytes = [0, *out.kv_bytes, 0]
        return out
