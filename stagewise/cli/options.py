"""Options that several commands share (generate, serve): one definition, one help text.

Typer reads a command's options from its parameters' defaults, so a shared
option is one `typer.Option(...)` object used as the default in each command:

    def serve(model: str = MODEL, backend: str = BACKEND, ...): ...
"""

import os
import sys

import typer

from stagewise.errors import StagewiseError

MODEL = typer.Option("smollm2-135m", help="preset name, .gguf file or Hugging Face Llama directory")
BACKEND = typer.Option("torch", help="stage tier: naive (textbook), torch (fast PyTorch) or triton")
STAGE_BACKEND = typer.Option([], help="per-stage override, e.g. attention=naive (repeatable)")
SPECIAL_TOKENS = typer.Option(
    False, "--special-tokens", help="let prompts hold control tokens like <|im_start|> (trusted input only)"
)
DEVICE = typer.Option(None, help="cpu or cuda (default: cuda when available)")
DTYPE = typer.Option(None, help="float32, bfloat16 or float16 (default: float32 on CPU)")
TENSOR_PARALLEL_SIZE = typer.Option(
    1, "--tensor-parallel-size", "--tp", help="split the model over N ranks (processes; gloo on CPU, NCCL on GPUs)"
)
RECALIBRATE = typer.Option(
    False, "--recalibrate", help="measure the CPU GEMM forms again instead of reading their cache"
)
QUANTIZATION = typer.Option(
    "auto",
    "--quantization",
    help="auto (default): a GGUF's Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K weights stay packed (the fast CPU tier "
    "computes them in bfloat16); none: dequantize to floats; int8 / int4 (int4:g64, g128): a Hugging "
    "Face checkpoint quantized at load, round to nearest, groups of 32 by default",
)
BATCH_INVARIANT = typer.Option(
    True,
    "--batch-invariant/--no-batch-invariant",
    help="a request's logits the same bits whoever shares its batch (default); --no-batch-invariant: "
    "the torch tier's faster batch-variant paths (one-product prefill attention, unpadded GEMM rows)",
)

PREFIX_CACHE = typer.Option(
    None,
    "--prefix-cache",
    help="paged mode's prefix cache: hash (default; vLLM: whole blocks named by a digest), radix (SGLang: a "
    "tree of token runs, a match may end inside a block) or none",
)


def prefix_cache_arg(value: str | None) -> str | None:
    """--prefix-cache, checked before the model loads (None: the engine's default)."""
    if value is not None:
        from stagewise.kv.prefix_cache import check_prefix_cache

        check_prefix_cache(value)
    return value


DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16"}


def parse_dtype(name: str | None):
    import torch

    if name is None:
        return None
    if name not in DTYPES:
        raise StagewiseError(f"unknown dtype '{name}'; use one of float32, bfloat16, float16")
    return getattr(torch, DTYPES[name])


def parse_stage_backends(items: list[str]) -> dict[str, str]:
    """["attention=naive", ...] -> {"attention": "naive"}."""
    out = {}
    for item in items:
        if "=" not in item:
            raise StagewiseError(f"--stage-backend expects STAGE=BACKEND, got '{item}'")
        stage, backend = item.split("=", 1)
        out[stage.strip()] = backend.strip()
    return out


SPECULATIVE_CONFIG = typer.Option(
    None,
    "--speculative-config",
    help='speculative decoding as JSON, vLLM style: \'{"method": "ngram", "num_speculative_tokens": 4, '
    '"prompt_lookup_max": 4}\' or \'{"method": "draft_model", "model": PATH}\' (paged mode)',
)
SPECULATIVE = typer.Option(
    None, "--speculative", help="speculative decoding, short: ngram:K or draft:PATH:K (paged mode)"
)


def check_not_the_model(out: str, model: str, what: str = "--out") -> None:
    """Refuse an output path that is a file the model is read from: writing it would replace the model."""
    import os

    from stagewise.files import resolve_output
    from stagewise.models.files import files_of_model

    target, _ = resolve_output(out, what)
    if not target.exists():
        return
    for source in files_of_model(model):
        try:
            same = os.path.samefile(target, source)
        except OSError:
            continue
        if same:
            raise StagewiseError(
                f"{what} {out} is a file of the model being read ({source}); writing it would replace the model"
            )


def speculative_arg(config_json: str | None, shorthand: str | None) -> str | None:
    """The one speculative setting given (--speculative-config or --speculative), checked."""
    if config_json is not None and shorthand is not None:
        raise StagewiseError("give --speculative-config or --speculative, not both")
    if config_json is not None:
        import json

        try:
            value = json.loads(config_json)
        except ValueError:
            value = None  # not JSON: the shorthand ("ngram:4"), or JSON's own error below
        if value is not None and not isinstance(value, dict):
            kind = {list: "a list", str: "a string", bool: "a boolean"}.get(type(value), "a number")
            raise StagewiseError(
                f'--speculative-config must be a JSON object such as \'{{"method": "ngram"}}\', got {kind}'
            )
    value = config_json if config_json is not None else shorthand
    if value is not None:
        from stagewise.engine.speculative.config import parse_speculative_config

        parse_speculative_config(value)  # a bad value is one line now, before the model loads
    return value


def load_llm(model: str, *, dtype: str | None, stage_backend: list[str], **settings):
    """`LLM(model, ...)` for a command: the dtype and per-stage tiers parsed from their options, and a
    status line per load phase on stderr (a terminal only). `settings` are LLM's other keywords."""
    from stagewise.bench.harness.progress import load_status
    from stagewise.engine.llm import LLM

    with load_status():
        llm = LLM(model, dtype=parse_dtype(dtype), stage_backends=parse_stage_backends(stage_backend), **settings)
    if llm.loaded.random_weights and not os.environ.get("STAGEWISE_QUIET"):
        name = llm.describe()["name"]
        print(
            f"note: {name} has random weights (seeded): its text is noise; its shapes and speed are real "
            "(the default model, smollm2-135m, writes English)",
            file=sys.stderr,
        )
    return llm
