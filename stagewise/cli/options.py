"""Options that several commands share (generate, serve): one definition, one help text.

Typer reads a command's options from its parameters' defaults, so a shared
option is one `typer.Option(...)` object used as the default in each command:

    def serve(model: str = MODEL, backend: str = BACKEND, ...): ...
"""

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


def speculative_arg(config_json: str | None, shorthand: str | None) -> str | None:
    """The one speculative setting given (--speculative-config or --speculative), checked."""
    if config_json is not None and shorthand is not None:
        raise StagewiseError("give --speculative-config or --speculative, not both")
    value = config_json if config_json is not None else shorthand
    if value is not None:
        from stagewise.engine.speculative.config import parse_speculative_config

        parse_speculative_config(value)  # a bad value is one line now, before the model loads
    return value


def load_llm(model: str, *, dtype: str | None, stage_backend: list[str], **settings):
    """`LLM(model, ...)` for a command: the dtype and per-stage tiers parsed from their options, and a
    status line per load phase on stderr (a terminal only). `settings` are LLM's other keywords."""
    from stagewise.bench.progress import load_status
    from stagewise.engine.llm import LLM

    with load_status():
        return LLM(model, dtype=parse_dtype(dtype), stage_backends=parse_stage_backends(stage_backend), **settings)
