"""What a class asks on its first trace, answered on screen: which block-table entries are padding,
every weight the run used (a prefill chunk first, the triton tier's fused kernels), the tier that
really tokenizes, a byte token shown as its bytes, why step 0 is slow, and that `tiny` is noise."""

import io

from rich.console import Console

from stagewise import LLM, SamplingParams
from stagewise.config import EngineConfig
from stagewise.models.ops import StageOps
from stagewise.stages import tokenize
from stagewise.trace.render_tree import FIRST_CALL, render_tree, token_decoder
from stagewise.trace.tracer import Tracer

LONG = "The quick brown fox jumps over the lazy dog while the cat sleeps on a warm windowsill"


def printed(renderable, width: int = 400) -> str:
    console = Console(file=io.StringIO(), width=width, no_color=True)
    console.print(renderable)
    return console.file.getvalue()


def traced(llm, prompts, max_tokens: int = 2, timing: bool = True) -> Tracer:
    with Tracer(timing=timing) as tracer:
        llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return tracer


def test_block_table_padding_is_named_and_every_weight_is_listed(tiny):
    """A 40-token prompt in 16-token chunks beside a 2-token one: step 0 is a prefill chunk (no lm_head
    runs in it), and from step 2 on the short request's block-table row is padded with 0s."""
    ecfg = EngineConfig(block_size=4, num_kv_blocks=64, max_num_batched_tokens=16)
    tracer = traced(LLM(tiny, engine_config=ecfg), [LONG, "Hi"])
    assert "lm_head" not in {rec.stage for rec in tracer.steps[0].stages}
    text = printed(render_tree(tracer, layers="first", decode=token_decoder(LLM(tiny).tokenizer), compact=True))
    padded = [step for step in tracer.steps if len(step.batch["block_table"]) == 2]
    assert padded, "no step ran both requests"
    row = padded[0].batch["block_table"][1]
    blocks = padded[0].requests[1]["blocks"]
    assert row[len(blocks) :] == [0] * (len(row) - len(blocks)) and len(row) > len(blocks)
    pad = len(row) - len(blocks)
    assert f"row 1: [{', '.join(map(str, blocks))}] + padding 0 x {pad} (past its blocks: never read)" in text
    assert "row 0: [0, 1, 2, 3]" in text  # a row without padding prints as it is
    weights = text.split("weights (every one the run used; the same at every step)")[1].split("step 0")[0]
    assert "lm_head: w_lm [96,512]" in weights  # run from step 2 on, listed all the same
    assert FIRST_CALL in " ".join(text.split())  # step 0's first-call times, explained
    untimed = printed(render_tree(traced(LLM(tiny), ["Hi"], timing=False), with_time=False))
    assert "first call" not in untimed


def test_triton_tier_lists_its_fused_weights(tiny):
    """Under --backend triton with invariance off, rmsnorm+qkv_proj is one decode kernel whose weights are
    `norm_weight` and `w` (a decode-only fusion: it runs only where rows may differ by batch)."""
    tracer = traced(LLM(tiny, backend="triton", batch_invariant=False), ["Hi"], max_tokens=2)
    text = printed(render_tree(tracer, layers="first", decode=str, compact=True))
    weights = text.split("weights (every one")[1].split("step 0")[0]
    assert "qkv_proj (each layer): norm_weight [96]" in weights and "qkv_proj (each layer): w [96,160]" in weights
    assert "lm_head: w_lm [96,512]" in weights


def test_tokenize_is_labelled_with_what_runs(tiny):
    """tokenize's "triton" tier is the Rust `tokenizers` library: the trace says rust."""
    loaded = LLM(tiny).tokenizer
    for backend, label in (("triton", "rust"), ("torch", "naive"), ("naive", "naive")):
        with Tracer() as tracer:
            StageOps(backend)(tokenize, text="Hello there", tokenizer=loaded)
        assert [(rec.stage, rec.backend) for rec in tracer.prelude] == [("tokenize", label)]


def test_a_byte_token_prints_as_its_bytes(tiny):
    """'é' is two byte tokens in tiny's vocabulary; either alone is half a character: shown as bytes."""
    llm = LLM(tiny)
    decode = token_decoder(llm.tokenizer)
    first, second = llm.tokenizer.encode("é")
    assert (decode([first]), decode([second]), decode([first, second])) == (b"\xc3", b"\xa9", "é")
    tracer = traced(llm, ["Hi"], max_tokens=1)
    step = tracer.steps[-1]
    rid = next(iter(step.sampled))
    step.sampled[rid] = first  # this run's last step, as if it had sampled the first byte of 'é'
    text = printed(render_tree(tracer, decode=decode))
    assert f"sampled token {first} b'\\xc3' (bytes: part of a character)" in text


def test_tiny_says_its_weights_are_random(tiny):
    header = printed(render_tree(traced(LLM(tiny), ["Hi"], max_tokens=1))).splitlines()[0:3]
    assert "random weights (seeded: the text is noise, the shapes and times are real)" in " ".join(header)
