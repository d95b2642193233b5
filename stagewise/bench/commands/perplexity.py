"""What keeping the weights quantized costs in accuracy: perplexity of a fixed text, greedy agreement.

    stagewise bench perplexity [--model smollm2-135m] [--backends naive,torch] [--max-tokens 32]

Perplexity. Feed the text's tokens t_1 .. t_n through the model in one pass; at every position i
the model gives a distribution over the next token, and the text's own next token t_(i+1) has
some probability p_i under it. Then

    perplexity = exp( -1/(n-1) * sum_i log p_i )

the geometric mean of 1 / p_i: "as unsure as a uniform choice among this many tokens". A model
that spreads its bets evenly over a V-token vocabulary scores exactly V; lower is better. The text
is fixed (`english_text.py`, a public-domain chapter), so two weight formats of one model are
compared on the same predictions.

Greedy agreement: the same prompts decoded greedily by both; for each prompt, how many generated
tokens agree before the first difference. One near-tie rounded the other way changes every later
token, so agreement measures how often the two models' top choice flips, not how far apart they are.

For each tier asked for, the model dequantized to float32 (`quantization="none"`) and the model kept
packed (`"auto"`) run the same tier, so only the weights' format differs. The naive tier expands the
packed blocks with llama.cpp's exact formula, so it must reproduce float32 bit for bit. The torch tier
multiplies by packed weights with the integer-dot kernel where it is built (`cpu/int8_dot.py`:
activations rounded to int8 per block of 32, as llama.cpp does), and "torch-stock" is the same tier
with PyTorch's own kernels (int4pack / bfloat16: scales and activations rounded to bfloat16), as on a
machine without a compiler; the two side by side say what the integer arithmetic changes.
"""

import math
import time
from dataclasses import dataclass

import torch

from stagewise.bench.harness.agreement import PROMPTS, agreement
from stagewise.bench.harness.english_text import SOURCE, TEXT
from stagewise.bench.harness.machine import machine_info
from stagewise.engine.llm import LLM
from stagewise.errors import StagewiseError
from stagewise.kv.none import NoKVCache
from stagewise.models.forward_batch import ForwardBatch
from stagewise.models.llama import LlamaModel
from stagewise.models.ops import StageOps
from stagewise.models.prepare import build_packed_forms
from stagewise.sampling_params import SamplingParams

STOCK = "torch-stock"  # the torch tier with PyTorch's own packed kernels (STAGEWISE_CPU_KERNELS=0)


def tier_of(backend: str) -> str:
    return "torch" if backend == STOCK else backend


def load_stock(model: str):
    """The packed model with the torch tier's forms built by PyTorch's kernels' rules (int4pack)."""
    from stagewise.cpu import build
    from stagewise.models.registry import load_model

    loaded = load_model(model, device="cpu", quantization="auto")
    with build.switched(False):
        build_packed_forms(loaded.weights, StageOps("torch").backends)
    return loaded


@dataclass(frozen=True)
class PerplexitySettings:
    model: str = "smollm2-135m"  # a GGUF (or preset) whose quantized tensors are compared
    backends: tuple[str, ...] = ("naive", "torch")  # tiers, each run on both weight formats
    text_tokens: int | None = None  # the first N tokens of the text (None: all of it)
    prompts: int = len(PROMPTS)  # the first N of the greedy prompts
    max_tokens: int = 32  # greedy tokens generated per prompt


def token_nll(loaded, backend: str, ids: list[int]) -> torch.Tensor:
    """-log p(t_(i+1) | t_1 .. t_i) for i = 1 .. n-1: [n-1] float64, one forward pass over the ids."""
    if len(ids) < 2:
        raise StagewiseError(f"perplexity needs at least 2 tokens, got {len(ids)}")
    if len(ids) > loaded.config.max_position_embeddings:
        raise StagewiseError(f"{len(ids)} tokens exceed the model's {loaded.config.max_position_embeddings}")
    ops = StageOps(backend)
    build_packed_forms(loaded.weights, ops.backends)  # the tier's own forms of packed weights, built once
    model = LlamaModel(loaded, ops)
    batch = ForwardBatch.from_sequences([ids], [0], loaded.device)
    batch.last_token_index = torch.arange(len(ids) - 1, device=loaded.device)  # logits at 1 .. n-1
    with torch.inference_mode():
        logits = model.forward(batch, NoKVCache(batch.cu_seqlens_q))  # [n-1, vocab]
    log_probs = torch.log_softmax(logits.double(), dim=-1)  # [n-1, vocab]
    targets = torch.tensor(ids[1:], device=log_probs.device)  # [n-1]: each position's next token
    return -log_probs.gather(1, targets[:, None])[:, 0]  # [n-1]


def perplexity(loaded, backend: str, ids: list[int]) -> float:
    """exp(mean negative log-likelihood of each next token of `ids`)."""
    return math.exp(float(token_nll(loaded, backend, ids).mean()))


def greedy_tokens(loaded, backend: str, prompts: list[str], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [o.token_ids for o in LLM(loaded, backend=backend, mode="kv").generate(prompts, params)]


def greedy_agreement(reference, candidate, backend: str, prompts: list[str], max_tokens: int) -> list[int]:
    """Per prompt: greedy tokens of `candidate` equal to `reference`'s before the first difference."""
    want = greedy_tokens(reference, backend, prompts, max_tokens)
    got = greedy_tokens(candidate, backend, prompts, max_tokens)
    return [agreement(a, b) for a, b in zip(got, want)]


def run_perplexity(s: PerplexitySettings, progress=None) -> dict:
    """Both weight formats of `s.model` in every tier of `s.backends`: perplexity and greedy agreement."""
    from stagewise.models.registry import load_model

    say = progress or (lambda line: None)
    start = time.perf_counter()
    floats = load_model(s.model, device="cpu", quantization="none")
    packed = load_model(s.model, device="cpu", quantization="auto")
    ids = floats.tokenizer.encode(TEXT)[: s.text_tokens]
    prompts = PROMPTS[: s.prompts]
    result: dict = {"model": s.model, "machine": machine_info(), "text": SOURCE, "text_tokens": len(ids), "tiers": {}}
    result["kinds_packed"] = sorted({t.kind for t in packed.weights.packed()})
    for backend in s.backends:
        tier, kept = tier_of(backend), load_stock(s.model) if backend == STOCK else packed
        say(f"{backend}: perplexity of {len(ids)} tokens, float32 then packed")
        ppl_f, ppl_p = perplexity(floats, tier, ids), perplexity(kept, tier, ids)
        say(f"{backend}: greedy agreement on {len(prompts)} prompts x {s.max_tokens} tokens")
        agree = greedy_agreement(floats, kept, tier, prompts, s.max_tokens)
        result["tiers"][backend] = {
            "perplexity_float32": ppl_f,
            "perplexity_packed": ppl_p,
            "relative_change": ppl_p / ppl_f - 1,
            "greedy_agreement": agree,
            "prompts_fully_agreeing": sum(a == s.max_tokens for a in agree),
            "tokens_agreeing_share": sum(agree) / (len(agree) * s.max_tokens),
        }
    result["greedy_tokens_per_prompt"] = s.max_tokens
    result["seconds"] = time.perf_counter() - start
    return result


def perplexity_table(r: dict):
    from rich.table import Table

    title = (
        f"{r['model']}: {r['text_tokens']} tokens of {r['text'].split(';')[0]}; greedy {r['greedy_tokens_per_prompt']}"
    )
    table = Table(title=title + " tokens per prompt")
    for col in ("tier", "perplexity float32", "kept packed", "change", "greedy: prompts agreeing", "tokens"):
        table.add_column(col, justify="left" if col == "tier" else "right")
    for tier, row in r["tiers"].items():
        table.add_row(
            tier,
            f"{row['perplexity_float32']:.4f}",
            f"{row['perplexity_packed']:.4f}",
            f"{row['relative_change']:+.3%}",
            f"{row['prompts_fully_agreeing']} of {len(row['greedy_agreement'])}",
            f"{row['tokens_agreeing_share']:.0%}",
        )
    return table


def plot_perplexity(r: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tiers = list(r["tiers"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    xs = range(len(tiers))
    left.bar([x - 0.2 for x in xs], [r["tiers"][t]["perplexity_float32"] for t in tiers], 0.4, label="float32")
    left.bar([x + 0.2 for x in xs], [r["tiers"][t]["perplexity_packed"] for t in tiers], 0.4, label="kept packed")
    left.set_xticks(list(xs), tiers)
    left.set_ylabel("perplexity (lower is better)")
    left.set_title(f"{r['text_tokens']} tokens of a fixed text", fontsize=10)
    left.legend()
    for t in tiers:
        right.plot(r["tiers"][t]["greedy_agreement"], marker="o", label=t)
    right.axhline(r["greedy_tokens_per_prompt"], color="gray", linestyle=":")
    right.set_xlabel("prompt")
    right.set_ylabel("greedy tokens equal to float32's")
    right.legend()
    fig.suptitle(f"{r['model']}: weights kept quantized vs dequantized to float32", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)
